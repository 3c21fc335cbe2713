"""Time the Triton kernels' two layouts side by side: the sequential pass and the split layout.

For each shape (batch B, heads H, length T, F, E, square, dtype) it runs
``triton_lt_multiply_with_sums`` with ``layout="sequential"`` and ``layout="split"`` (segment
length from ``_config.segment_length`` unless ``--segment``), checks that both give the same
outputs and gradients (relative error), and times the forward and forward + backward with CUDA
events (median of ``--repeats`` after warm-up, which includes the autotuning). It also says
which layout ``"auto"`` picks. One command on a CUDA machine:

    PYTHONPATH=src python benchmarks/triton_layouts.py [--out layouts.csv]

Neither layout has been timed yet (the kernels have not run on a GPU). ``--smoke`` runs two
tiny shapes under Triton's CPU interpreter (no timing meaning; checks the script runs).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

DEFAULT_SHAPES = [  # (B, H, T, F, E, square, dtype)
    (1, 12, 8192, 32, 64, True, "bf16"),
    (1, 12, 32768, 32, 64, True, "bf16"),
    (1, 12, 8192, 64, 64, True, "bf16"),
    (4, 12, 8192, 32, 64, True, "bf16"),
    (1, 12, 32768, 64, 128, False, "bf16"),
    (1, 8, 16384, 16, 64, True, "fp16"),
    (1, 12, 8192, 32, 64, True, "fp32"),
    (8, 16, 4096, 32, 64, True, "bf16"),  # enough heads: "auto" stays sequential
]
SMOKE_SHAPES = [(1, 2, 100, 16, 32, True, "fp32"), (1, 2, 100, 16, 32, False, "fp32")]
FIELDS = [
    "B", "H", "T", "F", "E", "square", "dtype", "segment", "auto", "layout",
    "fwd_ms", "fwd_bwd_ms", "rel_err_vs_sequential",
]  # fmt: skip


def _time(fn, repeats: int, cuda: bool) -> float:
    """Median milliseconds of ``fn()`` (after one warm-up call)."""
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def run_shape(shape, *, segment, repeats, device):
    import torch

    from polysketch.ops.dispatch import multiprocessor_count
    from polysketch.ops.triton import triton_lt_multiply_with_sums
    from polysketch.ops.triton._config import block_e, block_t, slice_groups
    from polysketch.ops.triton._layout import choose_segment

    bsz, heads, t, f, e, square, dtype = shape
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b, c = (torch.randn(bsz, heads, t, x, generator=g) for x in (f, f, e))
    a, b = (x * (f**-0.5 * 2 if square else f**-0.5) for x in (a, b))
    a, b, c = (x.to(device=device, dtype=dt).requires_grad_() for x in (a, b, c))
    wn = torch.randn(bsz, heads, t, e, generator=g).to(device)
    bh, size = bsz * heads, a.element_size()
    sms = multiprocessor_count(a.device)  # what the dispatcher passes the kernels
    ns = slice_groups(bh, t, f, e, sms, square=square, element_size=size)
    be = block_e(f, e, square=square, element_size=size)
    bt = block_t(64, t, f, size)
    auto = choose_segment(
        "auto", bh=bh, t=t, f=f, e=e, bt=bt, grid=bh * -(-e // be) * ns, square=square,
        sms=sms, requested=segment,
    )  # fmt: skip
    rows, outputs = [], {}
    for layout in ("sequential", "split"):
        kw = dict(square=square, layout=layout, segment_length=segment, sms=sms)

        def fwd(kw=kw):
            with torch.no_grad():
                return triton_lt_multiply_with_sums(a, b, c, **kw)

        def fwd_bwd(kw=kw):
            num, rs = triton_lt_multiply_with_sums(a, b, c, **kw)
            grads = torch.autograd.grad((num * wn).sum() + rs.sum(), (a, b, c))
            return num, rs, *grads

        outputs[layout] = [x.detach().double() for x in fwd_bwd()]
        cuda = device == "cuda"
        rows.append(dict(layout=layout, fwd_ms=_time(fwd, repeats, cuda)))
        rows[-1]["fwd_bwd_ms"] = _time(fwd_bwd, repeats, cuda)
    err = max(
        float((x - y).norm() / y.norm().clamp_min(1e-300))
        for x, y in zip(outputs["split"], outputs["sequential"], strict=True)
    )
    seg = choose_segment(
        "split", bh=bh, t=t, f=f, e=e, bt=bt, grid=0, square=square, sms=sms,
        requested=segment,
    )  # fmt: skip
    common = dict(B=bsz, H=heads, T=t, F=f, E=e, square=square, dtype=dtype, segment=seg)
    common["auto"] = "split" if auto else "sequential"
    for row in rows:
        row.update(common, rel_err_vs_sequential=0.0 if row["layout"] == "sequential" else err)
    return rows


def _cell(key: str, value) -> str:
    if key == "rel_err_vs_sequential":
        return f"{value:.1e}"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--segment", type=int, help="segment length L (default: _config's choice)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes under the CPU interpreter")
    p.add_argument("--out", help="CSV file for the rows")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton defines the kernels
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        print("no CUDA device: nothing to time (--smoke runs the script under the interpreter)")
        return 2
    shapes = SMOKE_SHAPES if args.smoke else DEFAULT_SHAPES
    segment = args.segment if args.segment or not args.smoke else 32
    repeats = 1 if args.smoke else args.repeats
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter)"
    print(f"# {name}; torch {torch.__version__}; median of {repeats} after warm-up")
    print(" ".join(f"{k:>9}" for k in FIELDS))
    all_rows = []
    for shape in shapes:
        for row in run_shape(shape, segment=segment, repeats=repeats, device=device):
            all_rows.append(row)
            cells = [_cell(k, row[k]) for k in FIELDS]
            print(" ".join(f"{x:>9}" for x in cells), flush=True)
    if args.out:
        with open(args.out, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(all_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
