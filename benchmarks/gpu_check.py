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
   the recommended long-context preset (``soft_hash_far_local_balanced``) at 8k, 16k and 32k;
4. ``decode``: whole-model greedy decoding ms/token against softmax's KV cache at 2k and 32k
   (``polysketch.eval.bench.run_decode_benchmark`` on ``TransformerLM``, and a Llama built from
   a random-init config and converted, ``benchmarks/decode.py``).

Writes ONE folder (``--out``; refused when not empty unless ``--overwrite``): ``summary.md``
(every table and ratio), ``tests.csv``, ``attention.csv``, ``model.csv``, ``decode.csv`` and
``gpu_check.log`` (every stage's output); prints the summary last; exits 1 when a test failed
or the tests did not all run, else 0. ``--stages`` runs a subset (e.g. ``tests,attention``
after a fix, in a lease's time left), sharing ``--budget`` among them; the exit status then
reads the tests only where they ran.

Budgets: each stage gets its share of ``--budget`` (default 330 s) plus what the stages before
it left unused; inside a stage a measurement whose predicted time would overrun the stage's
budget is skipped and recorded, the longest lengths come first in line (16k, 64k), and a stage
still running at its budget plus a grace period is stopped (its rows so far are kept: every
stage rewrites its CSV after each measurement). The grace comes only out of time that no later
stage's share needs, so one stage's overrun never eats the next one's share (the first H200 run
lost its decode stage so).

The stages' measuring code is ``benchmarks/gpu_check_stages.py``; this file runs them and
writes the summary.

``--smoke``: the same plumbing on CPU in seconds (tiny shapes, Triton under its interpreter),
run by ``tests/test_gpu_check.py`` in ``make test`` so it cannot rot.

    PYTHONPATH=src python benchmarks/gpu_check.py --out gpu-check        # make gpu-check
    PYTHONPATH=src python benchmarks/gpu_check.py --smoke --out /tmp/gc  # CPU dry run
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import gpu_check_stages as measure
from gpu_check_stages import ATTENTIONS, GPU, LONG_CONTEXT_PRESET, SMOKE

__all__ = ["main", "ATTENTIONS", "FILES", "LONG_CONTEXT_PRESET", "STAGES"]

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("tests", "attention", "model", "decode")
SHARES = {"tests": 100, "attention": 120, "model": 75, "decode": 35}
"""Seconds of each stage at the default ``--budget`` of 330 (scaled with it): with one stage
overrunning into its ``GRACE`` and start-up, the whole check stays within 6 minutes, and
``tests/gpu`` within 2."""
GRACE = 20
"""Seconds a stage may run past its budget before it is stopped, taken only from time no later
stage's share needs (the last stage run always has it): an overrun never shortens the next."""
RESULT = "GPU-CHECK-STAGE-RESULT "
"""The prefix of the line a stage process prints last: its status as JSON."""
FILES = ("summary.md", "tests.csv", "attention.csv", "model.csv", "decode.csv", "gpu_check.log")
TEST_FIELDS = ("test", "outcome", "seconds", "message")


# ----- the parent: stages as processes, the summary ---------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="the one folder")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    parser.add_argument("--smoke", action="store_true", help="CPU dry run with tiny shapes")
    parser.add_argument("--budget", type=float, default=float(sum(SHARES.values())),
                        help="seconds for all stages")  # fmt: skip
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated stages to run, of {','.join(STAGES)} (default: "
                        "all; --budget is shared among those run, by their shares)")  # fmt: skip
    parser.add_argument("--stage", choices=(*STAGES, "warm"), help=argparse.SUPPRESS)
    parser.add_argument("--stage-budget", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--warm", nargs="*", default=(), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget must be positive, got {args.budget}")
    if args.stage is not None:
        return _run_stage(args)
    selected = [name.strip() for name in args.stages.split(",") if name.strip()]
    unknown = sorted(set(selected) - set(STAGES))
    if unknown or not selected:
        parser.error(f"--stages must name some of {', '.join(STAGES)}, got {args.stages!r}")
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
    scale = args.budget / sum(SHARES[name] for name in selected)
    for i, name in enumerate(STAGES):
        if name not in selected:
            stages[name] = {"status": "not selected (--stages)", "seconds": 0.0, "budget": 0.0}
            continue
        left = args.budget - (time.monotonic() - start)
        reserve = scale * sum(SHARES[later] for later in STAGES[i + 1 :] if later in selected)
        budget = min(SHARES[name] * scale + carry, left - reserve)
        grace = GRACE if not reserve else min(GRACE, max(0.0, left - reserve - budget))
        if budget < 0.2 * SHARES[name] * scale:
            stages[name] = {"status": f"skipped (budget: {max(left, 0):.0f} s left)",
                            "seconds": 0.0, "budget": budget}  # fmt: skip
            log.write(f"\n=== {name}: {stages[name]['status']}\n")
            continue
        stages[name] = _stage_process(name, budget, out, args.smoke, log, grace)
        carry = max(0.0, budget - stages[name]["seconds"])
        print(f"gpu_check: {name}: {stages[name]['status']} in {stages[name]['seconds']:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    total = time.monotonic() - start
    summary = _summary(out, stages, env, total, args)
    (out / "summary.md").write_text(summary, encoding="utf-8")
    log.close()
    print(summary)
    return 0 if "tests" not in selected or _tests_passed(out, stages) else 1


def _environment(smoke: bool) -> dict:
    import torch

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
        "python": platform.python_version(), "torch": torch.__version__,
        "smoke": smoke, "commit": _commit(), "source": source_digest(),
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


def source_digest() -> str:
    """The first 12 hex digits of SHA-256 over ``src/`` and ``benchmarks/`` (each ``.py`` file's
    path and bytes, in path order): what ran, also where the machine's copy of ``.git`` lags the
    working tree (the first H200 run's second call printed its session's starting commit);
    files git does not track count too."""
    digest = hashlib.sha256()
    files = (p for folder in ("src", "benchmarks") for p in (ROOT / folder).rglob("*.py"))
    for path in sorted(files):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _commit() -> str:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _stage_process(name: str, budget: float, out: Path, smoke: bool, log,
                   grace: float = GRACE) -> dict:  # fmt: skip
    """Run one stage in its own process (stopped at ``budget`` + ``grace``); its status."""
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
    output, code, killed = _run_group(cmd, env, budget + grace)
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
        result["status"] = f"stopped at {budget + grace:.0f} s (budget {budget:.0f} s + grace)"
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
    measure.write(out / "tests.csv", rows, TEST_FIELDS)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error",
                                                                "skipped")}  # fmt: skip
    bad = counts["failed"] + counts["error"]
    status = "ok" if not bad and not killed and rows else "FAILED" if bad else "incomplete"
    if not rows:
        status = "no test ran (see gpu_check.log)"
    return {"status": status, **counts}


def _tests_passed(out: Path, stages: dict) -> bool:
    return stages.get("tests", {}).get("status") == "ok"


# ----- stages 2-4, run in their own process (gpu_check_stages) --------------------------------
def _run_stage(args) -> int:
    budget = args.stage_budget or SHARES.get(args.stage, 0.0)
    result = measure.run(args.stage, smoke=args.smoke, out=args.out, budget=budget,
                        warm=args.warm)  # fmt: skip
    if result is not None:
        print(RESULT + json.dumps(result), flush=True)
    return 0


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
        f"commit {env['commit']}, source {env['source']}. Total {total:.0f} s (budget "
        f"{args.budget:.0f} s).",
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
