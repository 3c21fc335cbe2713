"""``polysketch bench --decode``: greedy decoding time per token vs position, whole models.

For each attention and each prompt length P, a ``TransformerLM`` (default 4 layers × 256,
4 heads of 64, the sizes of the decoding table in ``docs/results/``) is prefilled with P random
tokens into its caches; then ``tokens`` greedy steps (one token in, argmax out, the caches updated
in place) are timed after ``warmup`` untimed steps, ``repeats`` times from a fresh prefill,
the attentions taking turns within each round (so a machine whose load drifts slows them
alike); the median ms/token is reported, with its ratio to softmax (KV cache) at the same P. Softmax
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
from dataclasses import dataclass, replace

import torch

from ..._checks import check_int, check_positive_int
from ...nn.resolve import config_options

__all__ = ["DECODE_ATTENTIONS", "DECODE_FIELDS", "DecodeBenchConfig", "time_decode", "rows_of",
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
    chunk_size: int | None = None  # None: what TransformerLM runs (a preset's own, else 64)
    vocab_size: int = 256
    tokens: int = 32
    warmup: int = 4
    repeats: int = 3
    device: str = "cpu"
    seed: int = 0

    def validate(self) -> DecodeBenchConfig:
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "tokens", "repeats"):
            check_positive_int(getattr(self, name), name)
        if self.chunk_size is not None:
            check_positive_int(self.chunk_size, "chunk_size")
        check_int(self.warmup, "warmup", minimum=0)
        for p in self.positions:
            check_positive_int(p, "positions")
        return self

    def check_attentions(self) -> DecodeBenchConfig:
        """``validate``, then build every attention's model once on the CPU, so that a bad
        option (a map keyword of the wrong type) raises its ValueError/TypeError, naming the
        attention, before anything is timed."""
        self.validate()
        for attention in self.attentions:
            try:
                _model(replace(self, device="cpu"), attention)
            except (ValueError, TypeError) as err:
                raise type(err)(f"attentions {attention!r}: {err}") from err
        return self


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode(
    cases: dict[str, tuple[Callable[[], object], Callable[[object], object]]],
    *,
    tokens: int,
    warmup: int,
    repeats: int,
    device: torch.device | str = "cpu",
) -> dict[str, list[float]]:
    """ms/token of each case's decoding: {name: ``repeats`` values}.

    ``cases``: name -> (``prefill()`` returning a decoding state (caches and the next token),
    ``step(state)`` consuming one token and returning the next state). In each of ``repeats``
    rounds every case in turn prefills afresh, runs ``warmup`` steps, then times ``tokens``.
    """
    device = torch.device(device)
    runs: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, (prefill, step) in cases.items():
                state = prefill()
                for _ in range(warmup):
                    state = step(state)
                _sync(device)
                start = time.perf_counter()
                for _ in range(tokens):
                    state = step(state)
                _sync(device)
                runs[name].append((time.perf_counter() - start) / tokens * 1e3)
    return runs


def rows_of(runs_by_position: dict[int, dict[str, list[float]]]) -> list[dict]:
    """Report rows (``DECODE_FIELDS``) from {position: {attention: ms/token runs}}."""
    rows = []
    for position, runs in runs_by_position.items():
        base = statistics.median(runs["softmax"]) if "softmax" in runs else None
        for attention, values in runs.items():
            ms = statistics.median(values)
            rows.append({"attention": attention, "position": position, "ms_per_token": ms,
                         "x_softmax": None if base is None else base / ms,
                         "runs_ms": values})  # fmt: skip
    rows.sort(key=lambda r: (list(runs_by_position[r["position"]]).index(r["attention"]),
                             r["position"]))  # fmt: skip
    return rows


def _model(config: DecodeBenchConfig, attention: str):
    from ...nn import TransformerConfig, TransformerLM

    cfg = TransformerConfig(vocab_size=config.vocab_size, n_layer=config.n_layer,
                            n_head=config.n_head, n_embd=config.n_embd, seed=config.seed,
                            block_size=max(config.positions),
                            **config_options(attention, chunk_size=config.chunk_size))  # fmt: skip
    return TransformerLM(cfg).to(config.device).eval()


def run_decode_benchmark(config: DecodeBenchConfig, progress=None) -> list[dict]:
    """One row per (attention, position): ``DECODE_FIELDS`` (module docstring)."""
    config.validate()
    device = torch.device(config.device)
    models = {attention: _model(config, attention) for attention in config.attentions}

    def step(state, model):
        caches, token = state
        logits, _ = model(token, caches=caches)
        return caches, logits[:, -1:].argmax(-1)

    measured = {}
    for position in config.positions:
        gen = torch.Generator().manual_seed(config.seed + position)
        prompt = torch.randint(0, config.vocab_size, (1, position), generator=gen).to(device)

        def prefill(model, prompt=prompt):
            caches = model.new_caches()
            logits, _ = model(prompt, caches=caches)
            return caches, logits[:, -1:].argmax(-1)

        cases = {name: (lambda m=m: prefill(m), lambda s, m=m: step(s, m))
                 for name, m in models.items()}  # fmt: skip
        measured[position] = time_decode(cases, tokens=config.tokens, warmup=config.warmup,
                                         repeats=config.repeats, device=device)  # fmt: skip
        if progress is not None:
            progress(position, measured[position])
    return rows_of(measured)


def format_decode_report(rows: list[dict], title: str = "decode ms/token") -> str:
    """A text table: one line per attention, ms/token and × softmax at each position."""
    positions = sorted({r["position"] for r in rows})
    width = max([14, *(len(str(r["attention"])) + 1 for r in rows)])
    head = f"{'attention':<{width}}" + "".join(f"{'P=' + str(p):>22}" for p in positions)
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
        lines.append(f"{attention:<{width}}" + "".join(cells))
    lines.append("(x sm: softmax's ms/token / this one's, measured in the same run; > 1 = faster)")
    return "\n".join(lines)


def write_decode_csv(rows: list[dict], path) -> object:
    """Write the rows (``DECODE_FIELDS``) to ``path`` atomically; returns the path."""
    from ..._files import atomic_write

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=DECODE_FIELDS)
    writer.writeheader()
    for r in rows:
        cells = dict(r, runs_ms=" ".join(f"{x:.4g}" for x in r["runs_ms"]))
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in cells.items()})
    return atomic_write(path, buf.getvalue().encode())
