"""The figures of the demo report: loss curves (quality) and fidelity panels (fidelity)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from ..plots import log_axes, pyplot, save_png, subplots

__all__ = ["plot_loss_curves", "plot_fidelity_panels"]


def plot_loss_curves(runs: dict[str, dict], path, *, smooth: int = 20) -> Path:
    """Training loss (moving average over ``smooth`` steps) and validation loss vs step.

    ``runs``: label -> history of ``polysketch.train.train`` (``"train"``/``"val"`` rows with
    ``step`` and ``loss``). One colour per run; solid = train, dashed with dots = validation.
    """
    fig, (ax,) = subplots(1, panel_size=(7.0, 4.2))
    colors = pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, history) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        steps = [r["step"] for r in history["train"]]
        losses = [r["loss"] for r in history["train"]]
        w = max(1, min(int(smooth), len(losses)))
        avg = [
            sum(losses[max(0, j - w + 1) : j + 1]) / (j + 1 - max(0, j - w + 1))
            for j in range(len(losses))
        ]
        ax.plot(steps, avg, color=color, lw=1.4, label=f"{label} train (avg of {w})")
        val = history.get("val", [])
        if val:
            ax.plot(
                [r["step"] for r in val], [r["loss"] for r in val], "o--", color=color, ms=4,
                label=f"{label} validation",
            )  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_png(fig, path)


def plot_fidelity_panels(
    panels: dict[str, tuple[list[dict], list[tuple[int, float]]]],
    path,
    *,
    footnote: str = "",
    marks: dict[str, int] | None = None,
) -> Path:
    """Relative Frobenius error vs state dim, one panel per data source, one line per map.

    ``panels``: title -> (rows of ``polysketch.eval.fidelity.evaluate_map``/``sweep``,
    [(rank, optimal relative error)] of the Eckart–Young bound, drawn dashed black).
    ``footnote``: text printed under the panels (what a reader must know to read them).
    ``marks``: map -> state dim of a point to ring (e.g. the size a trained model uses).
    """
    marks = marks or {}
    lines = textwrap.wrap(footnote, width=140) if footnote else []
    plt = pyplot()
    rows = math.ceil(len(panels) / 2)
    note_height = 0.16 * len(lines) + 0.2 if lines else 0.0
    fig = plt.figure(figsize=(9.0, 3.5 * rows + note_height))
    grid = fig.add_gridspec(rows + bool(lines), 2, height_ratios=[3.5] * rows + (
        [note_height] if lines else []))  # fmt: skip
    axes = [fig.add_subplot(grid[i // 2, i % 2]) for i in range(len(panels))]
    if lines:
        note = fig.add_subplot(grid[rows, :])
        note.axis("off")
        note.text(0.0, 1.0, "\n".join(lines), ha="left", va="top", fontsize=7,
                  transform=note.transAxes)  # fmt: skip
    for ax, (title, (rows, optimum)) in zip(axes, panels.items(), strict=True):
        ok = [r for r in rows if not r.get("skipped")]
        for name in dict.fromkeys(r["map"] for r in ok):
            pts = sorted(
                (r["state_dim"], r["rel_frobenius_mean"], r["rel_frobenius_std"])
                for r in ok
                if r["map"] == name
            )
            pts = [p for p in pts if math.isfinite(p[1]) and p[1] > 0]
            if pts:
                xs, ys, es = zip(*pts, strict=True)
                line = ax.errorbar(xs, ys, yerr=es, marker="o", ms=3, capsize=2, lw=1.2,
                                   label=name)  # fmt: skip
                ringed = [(x, y) for x, y in zip(xs, ys, strict=True) if x == marks.get(name)]
                for x, y in ringed:
                    color = line.lines[0].get_color()
                    ax.plot([x], [y], "o", ms=9, mfc="none", mec=color, mew=1.5)
                    ax.annotate("the model's size", (x, y), textcoords="offset points",
                                xytext=(-6, 8), ha="right", fontsize=6, color=color)  # fmt: skip
        opt = sorted((r, e) for r, e in optimum if math.isfinite(e) and e > 0)
        if opt:
            xs, ys = zip(*opt, strict=True)
            ax.plot(xs, ys, "k--", lw=1.5, label="optimal rank-m (SVD)")
        log_axes(ax)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("state dim (effective features)")
        ax.set_ylabel("relative Frobenius error")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "no results", ha="center", va="center", transform=ax.transAxes)
    return save_png(fig, path)
