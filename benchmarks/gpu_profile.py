"""Where one attention call's time goes on a GPU: the host's dispatch or the kernels (issue 41).

``make gpu-check`` (H200, 2026-11-29) timed the bench's call (``kernel_attention``,
psf_random's map: degree-2 sketch, r = 32, squared; bf16, B = 1, H = 12, D = 64, forward +
backward) flat at about 4 ms with the Triton kernels and 6.5 ms with ``chunked_blocks`` from 1k
to 4k tokens, far above FlashAttention's 0.17-0.31 ms. Counted on a CPU under the CUDA probe
(``tests/cuda_probe.py``) the Triton path dispatches 132 aten ops and ``chunked_blocks`` 326,
so the 2.4 ms between them is ~12 µs an op, and the Triton path's other ~2.6 ms is either its
launches' host cost or the kernels' own time at small T. This script tells them apart, per
backend and length, in one short call:

* ``wall``: ms per call, N calls back to back, synchronized once at the end (the bench's
  figure);
* ``host``: ms per call for the host to issue those N calls, not waiting for the device (when
  ``host`` ≈ ``wall``, the call is host-bound: the device waits for launches);
* ``device``: ms per call of the kernels' own time (``torch.profiler``, CUDA activity: the sum
  of self device time of every kernel), with the number of kernel launches per call;
* ``graph``: ms per call replaying one captured call as a CUDA graph (the host's dispatch
  gone; where capture fails, the error is the row's status);
* the ops with the most device time and the most host time (``profile.md``).

Writes ``--out``: ``profile.csv`` (one row per backend and T) and ``profile.md`` (the table and
the top ops of each row); prints the table. ``--smoke`` runs the plumbing on the CPU with tiny
shapes (no device, graph or kernel columns), as ``tests/test_gpu_profile.py`` does in
``make test``.

    PYTHONPATH=src python3 benchmarks/gpu_profile.py --out $OUT/profile            # on a GPU
    PYTHONPATH=src python benchmarks/gpu_profile.py --smoke --out /tmp/profile     # CPU
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch

FIELDS = ("algorithm", "picked", "T", "status", "wall_ms", "host_ms", "device_ms",
          "launches", "graph_ms", "aten_ops")  # fmt: skip
TOP = 8
"""Ops listed per row in profile.md, by device time and by host time."""


def _call(q, k, v, fm, algorithm):
    from polysketch import kernel_attention

    return kernel_attention(q, k, v, fm, causal=True, chunk_size=256, denominator_offset=1.0,
                            algorithm=algorithm)  # fmt: skip


def _inputs(t: int, heads: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    shape = (1, heads, t, 64)
    return [torch.randn(shape, generator=g, device=device, dtype=dtype).requires_grad_()
            for _ in range(3)]  # fmt: skip


def _picked(q, k, v, fm, algorithm: str) -> str:
    """The backend ``algorithm`` resolves to for these inputs (the features' shapes)."""
    from polysketch.ops.dispatch import resolve_algorithm

    with torch.no_grad():
        phi = fm(q[..., :1, :])
    a = phi.expand(*q.shape[:-1], phi.shape[-1])
    return resolve_algorithm(algorithm, a, a, v, square=fm.square, with_state=False)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(t: int, algorithm: str, *, heads: int, device: str, dtype: torch.dtype,
            calls: int) -> tuple[dict, list[str]]:  # fmt: skip
    """One row (module docstring) and its lines for profile.md."""
    from polysketch import features

    fm = features.create("polysketch", 64, degree=2, num_features=32, nonnegative=True,
                         seed=0).to(device)  # fmt: skip
    q, k, v = _inputs(t, heads, device, dtype)
    grad = torch.randn_like(q)
    row = {"algorithm": algorithm, "T": t, "picked": _picked(q, k, v, fm, algorithm)}

    def step():
        _call(q, k, v, fm, algorithm).backward(grad)

    for _ in range(3):  # warm-up: autotuning, constants, allocator
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        step()
    issued = time.perf_counter()
    _sync(device)
    done = time.perf_counter()
    row["host_ms"] = 1e3 * (issued - start) / calls
    row["wall_ms"] = 1e3 * (done - start) / calls
    row["aten_ops"] = _count_ops(step)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            step()
        _sync(device)
    averages = prof.key_averages()
    device_us = sum(_self_device_us(e) for e in averages)
    launches = sum(e.count for e in averages if "LaunchKernel" in e.key)
    row["device_ms"] = device_us / 1e3 / calls if device == "cuda" else ""
    row["launches"] = launches / calls if device == "cuda" else ""
    row["graph_ms"], status = _graph(step, device, calls)
    row["status"] = status
    lines = [f"### {algorithm} (picked: {row['picked']}), T = {t}", ""]
    if device == "cuda":
        lines += ["By device time (µs per call):", ""]
        ranked = sorted(averages, key=_self_device_us, reverse=True)[:TOP]
        lines += [f"- {_self_device_us(e) / calls:.1f} `{e.key[:90]}` ×{e.count / calls:g}"
                  for e in ranked]  # fmt: skip
        lines.append("")
    lines += ["By host time (self CPU µs per call):", ""]
    ranked = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP]
    lines += [f"- {e.self_cpu_time_total / calls:.1f} `{e.key[:90]}` ×{e.count / calls:g}"
              for e in ranked]  # fmt: skip
    return row, lines + [""]


