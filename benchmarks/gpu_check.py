"""``make gpu-check``: the whole GPU check in one command, inside one short GPU lease.

Four stages, each in its own process with its own time budget, so that a slow or crashing
stage costs only itself (issue 39 §1):

1. ``tests``: all of ``tests/gpu`` (pytest; one Triton launch configuration, in parallel
   workers when pytest-xdist is installed);
2. ``attention``: the attention training bench (``polysketch.eval.bench.run_benchmark``,
   forward + backward, bf16, B = 1, H = 12, D = 64): SDPA, the default dispatch and every fast
   path side by side (``chunked_blocks``, ``triton``) for psf_random's map, and FAVOR+ (F = 256)
   by default and by Triton, T = 1k-64k, with Triton's full autotuning;
3. ``model``: ``TransformerLM`` training tokens/s and peak memory (12 × 768, bf16 autocast;
   ``polysketch.eval.bench.run_model_benchmark``) for softmax, psf_random and
   soft_hash_far_local at 8k, 16k and 32k;
4. ``decode``: whole-model greedy decoding ms/token against softmax's KV cache at 2k and 32k
   (``polysketch.eval.bench.run_decode_benchmark`` on ``TransformerLM``, and a Llama built from
   a random-init config and converted, ``benchmarks/decode.py``).

Writes ONE folder (``--out``; refused when not empty unless ``--overwrite``): ``summary.md``
(every table and ratio), ``tests.csv``, ``attention.csv``, ``model.csv``, ``decode.csv`` and
``gpu_check.log`` (every stage's output); prints the summary last; exits 1 when a test failed
or the tests did not all run, else 0.

Budgets: each stage gets its share of ``--budget`` (default 330 s) plus what the stages before
it left unused; inside a stage a measurement whose predicted time would overrun the stage's
budget is skipped and recorded, the longest lengths first in line are the ones the dispatcher's
threshold is read from (16k, 64k), and a stage still running at its budget plus a grace period
is stopped (its rows so far are kept: every stage rewrites its CSV after each measurement).

``--smoke``: the same plumbing on CPU in seconds (tiny shapes, Triton under its interpreter),
run by ``tests/test_gpu_check.py`` in ``make test`` so it cannot rot.

    PYTHONPATH=src python benchmarks/gpu_check.py --out gpu-check        # make gpu-check
    PYTHONPATH=src python benchmarks/gpu_check.py --smoke --out /tmp/gc  # CPU dry run
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("tests", "attention", "model", "decode")
SHARES = {"tests": 100, "attention": 120, "model": 75, "decode": 35}
"""Seconds of each stage at the default ``--budget`` of 330 (scaled with it): with one stage
overrunning into its ``GRACE`` and start-up, the whole check stays within 6 minutes, and
``tests/gpu`` within 2."""
GRACE = 20
"""Seconds a stage may run past its budget before it is stopped."""
RESULT = "GPU-CHECK-STAGE-RESULT "
"""The prefix of the line a stage process prints last: its status as JSON."""
FILES = ("summary.md", "tests.csv", "attention.csv", "model.csv", "decode.csv", "gpu_check.log")
TEST_FIELDS = ("test", "outcome", "seconds", "message")
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
    decode_positions: tuple[int, ...]
    decode_size: tuple[int, int, int] | None  # TransformerLM (layers, heads, width); None: 4x256
    decode_tokens: int
    decode_repeats: int
    parallel_tests: bool


GPU = Setting(
    device="cuda", lengths=(16384, 65536, 1024, 2048, 4096, 8192, 32768), heads=12,
    sketch_dim=32, plain_pairs=128, min_time=0.3, min_repeats=3,
    model_contexts=(8192, 16384, 32768), model_size=None, model_min_time=1.0,
    decode_positions=(2048, 32768), decode_size=None, decode_tokens=16, decode_repeats=3,
    parallel_tests=True,
)  # fmt: skip
SMOKE = Setting(
    device="cpu", lengths=(32,), heads=1, sketch_dim=16, plain_pairs=8, min_time=0.0,
    min_repeats=1, model_contexts=(32,), model_size=(1, 2, 32), model_min_time=0.0,
    decode_positions=(16,), decode_size=(1, 2, 32), decode_tokens=2, decode_repeats=1,
    parallel_tests=False,
)  # fmt: skip
ATTENTIONS = ("softmax", "psf_random", "soft_hash_far_local")
"""The model and decode stages' attentions (the converted Llama: all but the model preset)."""


