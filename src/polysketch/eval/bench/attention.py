"""Speed of causal kernelized attention vs ``torch.nn.functional.scaled_dot_product_attention``.

One run measures, on one device and with a fixed thread count, for sequence lengths T:

* **forward** (causal, B=1, H=4, D=E=64, fp32, inference mode) of
  - ``sdpa``: ``scaled_dot_product_attention(q, k, v, is_causal=True)``;
  - ``polysketch``: PolySketchFormer's attention, a degree-2 Gaussian sketch with r = 32 made
    non-negative by self-tensoring (``square=True``, degree 4 effective, §2.1 and §4), run by
    the chunked block algorithm (Theorem 3.1, b = 256), feature-map time INCLUDED;
  - ``positive``: a plain (non-squared) map with F = 256, FAVOR+ positive random features with
    m = 128 antithetic pairs (``features.create("positive", D, num_features=128)``), same op;
* ``algorithms``: the backends ``polysketch`` and ``positive`` run with, side by side
  (``linear_attention(..., algorithm=)``): ``"chunked"`` is the default dispatch (row
  ``polysketch``), any other name adds rows ``polysketch[NAME]`` (e.g. ``chunked_blocks``,
  ``triton``); a backend that cannot run a call is reported ``skipped`` with the dispatcher's
  reason;
* **decode**: time of one new token at position P, for ``polysketch`` the features of the new
  token plus ``linear_attention_step`` on the state of a real prefill of P tokens (constant
  size), for ``sdpa`` one query attending a KV cache of P keys (no cache append).

On CUDA each call runs once untimed first (kernel compilation and Triton's autotuning, whose
timing buffers would count in the peak), then once for the peak memory (``timing.peak_memory``).
Timing: ``timing.time_call``: ``torch.utils.benchmark.Timer.blocked_autorange`` for
``min_time`` seconds after its warm-up (the device synchronised), at least ``min_repeats``
timed calls; the median time per call is reported. Matmul peak: the median GFLOP/s of an n×n
fp32 matmul, n = 4096 (2048 with ``quick``), timed in the same run.

FLOPs and memory: the analytic cost model of ``polysketch.eval.bench.costs``.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as nnf

from ..._checks import check_choice, check_float, check_positive_int
from ...features import create
from ...ops import linear_attention, linear_attention_step, mixed_attention
from ...ops.dispatch import ALGORITHMS, resolve_algorithm
from .costs import chunked_flops, chunked_memory, sdpa_flops, sdpa_memory
from .report import CSV_FIELDS, times_of
from .timing import MALLOC_TOP_PAD, peak_memory, set_malloc_top_pad, time_call

__all__ = [
    "BenchConfig",
    "ALGORITHM_METHODS",
    "DEFAULT_LENGTHS",
    "QUICK_LENGTHS",
    "METHODS",
    "MODES",
    "DTYPES",
    "bench_maps",
    "method_label",
    "parse_lengths",
    "run_benchmark",
]

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
METHODS = ("sdpa", "polysketch", "positive", "psf_mixed")
"""``sdpa`` (FlashAttention on CUDA for half inputs), ``polysketch`` (psf_random's attention),
``positive`` (FAVOR+, F = 256), ``psf_mixed`` (exact (q·k)^4 inside blocks, the sketch before)."""
ALGORITHM_METHODS = ("polysketch", "positive")
"""Methods run by ``linear_attention``, so timed once per entry of ``BenchConfig.algorithms``."""
MODES = ("fwd", "train")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUICK_LENGTHS = (128, 256, 512)


@dataclass
class BenchConfig:
    """What to measure; see the module docstring. ``quick`` = a small, fast version."""

    lengths: Sequence[int] = DEFAULT_LENGTHS
    decode_positions: Sequence[int] | None = None  # default: the lengths
    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    chunk_size: int = 256
    sketch_dim: int = 32
    plain_pairs: int = 128
    max_memory_gb: float = 8.0
    min_time: float = 0.5
    min_repeats: int = 3
    matmul_n: int = 4096
    threads: int | None = None  # default: os.cpu_count()
    # glibc M_TOP_PAD set for the whole process (not restored); None: leave malloc as it is
    malloc_top_pad: int | None = MALLOC_TOP_PAD
    device: str = "cpu"
    seed: int = 0
    progress: bool = True
    mode: str = "fwd"  # "fwd": forward (inference mode) + decode; "train": forward + backward
    dtype: str = "fp32"  # "fp32" | "bf16" | "fp16" inputs (the ops' precision policy applies)
    methods: Sequence[str] = METHODS
    algorithms: Sequence[str] = ("chunked",)  # backends of ALGORITHM_METHODS, side by side

    @classmethod
    def quick(cls, **overrides) -> BenchConfig:
        base = dict(lengths=QUICK_LENGTHS, min_time=0.0, min_repeats=1, matmul_n=1024)
        base.update(overrides)
        return cls(**base)


def method_label(method: str, algorithm: str) -> str:
    """The row name of ``method`` run with ``algorithm``: the method for the default dispatch
    (``"chunked"``), else ``method[algorithm]``."""
    return method if algorithm == "chunked" else f"{method}[{algorithm}]"


def _timed(config: BenchConfig) -> list[tuple[str, str, str]]:
    """(row label, method, algorithm) of every timed method, in the configured order."""
    out = []
    for method in config.methods:
        algorithms = config.algorithms if method in ALGORITHM_METHODS else ("chunked",)
        out += [(method_label(method, a), method, a) for a in algorithms]
    return out


def parse_lengths(text: str | Sequence) -> tuple[int, ...]:
    """ "1k,2k,4096" or ["1k", "2048"] -> (1024, 2048, 4096); k = 1024."""
    items = text.replace(",", " ").split() if isinstance(text, str) else list(text)
    out = []
    for item in items:
        s = str(item).strip().lower()
        mult = 1024 if s.endswith("k") else 1
        try:
            value = int(float(s[:-1] if mult > 1 else s) * mult)
        except ValueError as err:
            raise ValueError(f"lengths must be integers like 1024 or 1k, got {item!r}") from err
        out.append(check_positive_int(value, "lengths"))
    if not out:
        raise ValueError("lengths must name at least one length")
    return tuple(sorted(set(out)))


def _sdpa_uses_math(q: torch.Tensor) -> bool:
    """True when SDPA would pick its math backend (materialising T×T) for these inputs."""
    choice = getattr(torch, "_fused_sdp_choice", None)
    if choice is None:
        return True
    try:
        return int(choice(q, q, q, is_causal=True)) == 0
    except (RuntimeError, TypeError):
        return True


def _sdpa_forward(q, k, v):
    return nnf.scaled_dot_product_attention(q, k, v, is_causal=True)


def _ours_forward(fmap, q, k, v, chunk_size, algorithm="chunked"):
    return linear_attention(
        fmap.query(q), fmap.key(k), v, causal=True, square=fmap.square, chunk_size=chunk_size,
        algorithm=algorithm,
    )  # fmt: skip


def _mixed_forward(fmap, q, k, v, chunk_size):
    return mixed_attention(
        q, k, v, fmap.query(q), fmap.key(k), chunk_size=chunk_size, local="polynomial",
        degree=4, square=fmap.square, denominator_offset=1.0,
    )  # fmt: skip


def _train_step(forward, q, k, v, grad):
    """One forward + backward of ``forward(q, k, v)`` (leaf inputs; their grads dropped)."""
    forward(q, k, v).backward(grad)
    q.grad = k.grad = v.grad = None


def _sdpa_decode(q1, k_cache, v_cache):
    return nnf.scaled_dot_product_attention(q1, k_cache, v_cache)


def _ours_decode(fmap, q1, k1, v1, state):
    return linear_attention_step(fmap.query(q1), fmap.key(k1), v1, state, square=fmap.square)


def _matmul(x):
    return x @ x


class _Rows(list):
    """Result rows (dicts with the ``CSV_FIELDS`` keys) given the measured matmul peak."""

    def __init__(self, peak: float):
        super().__init__()
        self.peak = peak

    def add(self, section, method, t, status, timing=None, flop=None, mem=None, fmap=None):
        r = dict.fromkeys(CSV_FIELDS, "")
        r.update(section=section, method=method, T=t, status=status, repeats=0)
        sec = None
        if timing is not None:
            sec, r["repeats"], fastest = timing
            r["median_ms"], r["min_ms"] = sec * 1e3, fastest * 1e3
        if flop is not None and sec is not None:
            r["gflop"] = flop / 1e9
            r["gflops_per_s"] = flop / sec / 1e9
            r["pct_of_peak"] = 100 * flop / sec / 1e9 / self.peak
        if mem is not None:
            r["mem_mib"], r["mem_kind"] = mem[0] / 2**20, mem[1]
        if fmap is not None:
            r["feature_dim"], r["state_dim"] = fmap.feature_dim, fmap.state_dim
        self.append(r)


def bench_maps(config: BenchConfig, device) -> dict:
    """The feature maps the bench times, drawn from ``config`` (``polysketch``: psf_random's
    sketch; ``positive``: FAVOR+), on ``device``."""
    d = config.head_dim
    maps = {
        "polysketch": create(
            "polysketch", d, degree=2, num_features=config.sketch_dim, nonnegative=True,
            seed=config.seed,
        ),
        "positive": create(
            "positive", d, num_features=config.plain_pairs, scale=1 / math.sqrt(d),
            seed=config.seed,
        ),
    }  # fmt: skip
    return {k: m.to(device) for k, m in maps.items()}


def run_benchmark(config: BenchConfig) -> dict:
    """Run every measurement of ``config``; returns rows, peak and summary (for CSV/plots).

    Sets ``torch.set_num_threads(config.threads or os.cpu_count())`` for the run and restores
    the previous thread count afterwards. ``mode="fwd"`` runs under ``torch.inference_mode``;
    ``mode="train"`` times forward + backward (gradients of q, k, v and the maps' inputs).
    """
    check_choice(config.mode, "mode", MODES)
    check_choice(config.dtype, "dtype", list(DTYPES))
    for name in config.methods:
        check_choice(name, "methods", METHODS)
    if not config.algorithms:
        raise ValueError("algorithms must name at least one backend, e.g. chunked")
    for name in config.algorithms:
        check_choice(name, "algorithms", ALGORITHMS)
    previous_threads = torch.get_num_threads()
    try:
        if config.mode == "train":
            return _run(config)
        with torch.inference_mode():
            return _run(config)
    finally:
        torch.set_num_threads(previous_threads)


@dataclass
class _Setup:
    """What every measurement of one run shares (built by ``_setup``)."""

    config: BenchConfig
    lengths: tuple[int, ...]
    positions: tuple[int, ...]
    budget: float  # bytes
    chunk: int
    device: torch.device
    threads: int
    top_pad: int | None
    generator: torch.Generator
    maps: dict
    timer: dict  # time_call's keywords

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(self.device)

    def time(self, fn):
        return time_call(fn, **self.timer)


def _setup(config: BenchConfig) -> _Setup:
    """Check ``config``, set the thread count (and malloc's top pad), draw the maps."""
    lengths = parse_lengths(config.lengths)
    positions = parse_lengths(config.decode_positions or lengths)
    budget = check_float(config.max_memory_gb, "max_memory_gb", minimum=0.0) * 2**30
    chunk = check_positive_int(config.chunk_size, "chunk_size")
    device = torch.device(config.device)
    threads = config.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    top_pad = None
    if config.malloc_top_pad is not None and set_malloc_top_pad(config.malloc_top_pad):
        top_pad = config.malloc_top_pad
    timer = dict(min_time=config.min_time, min_repeats=config.min_repeats)
    if config.mode == "train":
        positions = ()  # decoding is inference: measured in mode "fwd"
    return _Setup(
        config, lengths, positions, budget, chunk, device, threads, top_pad,
        torch.Generator().manual_seed(config.seed), bench_maps(config, device), timer,
    )  # fmt: skip


def _run(config: BenchConfig) -> dict:
    from tqdm.auto import tqdm

    run = _setup(config)
    section = "train" if config.mode == "train" else "forward"
    timed = _timed(config)
    ours = [label for label, method, _ in timed if method != "sdpa"]
    decoded = {k: m for k, m in run.maps.items() if k in config.methods}  # with a decode state
    steps = 1 + len(run.lengths) * len(timed) + len(run.positions) * (1 + len(decoded))
    bar = tqdm(total=steps, desc="bench", disable=not config.progress, file=sys.stderr)

    n = config.matmul_n
    t_mm = run.time(partial(_matmul, run.randn(n, n))).median
    rows = _Rows(peak=2 * n**3 / t_mm / 1e9)
    bar.update()
    for t in run.lengths:
        bar.set_postfix_str(f"{section} T={t}")
        _measure_length(run, t, section, rows, bar)
    for p in run.positions:
        bar.set_postfix_str(f"decode P={p}")
        _measure_decode(run, p, decoded, rows, bar)
    bar.close()
    return {
        "rows": list(rows),
        "peak_gflops": rows.peak,
        "threads": run.threads,
        "malloc_top_pad": run.top_pad,
        "device": str(run.device),
        "summary": _summarize(rows, run.lengths, ours, section),
        "config": config,
    }


def _measure_length(run: _Setup, t: int, section: str, rows: _Rows, bar) -> None:
    """One row per method at length ``t``: forward (or forward + backward) time, FLOPs and
    memory (measured on CUDA, else the analytic model)."""
    config, maps, chunk = run.config, run.maps, run.chunk
    bsz, h, d, e = config.batch, config.heads, config.head_dim, config.head_dim
    train = section == "train"
    dtype = DTYPES[config.dtype]
    forwards = {
        "sdpa": _sdpa_forward,
        "polysketch": partial(_ours_forward, maps["polysketch"], chunk_size=chunk),
        "positive": partial(_ours_forward, maps["positive"], chunk_size=chunk),
        "psf_mixed": partial(_mixed_forward, maps["polysketch"], chunk_size=chunk),
    }  # ALGORITHM_METHODS take algorithm= as well
    # LayerNorm'd q, k (as the models feed them), in the benchmarked dtype
    q, k = (nnf.layer_norm(run.randn(bsz, h, t, d), (d,)).to(dtype) for _ in range(2))
    v = run.randn(bsz, h, t, e).to(dtype)
    grad = run.randn(bsz, h, t, e).to(dtype) if train else None
    if train:
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    for label, method, algorithm in _timed(config):
        forward = forwards[method]
        if method in ALGORITHM_METHODS:
            forward = partial(forward, algorithm=algorithm)
        fn = partial(_train_step, forward, q, k, v, grad) if train else partial(forward, q, k, v)
        fmap = None if method == "sdpa" else maps["polysketch" if method == "psf_mixed" else method]
        if method == "sdpa" and bsz * h * t * t * 4 > run.budget and _sdpa_uses_math(q):
            rows.add(section, label, t, "skipped (memory)")
            bar.update()
            continue
        refusal = _refusal(fmap, q, k, v, algorithm) if method in ALGORITHM_METHODS else None
        if refusal is not None:
            rows.add(section, label, t, f"skipped ({refusal})", fmap=fmap)
            bar.update()
            continue
        if run.device.type == "cuda":  # compiling and autotuning stay out of the peak memory
            fn()
        measured = peak_memory(fn, run.device)
        mem, flop = None, None
        if measured is not None:
            mem = (measured, "cuda")
        if not train and method == "sdpa":
            est = bsz * h * sdpa_memory(t, d=d, math_backend=_sdpa_uses_math(q))
            mem = mem or (est, "analytic")
            flop = bsz * h * sdpa_flops(t, head_dim=d, value_dim=e)
        elif not train and method in ("polysketch", "positive"):
            f, sq = fmap.feature_dim, fmap.square
            est = chunked_memory(t, d=d, f=f, e=e, chunk=chunk, square=sq, slices=bsz * h)
            mem = mem or (est, "analytic")
            flop = (
                bsz * h * chunked_flops(t, feature_dim=f, value_dim=e, chunk_size=chunk, square=sq)
            )
        rows.add(section, label, t, "ok", run.time(fn), flop, mem, fmap)
        bar.update()


def _refusal(fmap, q, k, v, algorithm: str) -> str | None:
    """Why the dispatcher would refuse ``algorithm`` on this call (None: it runs)."""
    if algorithm == "chunked":
        return None
    with torch.no_grad():
        phi_q, phi_k = fmap.query(q[..., :1, :]), fmap.key(k[..., :1, :])
    lead, t = q.shape[:-2], q.shape[-2]
    a = phi_q.expand(*lead, t, phi_q.shape[-1])  # the call's shape, no T-sized memory
    try:
        resolve_algorithm(algorithm, a, phi_k.expand_as(a), v, square=fmap.square,
                          with_state=False)  # fmt: skip
    except ValueError as err:
        return str(err)
    return None


def _measure_decode(run: _Setup, p: int, decoded: dict, rows: _Rows, bar) -> None:
    """Decode rows at position ``p``: SDPA over a KV cache of ``p`` keys, and each map's
    recurrent step on the state of a real prefill of ``p`` tokens."""
    config = run.config
    bsz, h, d, e = config.batch, config.heads, config.head_dim, config.head_dim
    q1, k1, v1 = run.randn(bsz, h, 1, d), run.randn(bsz, h, 1, d), run.randn(bsz, h, 1, e)
    cache_bytes = bsz * h * p * (d + e) * 4
    if cache_bytes > run.budget:
        rows.add("decode", "sdpa", p, "skipped (memory)")
    else:
        fn = partial(_sdpa_decode, q1, run.randn(bsz, h, p, d), run.randn(bsz, h, p, e))
        rows.add("decode", "sdpa", p, "ok", run.time(fn), mem=(cache_bytes, "kv-cache"))
    bar.update()
    for name, fmap in decoded.items():
        pre_q, pre_k = run.randn(bsz, h, p, d), run.randn(bsz, h, p, d)
        pre_v = run.randn(bsz, h, p, e)
        _, state = linear_attention(
            fmap.query(pre_q), fmap.key(pre_k), pre_v, causal=True, square=fmap.square,
            chunk_size=run.chunk, return_state=True,
        )  # fmt: skip
        timing = run.time(partial(_ours_decode, fmap, q1, k1, v1, state))
        nbytes = 4 * (state.numerator.numel() + state.denominator.numel())
        rows.add("decode", name, p, "ok", timing, mem=(nbytes, "state"), fmap=fmap)
        bar.update()


def _summarize(rows, lengths, ours: list[str], section: str = "forward") -> dict:
    """Speed-ups vs SDPA, crossover lengths, growth exponents and decode flatness."""
    sdpa = times_of(rows, section, "sdpa")
    out: dict = {}
    for name in ours:
        mine = times_of(rows, section, name)
        for r in rows:
            if r["section"] == section and r["method"] == name and r["T"] in sdpa \
                    and r["status"] == "ok":  # fmt: skip
                r["speedup_vs_sdpa"] = sdpa[r["T"]] / r["median_ms"]
        faster = [t for t in lengths if t in sdpa and t in mine and mine[t] < sdpa[t]]
        big = [t for t in lengths if t >= 4096 and t in mine]
        slope = None
        if len(big) >= 2:  # least-squares exponent of time ~ T^slope over T >= 4k
            xs = [math.log(t) for t in big]
            ys = [math.log(mine[t]) for t in big]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys, strict=True)) / sum(
                (a - mx) ** 2 for a in xs
            )
        dec = times_of(rows, "decode", name)
        sdpa_dec = times_of(rows, "decode", "sdpa")
        dec_faster = [p for p in sorted(dec) if p in sdpa_dec and dec[p] < sdpa_dec[p]]
        out[name] = {
            "decode_crossover": dec_faster[0] if dec_faster else None,
            "crossover": faster[0] if faster else None,
            "faster_from_crossover_on": bool(faster)
            and all(mine[t] < sdpa[t] for t in lengths if t >= faster[0] and t in sdpa),
            "growth_exponent": slope,
            "decode_max_over_min": max(dec.values()) / min(dec.values()) if dec else None,
        }
    return out
