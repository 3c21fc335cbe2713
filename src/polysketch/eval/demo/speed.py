"""Section 3 of ``polysketch demo``: causal attention time vs T against
``scaled_dot_product_attention`` and decode-step time vs position (``polysketch.eval.bench``);
on CUDA also forward + backward against FlashAttention.

The benchmark runs ``sizes.speed_passes`` times; every point is reported as the median pass
with the range [low, high] of the passes' medians (``speed_claims.aggregate``), the load
average is read before and after every pass, and the text claims only what the ranges
support (``speed_claims.claim``: faster, slower, or within the spread of SDPA at each T).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from ..._files import write_csv
from ..bench import METHODS, BenchConfig, parse_lengths, plot_results, run_benchmark
from ..bench.report import CSV_FIELDS
from ..tables import format_table
from .report import load_average
from .settings import DemoSizes
from .speed_claims import aggregate, claim, verdicts

__all__ = ["section_speed"]

SPREAD_FIELDS = (*CSV_FIELDS, "low_ms", "high_ms", "passes")


def _span(low, mid, high) -> str:
    """``mid (low–high)`` with 3 significant digits."""
    return f"{mid:.3g} ({low:.3g}–{high:.3g})"


def _tables(rows: list[dict], methods: list[str]) -> dict[str, tuple[list, list]]:
    """(headers, rows) of the forward time, decode time and decode memory tables: one row per
    length (position); per method the median, low and high ms over the passes (memory: MiB);
    None where it was not measured."""
    tables = {}
    for section, kind in (("forward", "forward"), ("train", "train"), ("decode", "decode"),
                          ("memory", "decode")):  # fmt: skip
        found = {(r["method"], r["T"]): r for r in rows if r["section"] == kind}
        if not found:
            continue
        keys = ("mem_mib",) if section == "memory" else ("median_ms", "low_ms", "high_ms")
        headers = ["T" if kind != "decode" else "position P"]
        for m in methods:
            headers += (
                [f"{m} MiB"] if section == "memory" else [f"{m} ms", f"{m} low ms", f"{m} high ms"]
            )
        body = []
        for t in sorted({t for _, t in found}):
            row = [t]
            for m in methods:
                r = found.get((m, t))
                ok = r is not None and r["status"] == "ok"
                row += [r[k] if ok else None for k in keys]
            body.append(row)
        tables[section] = (headers, body)
    return tables


def _shown(table: tuple[list, list], methods: list[str], found: dict | None = None):
    """The report's form of a time table: ``median (low–high)`` per method and, with
    ``found`` ({method: verdicts}), each method's verdict against SDPA."""
    headers, body = table
    shown_headers = [headers[0]] + [f"{m} ms (range)" for m in methods]
    others = [m for m in methods if m != "sdpa" and found and m in found]
    shown_headers += [f"{m} vs sdpa" for m in others]
    shown = []
    for row in body:
        cells = [row[0]]
        for i in range(len(methods)):
            median, low, high = row[1 + 3 * i : 4 + 3 * i]
            cells.append(None if median is None else _span(low, median, high))
        for m in others:
            v = found[m].get(row[0])
            cells.append(None if v is None else f"{v[0]} ({v[1]:.2f}×)")
        shown.append(cells)
    return shown_headers, shown


def _passes(config: BenchConfig, n: int, loads: list, label: str) -> list[dict]:
    results = []
    for i in range(n):
        loads.append(load_average())
        print(f"[speed] {label}, pass {i + 1} of {n}", flush=True)
        results.append(run_benchmark(config))
    loads.append(load_average())
    return results