# ----- the parent: stages as processes, the summary ---------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="the one folder")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    parser.add_argument("--smoke", action="store_true", help="CPU dry run with tiny shapes")
    parser.add_argument("--budget", type=float, default=float(sum(SHARES.values())),
                        help="seconds for all stages")  # fmt: skip
    parser.add_argument("--stage", choices=(*STAGES, "warm"), help=argparse.SUPPRESS)
    parser.add_argument("--stage-budget", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--warm", nargs="*", default=(), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget must be positive, got {args.budget}")
    if args.stage is not None:
        return _run_stage(args)
    out = args.out.resolve()  # the stages run in the repository root
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not args.overwrite)):
        print(f"gpu_check: error: --out {out} is not an empty folder (use --overwrite)",
              file=sys.stderr)  # fmt: skip
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        (out / name).unlink(missing_ok=True)
    start = time.monotonic()
    log = (out / "gpu_check.log").open("w", encoding="utf-8")
    env = _environment(args.smoke)
    log.write(f"gpu_check {' '.join(argv if argv is not None else sys.argv[1:])}\n")
    log.write(json.dumps(env, indent=1) + "\n")
    stages, carry = {}, 0.0
    scale = args.budget / sum(SHARES.values())
    for name in STAGES:
        left = args.budget - (time.monotonic() - start)
        budget = min(SHARES[name] * scale + carry, left)
        if budget < 0.2 * SHARES[name] * scale:
            stages[name] = {"status": f"skipped (budget: {max(left, 0):.0f} s left)",
                            "seconds": 0.0, "budget": budget}  # fmt: skip
            log.write(f"\n=== {name}: {stages[name]['status']}\n")
            continue
        stages[name] = _stage_process(name, budget, out, args.smoke, log)
        carry = max(0.0, budget - stages[name]["seconds"])
        print(f"gpu_check: {name}: {stages[name]['status']} in {stages[name]['seconds']:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    total = time.monotonic() - start
    summary = _summary(out, stages, env, total, args)
    (out / "summary.md").write_text(summary, encoding="utf-8")
    log.close()
    print(summary)
    return 0 if _tests_passed(out, stages) else 1


def _environment(smoke: bool) -> dict:
    import torch

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
        "python": platform.python_version(), "torch": torch.__version__,
        "smoke": smoke, "commit": _commit(),
    }  # fmt: skip
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["sms"] = props.multi_processor_count
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    else:
        env["gpu"] = "none (CPU)"
    return env


def _commit() -> str:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _stage_process(name: str, budget: float, out: Path, smoke: bool, log) -> dict:
    """Run one stage in its own process (stopped at ``budget`` + ``GRACE``); its status."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("TRITON_PRINT_AUTOTUNING", "1")  # the chosen configs go to the log
    if smoke:
        env["TRITON_INTERPRET"] = "1"
    if name == "tests":
        cmd = _pytest_command(out, (SMOKE if smoke else GPU).parallel_tests)
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", name, "--out", str(out),
               "--stage-budget", f"{budget:.1f}"] + (["--smoke"] if smoke else [])  # fmt: skip
    log.write(f"\n=== {name} (budget {budget:.0f} s): {' '.join(cmd)}\n")
    log.flush()
    t0 = time.monotonic()
    output, code, killed = _run_group(cmd, env, budget + GRACE)
    seconds = time.monotonic() - t0
    log.write(output)
    log.flush()
    result = {"seconds": seconds, "budget": budget, "returncode": code}
    if name == "tests":
        result.update(_test_results(out, output, killed))
    else:
        reported = [line for line in output.splitlines() if line.startswith(RESULT)]
        result.update(json.loads(reported[-1][len(RESULT) :]) if reported else {})
    if killed:
        result["status"] = f"stopped at {budget + GRACE:.0f} s (budget {budget:.0f} s + grace)"
    elif "status" not in result:
        result["status"] = f"failed (exit {code}; see gpu_check.log)"
    return result


def _run_group(cmd: list[str], env: dict, timeout: float) -> tuple[str, int | None, bool]:
    """Run ``cmd`` in its own process group; (stdout + stderr, exit code or None, stopped).
    At ``timeout`` the whole group is killed (pytest's workers and a stage's warm-up
    processes with it), so nothing it started keeps the GPU."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
        return output, proc.returncode, False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        output, _ = proc.communicate()
        return _text(output), None, True


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


