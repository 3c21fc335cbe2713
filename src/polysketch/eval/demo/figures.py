"""The figures of the demo report: loss curves (quality) and fidelity panels (fidelity)."""

from __future__ import annotations

import math
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
    panels: dict[str, tuple[list[dict], list[tuple[int, float]]]], path
) -> Path:
    """Relative Frobenius error vs state dim, one panel per data source, one line per map.

    ``panels``: title -> (rows of ``polysketch.eval.fidelity.evaluate_map``/``sweep``,
    [(rank, optimal relative error)] of the Eckart–Young bound, drawn dashed black).
    """
    fig, axes = subplots(len(panels), ncols=2)
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
                ax.errorbar(xs, ys, yerr=es, marker="o", ms=3, capsize=2, lw=1.2, label=name)
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
