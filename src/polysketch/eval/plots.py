"""Shared matplotlib helpers for the evaluation tools: headless (Agg) figures, log axes, PNGs.

Every plotting function in ``polysketch.eval`` goes through these helpers so that figures are
drawn without a display (the Agg backend is selected before ``pyplot`` is imported, and only
when no other backend has been chosen explicitly), share one look, and are written as PNG files
atomically (``polysketch._files.atomic_write``, parent folders created on demand).

matplotlib is an optional dependency (the ``plot`` extra: ``pip install polysketch[plot]``):
this module imports it only when a figure is drawn, so the library, the CLI and every
measurement run without it; drawing without it raises an ImportError naming the extra.
"""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from .._files import atomic_write

__all__ = ["PLOT_EXTRA", "pyplot", "subplots", "log_axes", "save_png", "plot_fidelity_sweep"]

PLOT_EXTRA = "pip install polysketch[plot]"
"""How to install what the figures need (matplotlib)."""


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (safe on headless machines).

    Raises ImportError naming the ``plot`` extra when matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(
            f"drawing figures needs matplotlib, which polysketch installs with its plot extra: "
            f"{PLOT_EXTRA}"
        ) from err
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def subplots(num_panels: int, *, ncols: int | None = None, panel_size=(4.5, 3.5), **kwargs):
    """A figure with ``num_panels`` axes laid out on a grid of ``ncols`` columns.

    Returns ``(fig, axes)`` with ``axes`` a flat list of exactly ``num_panels`` axes (unused
    grid cells are removed).
    """
    if num_panels < 1:
        raise ValueError(f"num_panels must be >= 1, got {num_panels}")
    ncols = min(num_panels, 3) if ncols is None else max(1, int(ncols))
    nrows = math.ceil(num_panels / ncols)
    plt = pyplot()
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(panel_size[0] * ncols, panel_size[1] * nrows),
        squeeze=False,
        **kwargs,
    )
    flat = list(axes.ravel())
    for ax in flat[num_panels:]:
        fig.delaxes(ax)
    return fig, flat[:num_panels]


def log_axes(ax, *, x: bool = True, y: bool = True, grid: bool = True) -> None:
    """Put ``ax`` on log scales (base 2 for x, feature counts; base 10 for y, errors)."""
    if x:
        ax.set_xscale("log", base=2)
    if y:
        ax.set_yscale("log")
    if grid:
        ax.grid(True, which="both", alpha=0.3)


def save_png(fig, path, *, dpi: int = 120) -> Path:
    """Write ``fig`` to ``path`` as PNG (atomically, parents created), close it, and return
    the path."""
    fig.tight_layout()
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=dpi)
    finally:
        pyplot().close(fig)
    return atomic_write(Path(path), buffer.getvalue())


def _finite_positive(values: Iterable) -> list[float]:
    out = []
    for v in values:
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f) and f > 0:
            out.append(f)
    return out


def plot_fidelity_sweep(
    rows: Sequence[dict],
    path,
    *,
    metric: str = "rel_frobenius",
    optimal: Sequence[dict] = (),
    exact_below: float = 1e-12,
) -> Path:
    """Error vs feature dimension, one panel per degree and one line per map.

    Args:
        rows: result rows of ``polysketch.eval.fidelity.sweep`` (keys ``map``, ``degree``,
            ``state_dim``, ``{metric}_mean``, ``{metric}_std``, ``skipped``); skipped rows and
            non-finite values are ignored. The x coordinate is the effective feature count
            ``state_dim`` (F, or F² for square maps), so maps are compared at equal state size.
        path: the PNG to write.
        metric: which metric to plot (``rel_frobenius``, ``rmae`` or ``max_rel``).
        optimal: rows ``{"degree", "rank", "relative"}`` of the Eckart–Young optimum (LLoPS
            Thm 3.1), drawn as a dashed black line per panel.
        exact_below: maps whose error at this degree is below this everywhere (exact maps,
            and maps measured against their own closed-form kernel) are not drawn, which would
            stretch the log axis to rounding level; they are named in a note on the panel.

    Returns the written path.
    """
    ok = [r for r in rows if not r.get("skipped")]
    degrees = sorted({int(r["degree"]) for r in ok} | {int(o["degree"]) for o in optimal})
    if not degrees:
        degrees = [0]
    fig, axes = subplots(len(degrees))
    for ax, degree in zip(axes, degrees, strict=True):
        drawn = False
        here = [r for r in ok if int(r["degree"]) == degree]
        maps = sorted({r["map"] for r in here})
        exact = [
            name
            for name in maps
            if all(0 <= float(r[f"{metric}_mean"]) < exact_below for r in here if r["map"] == name)
        ]
        for name in maps:
            if name in exact:
                continue
            pts = sorted(
                (float(r["state_dim"]), float(r[f"{metric}_mean"]), float(r[f"{metric}_std"]))
                for r in ok
                if r["map"] == name and int(r["degree"]) == degree
            )
            pts = [p for p in pts if len(_finite_positive(p[:2])) == 2]
            if not pts:
                continue
            xs, ys, es = zip(*pts, strict=True)
            es = [e if math.isfinite(e) else 0.0 for e in es]
            marker = "o" if len(xs) > 1 else "s"
            ax.errorbar(xs, ys, yerr=es, marker=marker, ms=4, capsize=2, label=name)
            drawn = True
        opt = sorted(
            (float(o["rank"]), float(o["relative"]))
            for o in optimal
            if int(o["degree"]) == degree and len(_finite_positive([o["rank"], o["relative"]])) == 2
        )
        if opt:
            xs, ys = zip(*opt, strict=True)
            ax.plot(xs, ys, "k--", lw=1.5, label="optimal rank-m (SVD)")
            drawn = True
        if exact:
            note = f"error < {exact_below:g}: " + ", ".join(exact)
            ax.text(0.02, 0.02, note, fontsize=6, transform=ax.transAxes, va="bottom")
        if drawn:
            log_axes(ax)
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no finite results", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"degree p = {degree}")
        ax.set_xlabel("state dim (effective features)")
        ax.set_ylabel(metric.replace("_", " "))
    return save_png(fig, path)