# ----- stage 1: tests/gpu ----------------------------------------------------------------------
def _pytest_command(out: Path, parallel: bool) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-v", "-p", "no:cacheprovider",
           "-o", "addopts=", "--junitxml", str(out / ".junit.xml")]  # fmt: skip
    if parallel and _has_xdist():
        cmd += ["-n", "4"]  # kernels compile in parallel; one GPU serves all workers
    return cmd


def _has_xdist() -> bool:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return False
    return True


_LINE = re.compile(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b.*?(tests/gpu/\S+)|"
                   r"(tests/gpu/\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")  # fmt: skip


def _test_results(out: Path, output: str, killed: bool) -> dict:
    """tests.csv from the JUnit XML of a finished run, else from pytest's -v lines."""
    junit = out / ".junit.xml"
    rows = []
    if junit.exists() and not killed:
        for case in ET.parse(junit).getroot().iter("testcase"):
            test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = {"failure": "failed", "error": "error"}.get(tag, "skipped")
                    message = (node.get("message") or "").splitlines()[0][:200] if \
                        node.get("message") else ""  # fmt: skip
            rows.append({"test": test, "outcome": outcome,
                         "seconds": float(case.get("time", 0)), "message": message})  # fmt: skip
    else:
        for match in _LINE.finditer(output):
            word = match.group(1) or match.group(4)
            test = match.group(2) or match.group(3)
            rows.append({"test": test, "outcome": word.lower(), "seconds": "", "message": ""})
    junit.unlink(missing_ok=True)
    _write(out / "tests.csv", rows, TEST_FIELDS)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error",
                                                                "skipped")}  # fmt: skip
    bad = counts["failed"] + counts["error"]
    status = "ok" if not bad and not killed and rows else "FAILED" if bad else "incomplete"
    if not rows:
        status = "no test ran (see gpu_check.log)"
    return {"status": status, **counts}


def _tests_passed(out: Path, stages: dict) -> bool:
    return stages.get("tests", {}).get("status") == "ok"


# ----- stages 2-4, run in their own process ----------------------------------------------------
def _run_stage(args) -> int:
    setting = SMOKE if args.smoke else GPU
    if args.stage == "warm":
        for job in args.warm:
            method, _, t = job.partition(":")
            _triton_call(setting, method, int(t))
        return 0
    budget = args.stage_budget or SHARES[args.stage]
    start = time.monotonic()
    deadline = start + budget
    stage = {"attention": _attention, "model": _model, "decode": _decode}[args.stage]
    result = stage(setting, args.out, deadline)
    result["stage_seconds"] = round(time.monotonic() - start, 1)
    print(RESULT + json.dumps(result), flush=True)
    return 0


def _write(path: Path, rows: list[dict], fields) -> None:
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
            _write(out / "attention.csv", sorted(rows, key=_order), ATTENTION_FIELDS)
    _write(out / "attention.csv", sorted(rows, key=_order), ATTENTION_FIELDS)
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
    base = [sys.executable, str(Path(__file__).resolve()), "--stage", "warm"]
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
    for t in setting.model_contexts:
        for attention in ATTENTIONS:
            prev = walls.get(attention)
            estimate = 0.0 if prev is None else prev[1] * t / prev[0]
            if not _fits(deadline, estimate):
                skipped.append(f"{attention} T={t}")
                rows.append({"attention": attention, "T": t,
                             "status": f"skipped (budget: ~{estimate:.0f} s)"})  # fmt: skip
                continue
            t0 = time.monotonic()
            config = ModelBenchConfig(attentions=(attention,), contexts=(t,), device=setting.device,
                                      min_time=setting.model_min_time,
                                      min_repeats=max(1, setting.min_repeats - 1),
                                      progress=False, **size)  # fmt: skip
            try:
                rows += run_model_benchmark(config)["rows"]
            except Exception as err:  # recorded; the next row runs
                _free(setting)
                status = f"error ({type(err).__name__}: {str(err).splitlines()[0][:150]})"
                rows.append({"attention": attention, "T": t, "status": status})
            walls[attention] = (t, time.monotonic() - t0)
            _write(out / "model.csv", _with_ratios(rows), MODEL_FIELDS)
    _write(out / "model.csv", _with_ratios(rows), MODEL_FIELDS)
    status = "ok" if not skipped else f"partial (budget: skipped {', '.join(skipped)})"
    return {"status": status, "rows": len(rows)}


