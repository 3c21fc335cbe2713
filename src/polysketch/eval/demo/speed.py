"""Section 3 of ``polysketch demo``: causal attention time vs T against
``scaled_dot_product_attention``, the crossover length and decode-step time vs position
(``polysketch.eval.bench``); on CUDA also forward + backward against FlashAttention.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..bench import (
    METHODS,
    BenchConfig,
    format_report,
    parse_lengths,
    plot_results,
    run_benchmark,
    write_csv,
)
from .settings import DemoSizes

__all__ = ["section_speed"]


def _tables(rows: list[dict], methods: list[str]) -> dict[str, tuple[list, list]]:
    """(headers, rows) of the forward time, decode time and decode memory tables: one row per
    length (position), one column per method, None where it was not measured."""
    tables = {}
    for section, key, unit in (
        ("forward", "median_ms", "ms"),
        ("decode", "median_ms", "ms"),
        ("memory", "mem_mib", "MiB"),
    ):
        kind = "forward" if section == "forward" else "decode"
        found = {(r["method"], r["T"]): r for r in rows if r["section"] == kind}
        body = []
        for t in sorted({t for _, t in found}):
            cells = [found.get((m, t)) for m in methods]
            body.append([t] + [r[key] if r and r["status"] == "ok" else None for r in cells])
        first = "T" if section == "forward" else "position P"
        tables[section] = ([first] + [f"{m} {unit}" for m in methods], body)
    return tables


def section_speed(args, sizes: DemoSizes, report, state: dict) -> dict:
    """Time attention (and on CUDA a training step) against SDPA; report and return the
    summary, the tables and the matmul peak."""
    out = Path(args.out)
    lengths = parse_lengths(args.lengths) if args.lengths else sizes.lengths
    cuda = torch.device(args.device).type == "cuda"
    config = BenchConfig(
        lengths=lengths, decode_positions=lengths, min_time=sizes.min_time, min_repeats=1,
        matmul_n=sizes.matmul_n, threads=args.threads,
        seed=args.seed, progress=not args.no_progress, device=args.device,
        dtype="bf16" if cuda else "fp32",
        # CPU keeps the demo's earlier methods and time budget; CUDA adds psf_mixed
        methods=METHODS if cuda else ("sdpa", "polysketch", "positive"),
    )  # fmt: skip
    print(f"[speed] causal attention and decoding at T in {list(lengths)}", flush=True)
    result = run_benchmark(config)
    training = None
    if cuda:  # training speed (forward + backward) against FlashAttention, bf16
        print(f"[speed] forward + backward at T in {list(lengths)}", flush=True)
        training = run_benchmark(replace(config, mode="train"))
        write_csv(training["rows"], out / "speed_train.csv")
    write_csv(result["rows"], out / "speed.csv")
    png = plot_results(result["rows"], out / "speed.png")
    rows = result["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    tables = _tables(rows, methods)
    cfg = result["config"]
    report.heading("3. Speed and memory: causal attention and decoding")
    report.paragraph(
        f"Median wall time on {result['device']} with {result['threads']} threads, "
        f"{cfg.dtype} inputs, "
        f"B={cfg.batch}, H={cfg.heads}, D=E={cfg.head_dim}, block b={cfg.chunk_size}; "
        f"measured matmul peak {result['peak_gflops']:.1f} GFLOP/s. `sdpa` is "
        "torch.nn.functional.scaled_dot_product_attention (exact softmax, O(T²)); "
        f"`polysketch` is the psf_random map (r={cfg.sketch_dim}, squared) with the block "
        f"lower-triangular algorithm; `positive` is FAVOR+ with F={2 * cfg.plain_pairs}; "
        "feature maps included."
    )
    lines = []
    for name, s in result["summary"].items():
        cross = s["crossover"]
        lines.append(
            f"`{name}`: "
            + (f"faster than SDPA from T = {cross} on" if cross is not None
               else f"not faster than SDPA up to T = {max(lengths)} on this machine")
            + (f"; decode step time varies by ×{s['decode_max_over_min']:.2f} across positions"
               if s["decode_max_over_min"] is not None else "")
        )  # fmt: skip
    report.paragraph("Crossover: " + "; ".join(lines) + ".")
    report.heading("Causal forward time", level=3)
    report.table(*tables["forward"])
    report.heading("Decode step time (one new token at position P)", level=3)
    report.table(*tables["decode"])
    report.heading("Decoding memory per sequence: KV cache vs constant state (MiB)", level=3)
    report.table(*tables["memory"])
    if training is not None:
        trows = training["rows"]
        found = {(r["method"], r["T"]): r for r in trows}
        body = [
            [t] + [found[(m, t)]["median_ms"] if found.get((m, t), {}).get("status") == "ok"
                   else None for m in methods]
            for t in sorted({t for _, t in found})
        ]  # fmt: skip
        report.heading("Training step: forward + backward time (bf16)", level=3)
        report.paragraph(
            "`sdpa` is FlashAttention here (bf16 inputs on CUDA); our attentions run the "
            "`chunked` dispatch (fused Triton kernels when available, else the all-blocks "
            "layout) with the recomputing backward. Peak memory per call: `speed_train.csv`."
        )
        report.table(["T"] + [f"{m} ms" for m in methods], body)
        tables["train"] = (["T"] + [f"{m} ms" for m in methods], body)
        print(format_report(training), flush=True)
    report.image(png.name, "time vs sequence length (left) and decode step time vs position")
    report.paragraph("Full measurements (GFLOP/s, memory estimates): `speed.csv`.")
    print(format_report(result), flush=True)
    return {"summary": result["summary"], "tables": tables, "peak_gflops": result["peak_gflops"]}