def _self_device_us(event) -> float:
    """A profiler average's self device time in µs (``self_device_time_total`` in torch ≥
    2.4; ``self_cuda_time_total`` before)."""
    value = getattr(event, "self_device_time_total", None)
    if value is None:
        value = getattr(event, "self_cuda_time_total", 0.0)
    return float(value or 0.0)


def _count_ops(step) -> int:
    """aten ops one call dispatches (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return Count.n


def _graph(step, device: str, calls: int) -> tuple[float | str, str]:
    """ms per call replaying one captured call (no host dispatch), and the row's status."""
    if device != "cuda":
        return "", "ok (no CUDA graph on the CPU)"
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm on the side stream, as torch.cuda.graphs asks
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            graph.replay()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start) / calls, "ok"
    except Exception as err:  # recorded: the other columns stand
        torch.cuda.synchronize()
        return "", f"graph: {type(err).__name__}: {str(err).splitlines()[0][:120]}"


def _format(rows: list[dict]) -> list[str]:
    def cell(value, digits=2):
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = ["| algorithm | picked | T | wall ms | host ms | device ms | launches | graph ms "
             "| aten ops | status |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {r['picked']} | {r['T']} | {cell(r['wall_ms'])} | "
            f"{cell(r['host_ms'])} | {cell(r['device_ms'], 3)} | {cell(r['launches'], 0)} | "
            f"{cell(r['graph_ms'], 3)} | {r['aten_ops']} | {r['status']} |"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-profile"))
    parser.add_argument("--smoke", action="store_true", help="CPU dry run with tiny shapes")
    parser.add_argument("--lengths", default="1024,8192", help="comma-separated T")
    parser.add_argument("--algorithms", default="triton,chunked_blocks,chunked",
                        help="backends to profile (chunked: the default dispatch)")  # fmt: skip
    parser.add_argument("--calls", type=int, default=20, help="calls per measurement")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be >= 1, got {args.calls}")
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if not lengths or min(lengths) < 1:
        parser.error(f"--lengths must name positive lengths, got {args.lengths!r}")
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if args.smoke:
        device, dtype, heads = "cpu", torch.float32, 2
        lengths = sorted({min(t, 64) for t in lengths})
        algorithms = [a for a in algorithms if a != "triton"] or ["chunked_blocks"]
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device (use --smoke for the CPU dry run)")
        device, dtype, heads = "cuda", torch.bfloat16, 12
    args.out.mkdir(parents=True, exist_ok=True)
    rows, notes = [], []
    for t in lengths:
        for algorithm in algorithms:
            try:
                row, lines = measure(t, algorithm, heads=heads, device=device, dtype=dtype,
                                     calls=args.calls)  # fmt: skip
            except Exception as err:  # one row lost, not the run
                row = dict.fromkeys(FIELDS, "")
                row.update(algorithm=algorithm, T=t,
                           status=f"error ({type(err).__name__}: {err})"[:200])  # fmt: skip
                lines = []
            rows.append(row)
            notes += lines
            with open(args.out / "profile.csv", "w", newline="", encoding="utf-8") as fh:
                writer = csv.DictWriter(fh, fieldnames=FIELDS)
                writer.writeheader()
                writer.writerows(rows)
    table = _format(rows)
    head = [f"# Attention call profile ({device}, {dtype}, B = 1, H = {heads}, D = 64, "
            f"forward + backward, {args.calls} calls a measurement)", ""]  # fmt: skip
    (args.out / "profile.md").write_text("\n".join(head + table + [""] + notes) + "\n",
                                         encoding="utf-8")  # fmt: skip
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