def _with_ratios(rows: list[dict]) -> list[dict]:
    """The rows with x_softmax (tokens/s over softmax's at the same T) filled in."""
    soft = {r["T"]: r["tokens_per_s"] for r in rows
            if r["attention"] == "softmax" and r.get("status") == "ok"}  # fmt: skip
    for r in rows:
        if r.get("status") == "ok" and r["T"] in soft:
            r["x_softmax"] = r["tokens_per_s"] / soft[r["T"]]
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
        _write(out / "decode.csv", _cells(rows), DECODE_FIELDS)
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
            llama = hf_rows([a for a in ATTENTIONS if a != "soft_hash_far_local"], [position],
                            device=setting.device, chunk_size=64, progress=lambda *_: None,
                            **kw)  # fmt: skip
            rows += [{"model": "converted Llama", **r} for r in llama]
            _write(out / "decode.csv", _cells(rows), DECODE_FIELDS)
    _write(out / "decode.csv", _cells(rows), DECODE_FIELDS)
    status = "ok" if not skipped else f"partial (skipped {', '.join(skipped)})"
    return {"status": status, "rows": len(rows)}


def _cells(rows: list[dict]) -> list[dict]:
    return [dict(r, runs_ms=" ".join(f"{x:.4g}" for x in r["runs_ms"])) for r in rows]


# ----- the summary -----------------------------------------------------------------------------
def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _num(text) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _summary(out: Path, stages: dict, env: dict, total: float, args) -> str:
    lines = [
        f"# make gpu-check{' --smoke (CPU dry run)' if args.smoke else ''}",
        "",
        f"{env['date']}; {env['gpu']}"
        + (f" ({env['sms']} SMs, {env['gpu_memory_gib']} GiB)" if "sms" in env else "")
        + f"; torch {env['torch']}, triton {env['triton']}, Python {env['python']}; "
        f"commit {env['commit']}. Total {total:.0f} s (budget {args.budget:.0f} s).",
        "",
        "## Stages",
        "",
        "| stage | status | seconds | budget |",
        "|---|---|---|---|",
    ]
    for name in STAGES:
        s = stages.get(name, {})
        lines.append(f"| {name} | {s.get('status', 'not run')} | {s.get('seconds', 0):.0f} | "
                     f"{s.get('budget', 0):.0f} |")  # fmt: skip
    lines += _tests_section(out, stages.get("tests", {}))
    lines += _attention_section(out)
    lines += _model_section(out)
    lines += _decode_section(out)
    return "\n".join(lines) + "\n"


def _tests_section(out: Path, stage: dict) -> list[str]:
    rows = _read(out / "tests.csv")
    counts = ", ".join(f"{stage.get(k, 0)} {k}" for k in ("passed", "failed", "error", "skipped"))
    lines = ["", "## tests/gpu", "", f"{counts} ({stage.get('status', 'not run')}, "
             f"{stage.get('seconds', 0):.0f} s; every test in tests.csv)."]  # fmt: skip
    for r in rows:
        if r["outcome"] in ("failed", "error"):
            lines.append(f"- **{r['outcome']}** `{r['test']}` {r['message']}")
    return lines


