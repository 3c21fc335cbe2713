"""``polysketch bench --model``: TransformerLM training throughput, softmax vs linear attention.

One training step = forward, cross-entropy on next-token targets, backward, AdamW step, for a
batch of B = 1 sequences of length T (random byte tokens: the speed does not depend on them).
Reported per (attention, T): the median step time after one warm-up step (with ``compile``,
the warm-up step includes compilation, reported separately as ``first_step_s``), training
tokens/s = B·T / step time, the ratio to softmax at the same T, and the peak memory of a step
on CUDA. Models: the paper's 12 layers × 768 (12 heads, D = 64) on CUDA, a small 4 × 256
(4 heads, D = 64) on CPU; ``softmax`` runs torch SDPA (FlashAttention on CUDA under bf16).

**Interleaved rounds** (``rounds = R > 1``): on a machine whose speed drifts (other jobs on a
shared CPU, a GPU's clocks), attentions timed one after the other see different machines, and
their ratio carries the drift. With R rounds every attention's model of one length is built
first (all held at once: the memory is their sum) and then timed in turn, R times over, each
time for ``min_time / R`` seconds: the attentions of one round run within seconds of each
other. Reported: the median over rounds of each round's step time (``step_ms``), every round's
time (``round_ms``, ";"-separated, so any ratio can be formed round by round), and ``x_softmax``
as the median over rounds of the per-round ratio.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..._checks import check_choice, check_positive_int
from ..._files import write_csv
from ..._malloc import holds_freed_memory
from ...nn import TransformerConfig, TransformerLM
from ...nn.resolve import config_options, parse_attention, preset_chunk_size
from ...nn.spec import DEFAULT_CHUNK_SIZE
from ..plots import log_axes, save_png, subplots
from .attention import parse_lengths
from .report import _fmt
from .timing import peak_memory, time_call

__all__ = [
    "ModelBenchConfig",
    "run_model_benchmark",
    "check_model_attentions",
    "format_model_report",
    "write_model_outputs",
    "MODEL_FIELDS",
]

MODEL_FIELDS = (
    "attention", "T", "status", "step_ms", "tokens_per_s", "x_softmax", "mem_mib",
    "first_step_s", "repeats", "chunk_size", "round_ms",
)  # fmt: skip

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""``torch.compile``'s modes (``ModelBenchConfig.compile_mode``)."""


CPU_CONTEXTS = (1024, 2048, 4096, 8192)
CUDA_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class ModelBenchConfig:
    """What to measure (see the module docstring); ``None`` sizes take the device default."""

    attentions: Sequence[str] = ("softmax", "psf_random", "psf_mixed")  # attention specs
    contexts: Sequence[int] | None = None
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    chunk_size: int | None = None  # None: what TransformerLM runs (``chunk_for``)
    batch: int = 1
    amp: str | None = None  # "bf16": autocast (the default on CUDA)
    compile: str | None = None  # a torch.compile backend
    compile_mode: str | None = None  # torch.compile's mode ("reduce-overhead": CUDA graphs)
    device: str = "cpu"
    threads: int | None = None
    min_time: float = 2.0
    min_repeats: int = 2
    rounds: int = 1  # > 1: interleaved rounds (module docstring)
    seed: int = 0
    progress: bool = True

    def resolved(self) -> ModelBenchConfig:
        """A copy with the device defaults filled in and every field checked."""
        cuda = torch.device(self.device).type == "cuda"
        big = (
            dict(n_layer=12, n_head=12, n_embd=768)
            if cuda
            else dict(n_layer=4, n_head=4, n_embd=256)
        )
        out = ModelBenchConfig(**{**self.__dict__})
        for key, value in big.items():
            if getattr(out, key) is None:
                setattr(out, key, value)
            check_positive_int(getattr(out, key), key)
        out.contexts = parse_lengths(out.contexts or (CUDA_CONTEXTS if cuda else CPU_CONTEXTS))
        if out.amp is None and cuda:
            out.amp = "bf16"
        if out.amp is not None:
            check_choice(out.amp, "amp", ["bf16"])
        if out.compile is not None:
            check_choice(out.compile, "compile", torch._dynamo.list_backends(exclude_tags=()))
        if out.compile_mode is not None:
            if out.compile is None:
                raise ValueError("compile_mode needs compile (a torch.compile backend)")
            check_choice(out.compile_mode, "compile_mode", COMPILE_MODES)
        check_positive_int(out.batch, "batch")
        check_positive_int(out.rounds, "rounds")
        if out.chunk_size is not None:
            check_positive_int(out.chunk_size, "chunk_size")
        return out

    def chunk_for(self, attention: str) -> int:
        """The block length ``attention`` runs with: the spec's ``chunk_size=``, else
        ``chunk_size`` when given, else what a ``TransformerLM`` of it runs (a model preset's
        own block, ``preset_chunk_size``, else ``polysketch.nn.DEFAULT_CHUNK_SIZE``)."""
        name, model_opts, _ = parse_attention(attention)
        if "chunk_size" in model_opts:
            return model_opts["chunk_size"]
        if self.chunk_size is not None:
            return self.chunk_size
        return preset_chunk_size(attention) or DEFAULT_CHUNK_SIZE


