"""``polysketch bench --decode``: greedy decoding time per token vs position, whole models.

For each attention and each prompt length P, a ``TransformerLM`` (default 4 layers × 256,
4 heads of 64, the sizes of issue 22's "Decoding speed") is prefilled with P random tokens
into its caches; then ``tokens`` greedy steps (one token in, argmax out, the caches updated
in place) are timed after ``warmup`` untimed steps, ``repeats`` times from a fresh prefill;
the median ms/token is reported, with its ratio to softmax (KV cache) at the same P. Softmax
decodes from a KV cache that grows with P; linear attentions (``psf_random``, ``hedgehog``)
from a constant-size state by one fused ``ops.linear_attention_step`` per layer; mixed
attention (``psf_mixed``) from the state of the completed blocks plus the current block.

``time_decode`` is the timing loop, shared with ``benchmarks/decode.py`` (which also times
converted transformers models). Timing: ``time.perf_counter`` around the timed steps, the
device synchronised (CUDA) before and after; ``torch.inference_mode``.
"""

from __future__ import annotations

import csv
import io
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._checks import check_int, check_positive_int

__all__ = ["DECODE_ATTENTIONS", "DECODE_FIELDS", "DecodeBenchConfig", "time_decode",
           "run_decode_benchmark", "format_decode_report", "write_decode_csv"]  # fmt: skip

DECODE_ATTENTIONS = ("softmax", "psf_random", "psf_mixed", "hedgehog")
DECODE_FIELDS = ("attention", "position", "ms_per_token", "x_softmax", "runs_ms")


@dataclass
class DecodeBenchConfig:
    """What ``run_decode_benchmark`` measures (module docstring)."""

    attentions: Sequence[str] = DECODE_ATTENTIONS
    positions: Sequence[int] = (2048, 16384)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    chunk_size: int = 64
    vocab_size: int = 256
    tokens: int = 32
    warmup: int = 4
    repeats: int = 3
    device: str = "cpu"
    seed: int = 0

    def validate(self) -> DecodeBenchConfig:
        for name in ("n_layer", "n_head", "n_embd", "chunk_size", "vocab_size", "tokens",
                     "repeats"):  # fmt: skip
            check_positive_int(getattr(self, name), name)
        check_int(self.warmup, "warmup", minimum=0)
        for p in self.positions:
            check_positive_int(p, "positions")
        return self


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode(
    prefill: Callable[[], object],
    step: Callable[[object], object],
    *,
    tokens: int,
    warmup: int,
    repeats: int,
    device: torch.device | str = "cpu",
) -> tuple[float, list[float]]:
    """(median ms/token, the ``repeats`` ms/token) of ``step`` after ``prefill``.

    ``prefill()`` returns a decoding state (caches and the next token); ``step(state)``
    consumes one token and returns the next state. Each repeat prefills afresh, runs
    ``warmup`` steps, then times ``tokens`` steps.
    """
    device = torch.device(device)
    runs = []
    with torch.inference_mode():
        for _ in range(repeats):
            state = prefill()
            for _ in range(warmup):
                state = step(state)
            _sync(device)
            start = time.perf_counter()
            for _ in range(tokens):
                state = step(state)
            _sync(device)
            runs.append((time.perf_counter() - start) / tokens * 1e3)
    return statistics.median(runs), runs


def _model(config: DecodeBenchConfig, attention: str):
    from ..nn import TransformerConfig, TransformerLM

    cfg = TransformerConfig(vocab_size=config.vocab_size, n_layer=config.n_layer,
                            n_head=config.n_head, n_embd=config.n_embd, attention=attention,
                            chunk_size=config.chunk_size, seed=config.seed,
                            block_size=max(config.positions))  # fmt: skip
    return TransformerLM(cfg).to(config.device).eval()


def run_decode_benchmark(config: DecodeBenchConfig, progress=None) -> list[dict]:
    """One row per (attention, position): ``DECODE_FIELDS`` (module docstring)."""
    config.validate()
    device = torch.device(config.device)
    rows = []
    for attention in config.attentions:
        model = _model(config, attention)
        for position in config.positions:
            gen = torch.Generator().manual_seed(config.seed + position)
            prompt = torch.randint(0, config.vocab_size, (1, position), generator=gen).to(device)

            def prefill(model=model, prompt=prompt):
                caches = model.new_caches()
                logits, _ = model(prompt, caches=caches)
                return caches, logits[:, -1:].argmax(-1)

            def step(state, model=model):
                caches, token = state
                logits, _ = model(token, caches=caches)
                return caches, logits[:, -1:].argmax(-1)

            ms, runs = time_decode(prefill, step, tokens=config.tokens, warmup=config.warmup,
                                   repeats=config.repeats, device=device)  # fmt: skip
            rows.append({"attention": attention, "position": position, "ms_per_token": ms,
                         "runs_ms": runs})  # fmt: skip
            if progress is not None:
                progress(rows[-1])
    base = {r["position"]: r["ms_per_token"] for r in rows if r["attention"] == "softmax"}
    for r in rows:
        r["x_softmax"] = base[r["position"]] / r["ms_per_token"] if r["position"] in base else None
    return rows


def format_decode_report(rows: list[dict], title: str = "decode ms/token") -> str:
    """A text table: one line per attention, ms/token and × softmax at each position."""
    positions = sorted({r["position"] for r in rows})
    head = f"{'attention':<14}" + "".join(f"{'P=' + str(p):>22}" for p in positions)
    lines = [title, head]
    for attention in dict.fromkeys(r["attention"] for r in rows):
        cells = []
        for p in positions:
            r = next((r for r in rows if r["attention"] == attention and r["position"] == p), None)
            if r is None:
                cells.append(f"{'-':>22}")
                continue
            ratio = "" if r["x_softmax"] is None else f" ({r['x_softmax']:.2f}x sm)"
            cells.append(f"{r['ms_per_token']:>10.2f} ms{ratio:>10}")
        lines.append(f"{attention:<14}" + "".join(cells))
    lines.append("(x sm: softmax's ms/token / this one's, measured in the same run; > 1 = faster)")
    return "\n".join(lines)


def write_decode_csv(rows: list[dict], path) -> object:
    """Write the rows (``DECODE_FIELDS``) to ``path`` atomically; returns the path."""
    from .._files import atomic_write

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=DECODE_FIELDS)
    writer.writeheader()
    for r in rows:
        cells = dict(r, runs_ms=" ".join(f"{x:.4g}" for x in r["runs_ms"]))
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in cells.items()})
    return atomic_write(path, buf.getvalue().encode())
