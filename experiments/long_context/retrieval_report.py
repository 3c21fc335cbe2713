"""The retrieval table's markdown and plot, from ``retrieval_table.summarize`` rows."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from polysketch.eval.plots import log_axes, subplots

from .report import fmt, markdown_table
from .retrieval_table import WEIGHT_COLUMNS

__all__ = ["ISSUE_NUMBERS", "retrieval_markdown", "plot_retrieval", "reproduction_lines"]

ISSUE_NUMBERS = {
    "psf_random": (0.25, 0.16, 0.023, 0.008, 0.001),
    "polynomial": (0.95, 0.87, 0.57, 0.25, 0.08),
    "softmax": (0.96, 0.89, 0.64, 0.31, 0.10),
}
"""Issue 21's exact-match weights on LayerNorm'd Gaussians (D = 64) at t = 64, 256, 1k, 4k,
16k: the check that this harness measures the same thing."""

_QUERY_NAMES = {"w_match": "query = key", "w_cos0.9": "cosine 0.9", "w_cos0.7": "cosine 0.7"}


def _state(row: dict) -> str:
    if row.get("state_dim", "") == "":
        return "KV cache (t)"
    what = f"{fmt(row['state_dim'])}"
    if int(row.get("square") or 0):
        what += f" (pairs of F = {fmt(row['feature_dim'])})"
    return what


def _bound_rank(row: dict) -> str:
    if row.get("rank_bound", "") == "":
        return "none (full rank)"
    if row.get("bound", "") == "":
        return f"{fmt(row['rank_bound'])} (signed scores: no bound)"
    pairs = " pairs" if int(row.get("square") or 0) else ""
    return f"{fmt(row['rank_bound'])}{pairs}"


def retrieval_markdown(summary: Sequence[dict], *, inputs_note: dict | None = None) -> str:
    """Per input: a table of the sizes (F′, decode state) and, per query kind, the mean
    weight on the matching key (± std over draws) at each t; the exact-match table adds the
    bound min(1, F′/t) in brackets where it applies."""
    out = []
    for source in dict.fromkeys(r["input"] for r in summary):
        rows = [r for r in summary if r["input"] == source]
        contexts = sorted({int(r["t"]) for r in rows})
        names = list(dict.fromkeys(r["attention"] for r in rows))
        first = {n: next(r for r in rows if r["attention"] == n) for n in names}
        note = (inputs_note or {}).get(source, "")
        out.append(f"### Input: {source}" + (f" — {note}" if note else ""))
        out.append("")
        out.append(
            markdown_table(
                (
                    "attention",
                    "state features per head (per value dim)",
                    "F′ (rank bound)",
                    "normalizer offset",
                ),
                [
                    (f"`{n}`", _state(first[n]), _bound_rank(first[n]), fmt(first[n]["offset"]))
                    for n in names
                ],
            )  # fmt: skip
        )
        for col, title in _QUERY_NAMES.items():
            if not any(col in r for r in rows):
                continue
            table = []
            for n in names:
                cells = [f"`{n}`"]
                for t in contexts:
                    r = next((r for r in rows if r["attention"] == n and r["t"] == t), None)
                    if r is None or col not in r:
                        cells.append("-")
                        continue
                    cell = f"{r[col]:.3g} ± {r[col + '_std']:.1g}"
                    if col == "w_match" and r.get("bound", "") != "" and r["bound"] < 1:
                        cell += f" [≤ {r['bound']:.2g}]"
                    cells.append(cell)
                table.append(cells)
            out += ["", f"Weight on the matching key, {title}:", ""]
            out.append(markdown_table(["attention"] + [f"t = {fmt(t)}" for t in contexts], table))
        out.append("")
    return "\n".join(out)


def reproduction_lines(summary: Sequence[dict]) -> list[str]:
    """Our exact-match weights on Gaussian inputs beside the issue's, where both exist."""
    lines = []
    contexts = (64, 256, 1024, 4096, 16384)
    for name, theirs in ISSUE_NUMBERS.items():
        ours = []
        for t in contexts:
            r = next(
                (r for r in summary
                 if r["input"] == "gaussian" and r["attention"] == name and r["t"] == t),
                None,
            )  # fmt: skip
            ours.append("-" if r is None else f"{r['w_match']:.3g}")
        if any(x != "-" for x in ours):
            lines.append(
                f"{name}: ours {' / '.join(ours)}; issue "
                f"{' / '.join(f'{x:g}' for x in theirs)} (t = 64 … 16k)"
            )
    return lines


def plot_retrieval(summary: Sequence[dict], path, *, title: str = "") -> object:
    """Weight vs t (log-log), one panel per (input, query kind), one line per attention (one
    colour and marker each, legend below); the exact-match panels draw each non-negative
    map's bound min(1, F′/t) dotted in its colour where it is below 1."""
    from polysketch.eval.plots import pyplot

    sources = list(dict.fromkeys(r["input"] for r in summary))
    cols = [c for c in WEIGHT_COLUMNS.values() if any(c in r for r in summary)]
    names = list(dict.fromkeys(r["attention"] for r in summary))
    cmap = pyplot().get_cmap("tab20")
    style = {n: (cmap(i % 20), "os^vD<>ph*X"[i % 11]) for i, n in enumerate(names)}
    fig, axes = subplots(len(sources) * len(cols), ncols=len(cols), panel_size=(5.0, 3.8))
    for i, source in enumerate(sources):
        rows = [r for r in summary if r["input"] == source]
        for j, col in enumerate(cols):
            ax = axes[i * len(cols) + j]
            for n in names:
                pts = sorted(
                    (int(r["t"]), float(r[col]), r.get("bound", ""))
                    for r in rows
                    if r["attention"] == n and col in r and float(r[col]) > 0
                )
                if not pts:
                    continue
                color, marker = style[n]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, ms=3,
                        color=color, label=n)  # fmt: skip
                bounds = [(p[0], float(p[2])) for p in pts if p[2] != "" and float(p[2]) < 1]
                if col == "w_match" and bounds:
                    ax.plot(*zip(*bounds, strict=True), ls=":", color=color, lw=1)
            log_axes(ax)
            ax.set_xlabel("keys t")
            ax.set_ylabel("weight on the matching key")
            ax.set_title(f"{source}: {_QUERY_NAMES[col]}", fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    bottom = 0.03 + 0.025 * ((len(labels) + 3) // 4) * 2 / len(sources)
    fig.tight_layout(rect=(0, bottom, 1, 0.97))  # room for the legend below the panels
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)
    pyplot().close(fig)
    return path