def _attention_section(out: Path) -> list[str]:
    rows = _read(out / "attention.csv")
    if not rows:
        return ["", "## Attention training (forward + backward)", "", "no rows (see the log)"]
    ms = {(r["method"], int(r["T"])): _num(r["median_ms"]) for r in rows}
    mem = {(r["method"], int(r["T"])): _num(r["mem_mib"]) for r in rows}
    picked = {int(r["T"]): r["picked"] for r in rows if r["method"] == "polysketch"}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted({int(r["T"]) for r in rows})
    lines = [
        "", "## Attention training (forward + backward): ms, and × SDPA (> 1: faster)", "",
        "bf16, B = 1, H = 12, D = 64; polysketch = psf_random's map (degree-2 sketch, r = 32, "
        "squared), positive = FAVOR+ (F = 256); `polysketch` is the default dispatch (the "
        "backend it picked in brackets).", "",
        "| T | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|",
    ]  # fmt: skip
    for t in lengths:
        cells = []
        for m in methods:
            x = ms.get((m, t))
            if x is None:
                cells.append("—")
                continue
            sdpa = ms.get(("sdpa", t))
            ratio = f" ({sdpa / x:.2f}×)" if sdpa and m != "sdpa" else ""
            extra = f" [{picked.get(t)}]" if m == "polysketch" and picked.get(t) else ""
            cells.append(f"{x:.3g}{ratio}{extra}")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines += ["", "Fast paths against chunked_blocks (its ms / theirs; > 1: faster), and peak "
              "memory (MiB):", "", "| T | default | triton | positive[triton] vs positive | "
              "MiB sdpa | MiB default | MiB chunked_blocks | MiB triton |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    faster = []
    for t in lengths:
        base = ms.get(("polysketch[chunked_blocks]", t))

        def vs(m, ref=base, t=t):
            x = ms.get((m, t))
            return f"{ref / x:.2f}×" if ref and x else "—"

        tri = ms.get(("polysketch[triton]", t))
        if base and tri and tri < base:
            faster.append(t)
        mems = [mem.get((m, t)) for m in ("sdpa", "polysketch", "polysketch[chunked_blocks]",
                                          "polysketch[triton]")]  # fmt: skip
        lines.append(
            f"| {t} | {vs('polysketch')} | {vs('polysketch[triton]')} | "
            f"{vs('positive[triton]', ms.get(('positive', t)))} | "
            + " | ".join("—" if x is None else f"{x:.0f}" for x in mems)
            + " |"
        )
    from polysketch.ops.dispatch import TRITON_MIN_LENGTH

    lines += ["", f"Triton faster than chunked_blocks at T = {faster or 'none measured'}; the "
              f"dispatcher's TRITON_MIN_LENGTH is {TRITON_MIN_LENGTH} (set it to the shortest "
              "length from which Triton stays faster)."]  # fmt: skip
    skipped = sorted({f"{r['method']} T={r['T']}: {r['status']}" for r in rows
                      if r["status"] != "ok"})  # fmt: skip
    if skipped:
        lines += ["", "Not measured:", *[f"- {s}" for s in skipped]]
    return lines


def _model_section(out: Path) -> list[str]:
    rows = _read(out / "model.csv")
    lines = ["", "## Model training: tokens/s, × softmax, peak memory", ""]
    if not rows:
        return [*lines, "no rows (see the log)"]
    lines += ["| attention | T | chunk | tokens/s | × softmax | peak MiB | status |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        tok, ratio, mib = (_num(r.get(k)) for k in ("tokens_per_s", "x_softmax", "mem_mib"))
        lines.append(
            f"| {r['attention']} | {r['T']} | {r.get('chunk_size', '')} | "
            f"{'' if tok is None else f'{tok:.0f}'} | {'' if ratio is None else f'{ratio:.2f}'} "
            f"| {'' if mib is None else f'{mib:.0f}'} | {r['status']} |"
        )
    return lines


def _decode_section(out: Path) -> list[str]:
    rows = _read(out / "decode.csv")
    lines = ["", "## Decoding: ms/token, × softmax's KV cache (> 1: faster)", ""]
    if not rows:
        return [*lines, "no rows (see the log)"]
    lines += ["| model | attention | position | ms/token | × softmax |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = _num(r["x_softmax"])
        lines.append(f"| {r['model']} | {r['attention']} | {r['position']} | "
                     f"{float(r['ms_per_token']):.3g} | "
                     f"{'' if ratio is None else f'{ratio:.2f}'} |")  # fmt: skip
    return lines


if __name__ == "__main__":
    sys.exit(main())