def _model_config(cfg: ModelBenchConfig, attention: str, t: int) -> TransformerConfig:
    """The TransformerConfig that ``attention`` is timed with at length ``t``."""
    return TransformerConfig(
        vocab_size=256, block_size=t, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
        seed=cfg.seed, **config_options(attention, chunk_size=cfg.chunk_for(attention)),
    ).validate()  # fmt: skip


def check_model_attentions(config: ModelBenchConfig) -> None:
    """Build every attention's model once on the CPU (no step runs), so that a bad option,
    such as a map keyword of the wrong type, raises its ValueError/TypeError before anything
    is timed or written."""
    cfg = config.resolved()
    for attention in cfg.attentions:
        try:
            TransformerLM(_model_config(cfg, attention, min(cfg.contexts)))
        except (ValueError, TypeError) as err:
            raise type(err)(f"attentions {attention!r}: {err}") from err


def _step(model, optimizer, idx, amp: str | None) -> None:
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
        _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _Timed:
    """One (attention, T) of the benchmark: its model, optimizer and step, and its row."""

    def __init__(self, cfg: ModelBenchConfig, attention: str, t: int, device: torch.device):
        self.row = dict.fromkeys(MODEL_FIELDS, "")
        self.row.update(attention=attention, T=t, chunk_size=cfg.chunk_for(attention))
        self.seconds: list[float] = []  # one step time per round
        self.calls = 0
        self.device = device
        model = TransformerLM(_model_config(cfg, attention, t)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runner = model
        if cfg.compile is not None:
            runner = torch.compile(model, backend=cfg.compile, mode=cfg.compile_mode)
        gen = torch.Generator().manual_seed(cfg.seed)
        idx = torch.randint(0, 256, (cfg.batch, t + 1), generator=gen).to(device)
        self.step = partial(_step, runner, optimizer, idx, cfg.amp)
        try:
            t0 = time.perf_counter()
            self.step()  # warm-up (and compilation)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.row["first_step_s"] = time.perf_counter() - t0
            mem = peak_memory(self.step, device)
        except torch.OutOfMemoryError:
            self.fail()
        else:
            self.row["mem_mib"] = "" if mem is None else mem / 2**20

    def fail(self) -> None:
        """Out of memory: the row says so, and the model is freed."""
        self.row["status"] = "out of memory"
        self.step = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def time_round(self, min_time: float, min_repeats: int) -> None:
        if self.step is None:
            return
        try:
            sec, reps, _ = time_call(self.step, min_time=min_time, min_repeats=min_repeats)
        except torch.OutOfMemoryError:
            self.fail()
        else:
            self.seconds.append(sec)
            self.calls += reps

    def finish(self, batch: int) -> dict:
        """The row, the model freed."""
        if self.step is not None:
            sec = statistics.median(self.seconds)
            self.row.update(
                status="ok", step_ms=sec * 1e3, tokens_per_s=batch * self.row["T"] / sec,
                repeats=self.calls, round_ms=";".join(f"{s * 1e3:.6g}" for s in self.seconds),
            )  # fmt: skip
        self.step = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.row


def run_model_benchmark(config: ModelBenchConfig) -> dict:
    """Measure every (attention, T) of ``config``; returns ``{"rows", "config"}``.

    One round: each attention's model is built, timed and freed in turn. R > 1 rounds: the
    models of one length are built first and timed in turn R times (module docstring)."""
    from tqdm.auto import tqdm

    cfg = config.resolved()
    device = torch.device(cfg.device)
    previous = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    threads = torch.get_num_threads()  # what the rows were measured with (restored after)
    rows: list[dict] = []
    ratios: dict[tuple[str, int], list[float]] = {}  # per-round x softmax (rounds > 1)
    bar = tqdm(
        total=len(cfg.attentions) * len(cfg.contexts) * cfg.rounds, desc="bench --model",
        disable=not cfg.progress, file=sys.stderr,
    )  # fmt: skip
    min_time = cfg.min_time / cfg.rounds
    try:
        for attention in cfg.attentions if cfg.rounds == 1 else ():
            for t in cfg.contexts:
                bar.set_postfix_str(f"{attention} T={t}")
                timed = _Timed(cfg, attention, t, device)
                timed.time_round(min_time, cfg.min_repeats)
                rows.append(timed.finish(cfg.batch))
                bar.update()
        for t in cfg.contexts if cfg.rounds > 1 else ():
            group = []
            for attention in cfg.attentions:
                bar.set_postfix_str(f"build {attention} T={t}")
                group.append(_Timed(cfg, attention, t, device))
            for r in range(cfg.rounds):
                for timed in group:
                    bar.set_postfix_str(f"round {r + 1} {timed.row['attention']} T={t}")
                    timed.time_round(min_time, cfg.min_repeats)
                    bar.update()
                soft = [x for x in group if x.row["attention"] == "softmax" and x.step]
                for timed in group:
                    if soft and timed.step is not None:
                        key = (timed.row["attention"], t)
                        ratios.setdefault(key, []).append(soft[0].seconds[-1] / timed.seconds[-1])
            rows.extend(timed.finish(cfg.batch) for timed in group)
            del group
    finally:
        bar.close()
        torch.set_num_threads(previous)
    soft = {
        r["T"]: r["tokens_per_s"]
        for r in rows
        if r["attention"] == "softmax" and r["status"] == "ok"
    }
    for r in rows:
        if r["status"] == "ok" and r["T"] in soft:
            per_round = ratios.get((r["attention"], r["T"]))
            if per_round and len(per_round) == cfg.rounds:
                r["x_softmax"] = statistics.median(per_round)
            else:
                r["x_softmax"] = r["tokens_per_s"] / soft[r["T"]]
    return {"rows": rows, "config": cfg, "threads": threads}


_COLUMNS = {
    "step_ms": "10.1f",
    "tokens_per_s": "10.0f",
    "x_softmax": "9.2f",
    "mem_mib": "8.0f",
    "first_step_s": "10.1f",
}


def _chunks(cfg: ModelBenchConfig) -> str:
    """The block length(s) of the timed attentions: one number, or each where they differ."""
    chunks = {a: cfg.chunk_for(a) for a in cfg.attentions}
    if len(set(chunks.values())) == 1:
        return str(next(iter(chunks.values())))
    return "(" + ", ".join(f"{a} {c}" for a, c in chunks.items()) + ")"


def format_model_report(result: dict) -> str:
    """The table of ``run_model_benchmark``'s rows with the model and settings."""
    cfg = result["config"]
    width = max([11, *(len(str(r["attention"])) for r in result["rows"])])
    lines = [
        f"TransformerLM training steps on {cfg.device} "
        f"({result.get('threads', torch.get_num_threads())} threads): "
        f"{cfg.n_layer} layers x {cfg.n_embd}, {cfg.n_head} heads, chunk {_chunks(cfg)}, "
        f"B={cfg.batch}, amp={cfg.amp or 'off (fp32)'}, compile={cfg.compile or 'off'}, "
        f"malloc {'holding freed memory' if holds_freed_memory() else 'as the system sets it'}"
        + (
            f", {cfg.rounds} interleaved rounds (x softmax: median of per-round ratios)"
            if cfg.rounds > 1
            else ""
        ),
        "",
        f"{'attention':<{width}} {'T':>6} {'step ms':>10} {'tokens/s':>10} {'x softmax':>9} "
        f"{'MiB':>8} {'1st step s':>10} status",
    ]
    for r in result["rows"]:
        c = {k: _fmt(r[k], spec) for k, spec in _COLUMNS.items()}
        lines.append(
            f"{r['attention']:<{width}} {r['T']:>6} {c['step_ms']:>10} {c['tokens_per_s']:>10} "
            f"{c['x_softmax']:>9} {c['mem_mib']:>8} {c['first_step_s']:>10} {r['status']}"
        )
    return "\n".join(lines)


def write_model_outputs(result: dict, out: Path) -> tuple[Path, Path]:
    """``model_results.csv`` and ``model_bench.png`` (tokens/s vs T per attention) in ``out``."""
    csv_path = write_csv(result["rows"], out / "model_results.csv", columns=MODEL_FIELDS,
                         float_format=".6g")  # fmt: skip
    fig, (ax,) = subplots(1)
    for attention in dict.fromkeys(r["attention"] for r in result["rows"]):
        pts = [(r["T"], r["tokens_per_s"]) for r in result["rows"]
               if r["attention"] == attention and r["status"] == "ok"]  # fmt: skip
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", ms=4, label=attention)
    log_axes(ax)
    ax.set_xlabel("context T")
    ax.set_ylabel("training tokens / s")
    ax.set_title(f"TransformerLM training ({result['config'].device})")
    ax.legend(fontsize=8)
    return csv_path, save_png(fig, out / "model_bench.png")
