"""Compile every Triton kernel of ``polysketch.ops.triton`` for sm_90 (H100) without a GPU.

For each kernel (forward, the two backward passes, decode) and mode (the sequential pass, the
split layout's phase 1 and phase 3), each supported configuration class (square F in
(16, 32, 64), plain F up to 256, E in (32, 64, 128) (the E values with the same tile width BE
share one compile: E is then only a stride), fp32/bf16/fp16 inputs)
with the block sizes ``_config`` chooses (BT for the default chunk_size 64, BE, slice groups
NS = 1 and the largest NS on a GPU with few heads), and each launch configuration of the
autotuner (num_warps, num_stages), it runs ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))`` (ptx and cubin: the real ptxas) and prints one row:
kernel, mode, configuration, shared memory bytes (``metadata.shared``), registers per thread
and spill stores/loads (the ``ptxas -v`` log of that compile), OK or FAIL with the error.

Works with the triton versions this project meets (3.6 on the GPU machine, 3.9 here): both
take ``ASTSource(fn, signature, constexprs, attrs)`` with the constexprs named in the
signature as ``"constexpr"`` and pointer alignment as ``[["tt.divisibility", 16]]``.

    PYTHONPATH=src python benchmarks/triton_compile_check.py [--quick] [--jobs 2] [--out FILE]

``--quick``: one launch configuration (4 warps, 2 stages) and NS = 1 only. No GPU is
needed (nothing is launched); TRITON_INTERPRET must be unset (it is removed here). Exit
status 1 when any compile failed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret (read at kernel definition)
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # run ptxas every time: its -v log gives regs/spills
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # printed to stdout by triton's nvidia backend
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without warning

DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}
INPUT_POINTERS = {"A", "B", "C", "Q", "K", "V"}  # in the input dtype; other pointers fp32
INT_ARGS = {"T", "L", "NSEG", "NSLOT"}  # runtime integers (i32)
QUICK_LAUNCH = (4, 2)
FILTERS = ("kernel", "mode", "dtype")
MAX_NS = 8  # _config.MAX_SLICE_GROUPS


@dataclass(frozen=True)
class Job:
    kernel: str  # module:attribute
    mode: str
    dtype: str
    constexprs: tuple  # ((name, value), ...)
    num_warps: int
    num_stages: int
    also: tuple = ()  # other E values with the same BE (the same code up to a stride)


def _jit_fn(obj):
    """The JITFunction under ``triton.autotune`` (``_config.tuned``) wrappers."""
    import triton

    while not isinstance(obj, triton.runtime.JITFunction):
        obj = obj.fn
    return obj


def _launch_configs(obj, quick: bool):
    """(num_warps, num_stages) of the autotune configs of a wrapped kernel, or of its fixed
    launch (decode: 4 warps)."""
    configs = getattr(obj, "configs", None)
    if not configs:
        return [(4, 3)]  # a plain launch: num_warps=4 (decode), triton's default num_stages=3
    if quick:
        return [QUICK_LAUNCH]
    return [(c.num_warps, c.num_stages) for c in configs]


SEQUENTIAL = {"sequential": dict(INIT=False, STATE_ONLY=False)}
PHASE1 = {"phase1": dict(INIT=False, STATE_ONLY=True)}  # split layout: segment states
PHASE3 = {"phase3": dict(INIT=True, STATE_ONLY=False)}  # split layout: pass from the prefix


def _kernel_table():
    """(label, module:attribute, modes) for every kernel; a mode adds constexprs (the
    sequential pass and the split layout's phases, ``polysketch.ops.triton._layout``)."""
    return [
        ("forward", "_forward:_forward_kernel", {**SEQUENTIAL, **PHASE1, **PHASE3}),
        ("bwd_a", "_backward:_bwd_a_kernel", {**SEQUENTIAL, **PHASE3}),
        ("bwd_bc", "_backward:_bwd_bc_kernel", {**SEQUENTIAL, **PHASE1, **PHASE3}),
        ("decode", "_decode:_decode_kernel", {"": {}}),
    ]


def _resolve(ref: str):
    import importlib

    module, attr = ref.split(":")
    return getattr(importlib.import_module(f"polysketch.ops.triton.{module}"), attr)


def jobs(quick: bool) -> list[Job]:
    """Every (kernel, mode, dtype, F, E class, launch config) to compile, with _config's
    blocks. E enters the code only as the row stride of C (and the state) once BE is fixed,
    so the E values with the same BE share one compile (``Job.also``: the others)."""
    from polysketch.ops.triton._config import block_e, block_t
    from polysketch.ops.triton._validate import (
        PLAIN_FEATURE_DIMS,
        SQUARE_FEATURE_DIMS,
        VALUE_DIMS,
    )

    out = []
    for label, ref, modes in _kernel_table():
        launches = _launch_configs(_resolve(ref), quick)
        for dtype, square in itertools.product(DTYPES, (True, False)):
            es = DTYPES[dtype]
            dims = SQUARE_FEATURE_DIMS if square else PLAIN_FEATURE_DIMS
            for f in dims:
                classes = {}  # BE -> the E values of that tile width
                for e in VALUE_DIMS:
                    be = (
                        min(e, 64)
                        if label == "decode"
                        else block_e(f, e, square=square, element_size=es)
                    )
                    classes.setdefault(be, []).append(e)
                for be, es_ in classes.items():
                    e, also = es_[0], tuple(es_[1:])
                    if label == "decode":
                        cons = [dict(F=f, E=e, BE=be, SQUARE=square, W=f // 2 + 1)]
                    else:
                        bt = block_t(64, 1 << 20, f, es)
                        prec = "ieee" if dtype == "fp32" else "tf32"
                        base = dict(F=f, E=e, BT=bt, BE=be, SQUARE=square, PRECISION=prec)
                        groups = [1] if (quick or not square) else [1, min(MAX_NS, f)]
                        cons = [{**base, "NS": ns} for ns in groups]
                    for c, (mode, extra), (w, st) in itertools.product(
                        cons, modes.items(), launches
                    ):
                        items = tuple({**c, **extra}.items())
                        out.append(Job(label, mode, dtype, items, w, st, also))
    return out


def _signature(fn, dtype: str, constexprs: dict):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INT_ARGS:
            sig[name] = "i32"
        else:
            sig[name] = f"*{dtype}" if name in INPUT_POINTERS else "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
    return sig, attrs


PTXAS_REGS = re.compile(r"Used (\d+) registers")
PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_one(job: Job) -> dict:
    """Compile one job; a dict of the table's columns (never raises)."""
    import triton
    from triton.backends.compiler import GPUTarget

    refs = {label: ref for label, ref, _ in _kernel_table()}
    fn = _jit_fn(_resolve(refs[job.kernel]))
    cons = dict(job.constexprs)
    row = {"job": job, "shared": "", "regs": "", "spill": "", "status": "OK", "seconds": 0.0}
    log = io.StringIO()
    start = time.perf_counter()
    try:
        sig, attrs = _signature(fn, job.dtype, cons)
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=cons, attrs=attrs)
        options = {"num_warps": job.num_warps, "num_stages": job.num_stages}
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        row["shared"] = kernel.metadata.shared
        text = log.getvalue()
        regs, spills = PTXAS_REGS.findall(text), PTXAS_SPILL.findall(text)
        row["regs"] = regs[-1] if regs else "?"
        row["spill"] = "/".join(spills[-1]) if spills else "?"
    except Exception as err:  # noqa: BLE001 - reported in the table
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        row["status"] = f"FAIL {type(err).__name__}: {first[:200]}"
    row["seconds"] = time.perf_counter() - start
    return row


def _config_text(job: Job) -> str:
    c = dict(job.constexprs)
    keys = [k for k in ("F", "E", "BT", "BE", "NS") if k in c]
    kind = "sq" if c["SQUARE"] else "pl"
    text = " ".join(f"{k}={c[k]}" for k in keys)
    if job.also:
        text = text.replace(f"E={c['E']}", "E=" + ",".join(map(str, (c["E"], *job.also))), 1)
    return f"{kind} {job.dtype} {text}"


def format_row(row: dict) -> str:
    job = row["job"]
    return (
        f"{job.kernel:<8} {job.mode or '-':<10} {_config_text(job):<42} "
        f"w={job.num_warps} s={job.num_stages}  {row['shared']!s:>7} {row['regs']!s:>5} "
        f"{row['spill']!s:>11}  {row['status']}"
    )


HEADER = (
    f"{'kernel':<8} {'mode':<10} {'configuration':<42} {'launch':<9}  {'shared':>7} "
    f"{'regs':>5} {'spill st/ld':>11}  status"
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 warps, 2 stages, NS = 1 only")
    p.add_argument("--jobs", type=int, default=2, help="compiles in parallel (processes)")
    p.add_argument("--kernel", action="append", help="only these kernels (repeatable)")
    p.add_argument("--mode", action="append", help="only these modes (repeatable)")
    p.add_argument("--dtype", action="append", choices=list(DTYPES), help="only these dtypes")
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args(argv)

    import torch
    import triton

    todo = [
        j
        for j in jobs(args.quick)
        if (not args.kernel or j.kernel in args.kernel)
        and (not args.mode or j.mode in args.mode)
        and (not args.dtype or j.dtype in args.dtype)
    ]
    lines = [
        f"# triton {triton.__version__}, torch {torch.__version__}, target cuda sm_90 (warp 32); "
        f"{len(todo)} compiles{' (--quick)' if args.quick else ''}"
        + "".join(f"; {k} {v}" for k, v in vars(args).items() if k in FILTERS and v),
        "# shared: metadata.shared (bytes); regs, spill st/ld: ptxas -v (per thread, bytes)",
        HEADER,
    ]
    print("\n".join(lines), flush=True)
    start = time.perf_counter()
    rows = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for row in pool.map(compile_one, todo):
            rows.append(row)
            lines.append(format_row(row))
            print(lines[-1], flush=True)
    failed = [r for r in rows if r["status"] != "OK"]
    spilling = [r for r in rows if r["spill"] not in ("", "?", "0/0")]
    shared = [r["shared"] for r in rows if isinstance(r["shared"], int)]
    regs = [int(r["regs"]) for r in rows if str(r["regs"]).isdigit()]
    summary = [
        f"# {len(rows) - len(failed)} OK, {len(failed)} FAIL; {len(spilling)} with spills; "
        f"shared {min(shared, default=0)}-{max(shared, default=0)} bytes; "
        f"regs {min(regs, default=0)}-{max(regs, default=0)}; "
        f"{time.perf_counter() - start:.0f} s",
    ]
    if spilling:
        worst = max(spilling, key=lambda r: int(r["spill"].split("/")[0]))
        summary.append(f"# most spilled: {format_row(worst)}")
    lines += summary
    print("\n".join(summary))
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
