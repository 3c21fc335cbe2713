"""The measuring stages of ``make gpu-check`` (``benchmarks/gpu_check.py`` runs each in its
own process): what each measures (``Setting``: the GPU check, or the CPU dry run ``SMOKE``),
the attention training bench with its parallel Triton warm-up, the model bench and decoding.

Every stage takes a deadline, skips (and records) a measurement predicted to overrun it,
records an error (out of memory, a kernel failure) as its row's status and goes on, and
rewrites its CSV after every measurement, so that a stage stopped from outside keeps its rows.
The measurements themselves are ``polysketch.eval.bench``'s (``run_benchmark``,
``run_model_benchmark``, ``run_decode_benchmark``) and ``benchmarks/decode.py``'s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).resolve().with_name("gpu_check.py")


ATTENTION_FIELDS = (
    "section", "method", "T", "status", "median_ms", "min_ms", "repeats", "speedup_vs_sdpa",
    "mem_mib", "feature_dim", "state_dim", "picked",
)  # fmt: skip
DECODE_FIELDS = ("model", "attention", "position", "ms_per_token", "x_softmax", "runs_ms")


@dataclass(frozen=True)
class Setting:
    """What each stage measures: the GPU check, or the tiny CPU dry run (``--smoke``)."""

    device: str
    lengths: tuple[int, ...]  # attention bench, in the order measured (most wanted first)
    heads: int
    sketch_dim: int
    plain_pairs: int
    min_time: float  # seconds per attention measurement
    min_repeats: int  # timed calls per measurement, at least
    model_contexts: tuple[int, ...]
    model_size: tuple[int, int, int] | None  # (layers, heads, width); None: the bench's
    model_min_time: float
    compiled_contexts: tuple[int, ...]  # the model step compiled (reduce-overhead) beside eager
    decode_positions: tuple[int, ...]
    decode_size: tuple[int, int, int] | None  # TransformerLM (layers, heads, width); None: 4x256
    decode_tokens: int
    decode_repeats: int
    parallel_tests: bool


GPU = Setting(
    device="cuda", lengths=(16384, 65536, 1024, 2048, 4096, 8192, 32768), heads=12,
    sketch_dim=32, plain_pairs=128, min_time=0.3, min_repeats=3,
    model_contexts=(8192, 16384, 32768), model_size=None, model_min_time=1.0,
    compiled_contexts=(8192,),
    decode_positions=(2048, 32768), decode_size=None, decode_tokens=16, decode_repeats=3,
    parallel_tests=True,
)  # fmt: skip
SMOKE = Setting(
    device="cpu", lengths=(32,), heads=1, sketch_dim=16, plain_pairs=8, min_time=0.0,
    min_repeats=1, model_contexts=(32,), model_size=(1, 2, 32), model_min_time=0.0,
    compiled_contexts=(),
    decode_positions=(16,), decode_size=(1, 2, 32), decode_tokens=2, decode_repeats=1,
    parallel_tests=False,
)  # fmt: skip
LONG_CONTEXT_PRESET = "soft_hash_far_local_balanced"
"""The recommended long-context model preset (README's first row), measured beside softmax."""
ATTENTIONS = ("softmax", "psf_random", LONG_CONTEXT_PRESET)
"""The model and decode stages' attentions (the converted Llama: all but the model preset)."""
COMPILED = ("softmax", "psf_random")
"""The attentions whose model step is also timed compiled (``torch.compile``, inductor,
mode "reduce-overhead": CUDA graphs replay the step, no host time per launch)."""
COMPILED_LABEL = " (compiled)"
COMPILE_SECONDS = {"softmax": 60.0}
"""Seconds a compiled row is expected to spend building its step, by attention (others:
``COMPILE_SECONDS_OTHER``, about 3x softmax's: psf_random's step did not build in the time a
GPU check's stage had left, and builds 1.4-2.8x slower than softmax's on a CPU; docs/gpu.md).
A row that cannot get its time is skipped, not stopped half-built."""
COMPILE_SECONDS_OTHER = 180.0


def run(stage: str, *, smoke: bool, out: Path, budget: float, warm=()) -> dict | None:
    """Run ``stage`` ("attention", "model", "decode") within ``budget`` seconds and return its
    status; "warm" compiles the Triton calls ``warm`` ("method:T") and returns None."""
    setting = SMOKE if smoke else GPU
    if stage == "warm":
        for job in warm:
            method, _, t = job.partition(":")
            _triton_call(setting, method, int(t))
        return None
    start = time.monotonic()
    body = {"attention": _attention, "model": _model, "decode": _decode}[stage]
    result = body(setting, out, start + budget)
    result["stage_seconds"] = round(time.monotonic() - start, 1)
    return result


def write(path: Path, rows: list[dict], fields) -> None:
    """Write ``rows`` to the CSV ``path`` with the header ``fields`` (atomically)."""
    from polysketch._files import write_csv

    write_csv(rows, path, columns=fields, float_format=".6g")


def _fits(deadline: float, estimate: float) -> bool:
    return time.monotonic() + estimate <= deadline


PASSES = (
    (  # the table: SDPA, psf_random's map by every backend, FAVOR+ by default
        (("sdpa", "polysketch"), ("chunked", "chunked_blocks", "triton")),
        (("positive",), ("chunked",)),
    ),
    ((("positive",), ("triton",)),),  # then, with what time is left: FAVOR+ by Triton
)
"""Groups of (methods, algorithms) timed at each length, pass after pass."""


def _attention(setting: Setting, out: Path, deadline: float) -> dict:
    """The attention training bench, one length at a time (most wanted first)."""
    from polysketch.eval.bench import BenchConfig, run_benchmark

    base = dict(mode="train", dtype="bf16", heads=setting.heads, device=setting.device,
                sketch_dim=setting.sketch_dim, plain_pairs=setting.plain_pairs,
                min_time=setting.min_time, min_repeats=setting.min_repeats, matmul_n=1024,
                progress=False)  # fmt: skip
    try:
        warmed = _warm(setting, deadline)
    except Exception as err:  # the timing below compiles what is missing itself
        warmed = f"failed ({type(err).__name__}: {err})"
    rows, skipped, last = [], [], None
    for groups in PASSES:
        for t in setting.lengths:
            labels = [label for m, a in groups for label in _labels(m, a)]
            estimate = _estimate(last, t, len(labels))
            if not _fits(deadline, estimate):
                skipped.append(t)
                rows += [_skipped_row(label, t, estimate) for label in labels]
                continue
            t0, new = time.monotonic(), []
            for methods, algorithms in groups:
                try:
                    config = BenchConfig(lengths=(t,), methods=methods, algorithms=algorithms,
                                         **base)  # fmt: skip
                    new += run_benchmark(config)["rows"]
                except Exception as err:  # OOM, a kernel error: recorded, the next runs
                    _free(setting)
                    status = f"error ({type(err).__name__}: {str(err).splitlines()[0][:150]})"
                    new += [{"section": "train", "method": label, "T": t, "status": status}
                            for label in _labels(methods, algorithms)]  # fmt: skip
            for r in new:
                r["picked"] = _picked(setting, t) if r["method"] == "polysketch" else ""
            rows += new
            _speedups(rows)
            last = (t, time.monotonic() - t0, new)
            write(out / "attention.csv", sorted(rows, key=_order), ATTENTION_FIELDS)
    write(out / "attention.csv", sorted(rows, key=_order), ATTENTION_FIELDS)
    status = "ok" if not skipped else f"partial (budget: skipped T = {sorted(set(skipped))})"
    return {"status": status, "rows": len(rows), "warm": warmed}


WARM_PROCESSES = 6
WARM_SHARE = 0.4
"""The warm-up may take this fraction of the attention stage's budget (then it is stopped)."""


def _warm(setting: Setting, deadline: float) -> str:
    """Compile and autotune the Triton kernels of every timed call in parallel processes
    before anything is timed (``triton``'s disk cache keeps the binaries; autotuning again
    in the timing process re-times cached kernels only). One call per distinct launch plan
    (slice groups NS, sequential or split layout) of each Triton method; up to
    ``WARM_PROCESSES`` at once, all stopped at ``WARM_SHARE`` of the stage's time left."""
    jobs = _warm_jobs(setting)
    if not jobs:
        return "nothing to compile"
    t0 = time.monotonic()
    limit = t0 + WARM_SHARE * max(0.0, deadline - t0)
    env = dict(os.environ, TRITON_PRINT_AUTOTUNING="0")
    base = [sys.executable, str(DRIVER), "--stage", "warm"]
    base += ["--smoke"] if setting is SMOKE else []
    chunks = [jobs[i::WARM_PROCESSES] for i in range(min(WARM_PROCESSES, len(jobs)))]
    procs = [subprocess.Popen([*base, "--warm", *chunk], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for chunk in chunks]  # fmt: skip
    stopped, failed = 0, []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(0.0, limit - time.monotonic()))
            if proc.returncode:
                failed.append((err or "").strip().splitlines()[-1:] or ["?"])
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            stopped += 1
    text = f"{len(jobs)} calls in {len(procs)} processes, {time.monotonic() - t0:.0f} s"
    if stopped:
        text += f", {stopped} stopped at the limit"
    if failed:
        text += f", {len(failed)} failed: {failed[0][0][:150]}"
    print(f"warm-up: {text}", flush=True)
    return text


def _warm_jobs(setting: Setting) -> list[str]:
    """``method:T`` for one length per distinct Triton launch plan of the timed calls."""
    from polysketch.eval.bench.attention import bench_maps
    from polysketch.ops.dispatch import multiprocessor_count
    from polysketch.ops.triton._config import block_e, block_t, slice_groups
    from polysketch.ops.triton._layout import choose_segment

    sms = multiprocessor_count(setting.device)
    maps = bench_maps(_bench_config(setting), "cpu")
    timed = [m for groups in PASSES for ms, algs in groups if "triton" in algs for m in ms]
    methods = [m for m in timed if m in maps]  # those linear_attention runs
    jobs, seen = [], set()
    for method in dict.fromkeys(methods):
        square, f = maps[method].square, maps[method].feature_dim
        e, bh = 64, setting.heads
        for t in setting.lengths:
            bt = block_t(256, t, f, 2)
            ns = slice_groups(bh, t, f, e, sms, square=square, element_size=2)
            ne = -(-e // block_e(f, e, square=square, element_size=2))
            seg = choose_segment("auto", bh=bh, t=t, f=f, e=e, bt=bt, grid=bh * ne * ns,
                                 square=square, sms=sms)  # fmt: skip
            key = (method, bt, ns, seg is None)
            if key not in seen:
                seen.add(key)
                jobs.append(f"{method}:{t}")
    return jobs


def _bench_config(setting: Setting):
    """The ``BenchConfig`` of the attention stage's maps and shapes (``bench_maps``)."""
    from polysketch.eval.bench import BenchConfig

    return BenchConfig(heads=setting.heads, sketch_dim=setting.sketch_dim,
                       plain_pairs=setting.plain_pairs, device=setting.device)  # fmt: skip


def _triton_call(setting: Setting, method: str, t: int) -> None:
    """One forward + backward of the bench's ``method[triton]`` call at length ``t``."""
    import torch
    import torch.nn.functional as nnf

    from polysketch.eval.bench.attention import bench_maps
    from polysketch.ops import linear_attention

    config = _bench_config(setting)
    fmap = bench_maps(config, torch.device(setting.device))[method]
    g = torch.Generator().manual_seed(0)
    q, k = (nnf.layer_norm(torch.randn(1, setting.heads, t, 64, generator=g), (64,))
            for _ in range(2))  # fmt: skip
    v = torch.randn(1, setting.heads, t, 64, generator=g)
    q, k, v = (x.to(setting.device, torch.bfloat16).requires_grad_(True) for x in (q, k, v))
    out = linear_attention(fmap.query(q), fmap.key(k), v, causal=True, square=fmap.square,
                           chunk_size=config.chunk_size, algorithm="triton")  # fmt: skip
    out.float().square().sum().backward()
    if setting.device == "cuda":
        torch.cuda.synchronize()


def _speedups(rows: list[dict]) -> None:
    """speedup_vs_sdpa of every ok row (SDPA's median ms / the row's at the same T)."""
    sdpa = {r["T"]: r["median_ms"] for r in rows if r["method"] == "sdpa" and r["status"] == "ok"}
    for r in rows:
        if r["status"] == "ok" and r["method"] != "sdpa" and r["T"] in sdpa:
            r["speedup_vs_sdpa"] = sdpa[r["T"]] / r["median_ms"]


def _free(setting: Setting) -> None:
    if setting.device == "cuda":
        import torch

        torch.cuda.empty_cache()


def _labels(methods, algorithms) -> list[str]:
    from polysketch.eval.bench.attention import ALGORITHM_METHODS, method_label

    return [method_label(m, a) for m in methods
            for a in (algorithms if m in ALGORITHM_METHODS else ("chunked",))]  # fmt: skip


def _skipped_row(method: str, t: int, estimate: float) -> dict:
    return {"section": "train", "method": method, "T": t,
            "status": f"skipped (budget: ~{estimate:.0f} s)"}  # fmt: skip


def _estimate(last, t: int, methods: int) -> float:
    """Seconds ``methods`` rows at length ``t`` should take, from the last length measured:
    per row, the time its timed calls took (scaled by T, SDPA's by T²), plus 15 s for
    compiling and autotuning kernels a new shape may need."""
    if last is None:
        return 0.0
    t_last, _, rows = last
    per_row = []
    for r in rows:
        if r.get("status") == "ok":
            scale = (t / t_last) ** (2 if r["method"] == "sdpa" else 1)
            per_row.append(r["median_ms"] / 1e3 * (r["repeats"] + 4) * scale)
    mean = sum(per_row) / len(per_row) if per_row else 0.0
    return 1.5 * mean * methods + 15.0


def _order(row: dict):
    return (row["method"], int(row["T"]))


def _picked(setting: Setting, t: int) -> str:
    """The backend the default dispatch picks for the bench's polysketch call at length t."""
    import torch

    from polysketch.ops.dispatch import resolve_algorithm

    f, e = setting.sketch_dim, 64
    a = torch.zeros(1, 1, 1, f, dtype=torch.bfloat16, device=setting.device)
    a = a.expand(1, setting.heads, t, f)
    v = torch.zeros(1, 1, 1, e, dtype=torch.bfloat16, device=setting.device)
    v = v.expand(1, setting.heads, t, e)
    if setting.device == "cpu":  # the bench runs bf16 as fp32 operands on CPU
        a, v = a.float(), v.float()
    return resolve_algorithm("chunked", a, a, v, square=True, with_state=False)


def _model(setting: Setting, out: Path, deadline: float) -> dict:
    """TransformerLM training tokens/s and peak memory, each length for every attention."""
    from polysketch.eval.bench import ModelBenchConfig, run_model_benchmark
    from polysketch.eval.bench.model import MODEL_FIELDS

    size = {}
    if setting.model_size is not None:
        size = dict(zip(("n_layer", "n_head", "n_embd"), setting.model_size, strict=True))
    rows, skipped, walls = [], [], {}
    runs = [(t, a, False) for t in setting.model_contexts for a in ATTENTIONS]
    runs += [(t, a, True) for t in setting.compiled_contexts for a in COMPILED]
    for t, attention, compiled in runs:
        label = attention + (COMPILED_LABEL if compiled else "")
        compile_kw = {"compile": "inductor", "compile_mode": "reduce-overhead"} if compiled else {}
        prev = walls.get(attention)  # a compiled step: the eager one's time, compiling aside
        build = COMPILE_SECONDS.get(attention, COMPILE_SECONDS_OTHER) if compiled else 0.0
        estimate = 0.0 if prev is None else prev[1] * t / prev[0] + build
        if not _fits(deadline, estimate):
            skipped.append(f"{label} T={t}")
            rows.append({"attention": label, "T": t,
                         "status": f"skipped (budget: ~{estimate:.0f} s)"})  # fmt: skip
            continue
        t0 = time.monotonic()
        config = ModelBenchConfig(attentions=(attention,), contexts=(t,), device=setting.device,
                                  min_time=setting.model_min_time,
                                  min_repeats=max(1, setting.min_repeats - 1),
                                  progress=False, **size, **compile_kw)  # fmt: skip
        try:
            got = run_model_benchmark(config)["rows"]
            rows += [{**r, "attention": label} for r in got]
        except Exception as err:  # recorded; the next row runs
            _free(setting)
            status = f"error ({type(err).__name__}: {str(err).splitlines()[0][:150]})"
            rows.append({"attention": label, "T": t, "status": status})
        wall = time.monotonic() - t0
        if not compiled:
            walls[attention] = (t, wall)
        print(f"model: {label} T={t}: {rows[-1].get('status', 'ok')} in {wall:.0f} s", flush=True)
        write(out / "model.csv", _with_ratios(rows), MODEL_FIELDS)
    write(out / "model.csv", _with_ratios(rows), MODEL_FIELDS)
    status = "ok" if not skipped else f"partial (budget: skipped {', '.join(skipped)})"
    return {"status": status, "rows": len(rows)}


def _with_ratios(rows: list[dict]) -> list[dict]:
    """The rows with x_softmax (tokens/s over softmax's at the same T, compiled against
    compiled softmax) filled in."""

    def kind(r):
        return (r["T"], str(r["attention"]).endswith(COMPILED_LABEL))

    soft = {kind(r): r["tokens_per_s"] for r in rows
            if str(r["attention"]).removesuffix(COMPILED_LABEL) == "softmax"
            and r.get("status") == "ok"}  # fmt: skip
    for r in rows:
        if r.get("status") == "ok" and kind(r) in soft:
            r["x_softmax"] = r["tokens_per_s"] / soft[kind(r)]
    return rows


def _decode(setting: Setting, out: Path, deadline: float) -> dict:
    """Decode ms/token at each position: TransformerLM, then the converted Llama."""
    from polysketch.eval.bench.decode import DecodeBenchConfig, run_decode_benchmark

    rows, skipped = [], []
    kw = dict(tokens=setting.decode_tokens, warmup=2, repeats=setting.decode_repeats)
    size = {}
    if setting.decode_size is not None:
        size = dict(zip(("n_layer", "n_head", "n_embd"), setting.decode_size, strict=True))
    for position in setting.decode_positions:
        if not _fits(deadline, 2.0):
            skipped.append(f"P={position}")
            continue
        config = DecodeBenchConfig(attentions=ATTENTIONS, positions=(position,),
                                   device=setting.device, **size, **kw)  # fmt: skip
        rows += [{"model": "TransformerLM", **r} for r in run_decode_benchmark(config)]
        write(out / "decode.csv", _cells(rows), DECODE_FIELDS)
    try:
        import transformers  # noqa: F401
    except ImportError:
        skipped.append("converted Llama (transformers not installed)")
    else:
        from decode import hf_rows  # benchmarks/decode.py

        for position in setting.decode_positions:
            if not _fits(deadline, 2.0):
                skipped.append(f"Llama P={position}")
                continue
            llama = hf_rows([a for a in ATTENTIONS if a != LONG_CONTEXT_PRESET], [position],
                            device=setting.device, chunk_size=64, progress=lambda *_: None,
                            **kw)  # fmt: skip
            rows += [{"model": "converted Llama", **r} for r in llama]
            write(out / "decode.csv", _cells(rows), DECODE_FIELDS)
    write(out / "decode.csv", _cells(rows), DECODE_FIELDS)
    status = "ok" if not skipped else f"partial (skipped {', '.join(skipped)})"
    return {"status": status, "rows": len(rows)}


def _cells(rows: list[dict]) -> list[dict]:
    return [dict(r, runs_ms=" ".join(f"{x:.4g}" for x in r["runs_ms"])) for r in rows]
