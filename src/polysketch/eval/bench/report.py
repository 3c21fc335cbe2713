"""Output of ``polysketch bench``: CSV rows, the time-vs-T plot and the text report."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..._files import write_csv as _write_csv
from ..plots import log_axes, save_png, subplots

__all__ = ["CSV_FIELDS", "write_csv", "plot_results", "format_report", "times_of"]

CSV_FIELDS = (
    "section", "method", "T", "status", "median_ms", "min_ms", "repeats", "speedup_vs_sdpa",
    "gflop", "gflops_per_s", "pct_of_peak", "mem_mib", "mem_kind", "feature_dim", "state_dim",
)  # fmt: skip


def times_of(rows, section, method) -> dict[int, float]:
    """{T: median ms} of the ok rows of one section and method."""
    return {
        r["T"]: r["median_ms"]
        for r in rows
        if r["section"] == section and r["method"] == method and r["status"] == "ok"
    }


def write_csv(rows: Sequence[dict], path) -> Path:
    """Write the result rows to ``path`` (``CSV_FIELDS``, floats as ``.6g``; atomically,
    parents created)."""
    return _write_csv(rows, path, columns=CSV_FIELDS, float_format=".6g")


def plot_results(rows: Sequence[dict], path) -> Path:
    """Log-log time vs T (forward) and time vs position (decode), one line per method."""
    sections = [x for x in ("forward", "train", "decode") if any(r["section"] == x for r in rows)]
    labels = {"decode": "decode position P"}
    fig, axes = subplots(max(1, len(sections)), ncols=max(1, len(sections)))
    for ax, section in zip(axes, sections, strict=False):
        xlabel = labels.get(section, "sequence length T")
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted(times_of(rows, section, method).items())
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", ms=4, label=method)
        log_axes(ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("median time (ms)")
        titles = {"forward": "causal forward", "train": "causal forward + backward"}
        ax.set_title(titles.get(section, "decode step"))
        ax.legend(fontsize=8)
    return save_png(fig, path)


_COLUMNS = {
    "median_ms": "10.3f",
    "min_ms": "10.3f",
    "speedup_vs_sdpa": "7.2f",
    "gflops_per_s": "8.1f",
    "pct_of_peak": "6.1f",
    "mem_mib": "9.1f",
}


def _fmt(value, spec: str) -> str:
    return format(value, spec) if value != "" else ""


def format_report(result: dict) -> str:
    """Human-readable tables and the summary of ``run_benchmark``'s result."""
    cfg = result["config"]
    width = max([11, *(len(str(r["method"])) for r in result["rows"])])
    lines = [
        f"device {result['device']}, torch.set_num_threads({result['threads']}), "
        f"mode {getattr(cfg, 'mode', 'fwd')} "
        f"({'forward + backward' if getattr(cfg, 'mode', 'fwd') == 'train' else 'forward'}), "
        f"{getattr(cfg, 'dtype', 'fp32')} inputs (q, k LayerNorm'd), "
        f"B={cfg.batch} H={cfg.heads} D=E={cfg.head_dim}, chunk b={cfg.chunk_size}",
        f"measured matmul peak: {result['peak_gflops']:.1f} GFLOP/s ({cfg.matmul_n}² fp32)",
        "C allocator: "
        + (
            f"glibc mallopt(M_TOP_PAD, {result['malloc_top_pad']}) (freed memory kept for reuse)"
            if result.get("malloc_top_pad")
            else "as found (no mallopt)"
        ),
        "",
        f"{'section':<8} {'method':<{width}} {'T':>6} {'median ms':>10} {'min ms':>10} "
        f"{'x SDPA':>7} "
        f"{'GFLOP/s':>8} "
        f"{'%peak':>6} {'MiB':>9} {'(mem)':<8} status",
    ]
    for r in result["rows"]:
        c = {k: _fmt(r[k], spec) for k, spec in _COLUMNS.items()}
        lines.append(
            f"{r['section']:<8} {r['method']:<{width}} {r['T']:>6} {c['median_ms']:>10} "
            f"{c['min_ms']:>10} {c['speedup_vs_sdpa']:>7} {c['gflops_per_s']:>8} "
            f"{c['pct_of_peak']:>6} {c['mem_mib']:>9} {r['mem_kind']:<8} {r['status']}"
        )
    lines.append("")
    for name, s in result["summary"].items():
        cross = s["crossover"]
        lines.append(
            f"{name}: crossover (first T where it beats SDPA) = "
            f"{cross if cross is not None else 'none measured'}"
            + ("" if cross is None else f" (stays faster after: {s['faster_from_crossover_on']})")
        )
        if s["growth_exponent"] is not None:
            lines.append(f"  time ~ T^{s['growth_exponent']:.2f} for T >= 4096 (1 = linear)")
        if s["decode_max_over_min"] is not None:
            lines.append(
                f"  decode step time max/min over positions = {s['decode_max_over_min']:.2f}"
            )
    return "\n".join(lines)