def section_speed(args, sizes: DemoSizes, report, state: dict) -> dict:
    """Time attention (and on CUDA a training step) against SDPA over several passes; report
    and return the claims, the tables (median, low, high per point), the loads and the
    matmul peak."""
    out = Path(args.out)
    lengths = parse_lengths(args.lengths) if args.lengths else sizes.lengths
    cuda = torch.device(args.device).type == "cuda"
    n = sizes.speed_passes
    config = BenchConfig(
        lengths=lengths, decode_positions=lengths, min_time=sizes.min_time, min_repeats=1,
        matmul_n=sizes.matmul_n, threads=args.threads,
        seed=args.seed, progress=not args.no_progress, device=args.device,
        dtype="bf16" if cuda else "fp32",
        # CPU keeps the demo's earlier methods; CUDA adds psf_mixed
        methods=METHODS if cuda else ("sdpa", "polysketch", "positive"),
    )  # fmt: skip
    loads: list = []
    label = f"causal attention and decoding at T in {list(lengths)}"
    results = _passes(config, n, loads, label)
    raw = [dict(r, passes=i + 1) for i, res in enumerate(results) for r in res["rows"]]
    rows = aggregate([res["rows"] for res in results])
    if cuda:  # training speed (forward + backward) against FlashAttention, bf16
        train_config = replace(config, mode="train")
        label = f"forward + backward at T in {list(lengths)}"
        trained = _passes(train_config, n, loads, label)
        raw += [dict(r, passes=i + 1) for i, res in enumerate(trained) for r in res["rows"]]
        rows += aggregate([res["rows"] for res in trained])
    write_csv(rows, out / "speed.csv", columns=SPREAD_FIELDS, float_format=".6g")
    write_csv(raw, out / "speed_passes.csv", columns=SPREAD_FIELDS, float_format=".6g")
    png = plot_results(rows, out / "speed.png")
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ours = [m for m in methods if m != "sdpa"]
    tables = _tables(rows, methods)
    found = {m: verdicts(rows, m) for m in ours}
    claims = {m: claim(m, found[m]) for m in ours}
    known = [x for x in loads if x is not None]
    peak = statistics.median(res["peak_gflops"] for res in results)
    first, cfg = results[0], results[0]["config"]
    report.heading("3. Speed and memory: causal attention and decoding")
    report.paragraph(
        f"Wall time on {first['device']} with {first['threads']} thread"
        f"{'s' if first['threads'] != 1 else ''}, {cfg.dtype} inputs, "
        f"B={cfg.batch}, H={cfg.heads}, D=E={cfg.head_dim}, block b={cfg.chunk_size}; "
        f"measured matmul peak {peak:.1f} GFLOP/s. `sdpa` is "
        "torch.nn.functional.scaled_dot_product_attention (exact softmax, O(T²)); "
        f"`polysketch` is the psf_random map (r={cfg.sketch_dim}, squared) with the block "
        f"lower-triangular algorithm; `positive` is FAVOR+ with F={2 * cfg.plain_pairs}; "
        f"feature maps included. The whole benchmark ran {n} times (passes); each cell is "
        "the median pass (the lower middle one for an even count) and, in parentheses, the "
        "lowest and highest of the passes' medians."
    )
    if known:
        report.paragraph(
            f"Load: the 1-minute load average, read before and after each pass, was "
            f"{min(known):.2f}–{max(known):.2f} on {os.cpu_count()} CPUs (this benchmark's "
            f"own {first['threads']} threads count in it); above the CPU count, processes "
            "waited for a core and the timings are slower and noisier than on an idle machine."
        )
    report.paragraph(
        "Against SDPA, at each T: `faster` when the method's highest pass is below SDPA's "
        "lowest, `slower` when its lowest is above SDPA's highest, `tie` when the ranges "
        "overlap (no difference claimed); the ratio is of the medians. "
        + "; ".join(claims.values())
        + "."
    )
    report.heading("Causal forward time", level=3)
    report.table(*_shown(tables["forward"], methods, found))
    decode = {m: verdicts(rows, m, section="decode") for m in ours}
    report.heading("Decode step time (one new token at position P)", level=3)
    report.paragraph(
        "Against SDPA attending a KV cache of P keys (T = P here): "
        + "; ".join(claim(m, decode[m]) for m in ours)
        + "."
    )
    report.table(*_shown(tables["decode"], methods, decode))
    report.heading("Decoding memory per sequence: KV cache vs constant state (MiB)", level=3)
    report.table(*tables["memory"])
    if "train" in tables:
        report.heading("Training step: forward + backward time (bf16)", level=3)
        report.paragraph(
            "`sdpa` is FlashAttention here (bf16 inputs on CUDA); our attentions run the "
            "`chunked` dispatch (fused Triton kernels when available, else the all-blocks "
            "layout) with the recomputing backward. Peak memory per call: `speed.csv`. "
            + "; ".join(claim(m, verdicts(rows, m, section="train")) for m in ours)
            + "."
        )
        report.table(
            *_shown(tables["train"], methods, {m: verdicts(rows, m, section="train") for m in ours})
        )
    report.image(
        png.name, "median time vs sequence length (left) and decode step time vs position (right)"
    )
    report.paragraph(
        "Full measurements (GFLOP/s, memory estimates, range): `speed.csv`; every pass: "
        "`speed_passes.csv`."
    )
    print(format_table(*_shown(tables["forward"], methods, found)), flush=True)
    print("\n".join(claims.values()), flush=True)
    return {
        "claims": claims,
        "verdicts": {m: {str(t): v for t, v in f.items()} for m, f in found.items()},
        "tables": tables,
        "peak_gflops": peak,
        "passes": n,
        "load_average": loads,
    }
