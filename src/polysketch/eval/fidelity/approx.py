"""What ``polysketch approx`` measures and writes, as library calls.

Polynomial mode: ``measure_polynomial(q, k, names, ...)`` runs ``evaluate.sweep`` (every map ×
degree p × feature dim F: relative Frobenius error, RMAE (LLoPS Eq. 21) and max relative error
of φq(Q)φk(K)ᵀ against the map's target kernel or (q·k)^p) and the Eckart–Young optimum at
each state size (LLoPS Thm 3.1, ``optimal_curve``); ``format_table`` prints the rows and
``write_polynomial`` writes ``results.csv``, ``optimal.csv`` and ``fidelity.png``.
``default_maps`` picks the registered maps of a family that build with defaults;
``fit_samples`` the samples learnable maps (LLoPS) are fitted on.

Softmax mode: ``measure_softmax(names, ...)`` runs ``softmax.angle_sweep`` (the error of
softmax-kernel estimators vs the angle between q and k, HRF Fig. 2) and ``write_softmax``
writes ``angles.csv`` and ``angles.png``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..._files import write_csv
from ...features import available, create
from ...features.optimal_rank import optimal_curve
from ...nn import presets
from ..plots import plot_fidelity_sweep
from . import softmax
from .data_sources import SYNTHETIC_SOURCES, load_qk
from .evaluate import sweep

__all__ = [
    "POLYNOMIAL_MAPS",
    "SOFTMAX_MAPS",
    "default_maps",
    "fit_samples",
    "measure_polynomial",
    "format_table",
    "write_polynomial",
    "measure_softmax",
    "write_softmax",
]

# Derived from the maps' declared families: polynomial mode measures the polynomial maps and the
# baselines with a kernel of their own (elu, taylor); softmax mode the softmax-kernel estimators.
POLYNOMIAL_MAPS = tuple(available("polynomial", "own"))
SOFTMAX_MAPS = tuple(sorted(presets.SOFTMAX_MAPS))


def default_maps(
    family: Sequence[str], dim: int, *, log: Callable[[str], object] | None = None
) -> tuple[list[str], list[str]]:
    """Registered maps of ``family`` that build with defaults at input dim ``dim``: (usable,
    'name: reason' skipped); ``log`` receives one "skipping ..." line per skipped map."""
    names, skipped = [], []
    registered = set(available())
    for name in family:
        if name not in registered:
            continue
        try:
            create(name, dim)
        except Exception as err:  # any failure to build means: leave it out, say why
            skipped.append(f"{name}: {type(err).__name__}: {err}")
            continue
        names.append(name)
    if log is not None:
        for line in skipped:
            log(f"skipping {line}")
    return names, skipped


def fit_samples(
    source: str, *, dim: int, num: int, seed: int, fit_source: str | None, fit_num: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (q, k) learnable maps are fitted on: ``fit_num`` samples of ``fit_source`` when
    given; for a synthetic ``source``, a fresh draw (seed + 1: disjoint from the measured
    samples); for a file without ``fit_source``, None (fit on the measured samples)."""
    if fit_source is not None:
        return load_qk(fit_source, dim=dim, num=fit_num, seed=seed + 1)
    if source in SYNTHETIC_SOURCES:
        return load_qk(source, dim=dim, num=num, seed=seed + 1)
    return None


def measure_polynomial(
    q: torch.Tensor, k: torch.Tensor, names: Sequence[str], **sweep_kwargs
) -> dict:
    """``sweep(names, q, k, **sweep_kwargs)`` and the optimum at every measured state size and
    asked F: ``{"rows", "optimal", "seconds"}`` (``sweep_kwargs``: degrees, feature_dims,
    trials, seed, fit_steps, fit_data, target, ...; ``sweep``'s defaults otherwise)."""
    start = time.perf_counter()
    rows = sweep(names, q, k, **sweep_kwargs)
    degrees = sweep_kwargs.get("degrees", (2, 4))
    feature_dims = sweep_kwargs.get("feature_dims", (16, 32, 64, 128))
    ranks = sorted({int(r["state_dim"]) for r in rows if not r.get("skipped")} | set(feature_dims))
    optimal = optimal_curve(q, k, degrees=degrees, ranks=ranks)
    return {"rows": rows, "optimal": optimal, "seconds": time.perf_counter() - start}


def write_polynomial(result: dict, out) -> list[Path]:
    """``results.csv``, ``optimal.csv`` and ``fidelity.png`` of ``measure_polynomial``."""
    out = Path(out)
    return [
        write_csv(result["rows"], out / "results.csv"),
        write_csv(result["optimal"], out / "optimal.csv"),
        plot_fidelity_sweep(result["rows"], out / "fidelity.png", optimal=result["optimal"]),
    ]


def _fmt(x, spec: str = ".3g") -> str:
    if x is None or x == "":
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return format(x, spec)


def format_table(rows: list[dict]) -> str:
    """The polynomial-mode results as an aligned text table (skipped rows listed after)."""
    header = (
        "map",
        "target",
        "p",
        "F asked",
        "state_dim",
        "rel Frobenius ± std",
        "RMAE",
        "max rel",
        "optimum",
        "ratio",
    )
    lines = [header]
    for r in rows:
        if r.get("skipped"):
            continue
        lines.append(
            (
                r["map"],
                r["target"],
                str(r["degree"]),
                _fmt(r["num_features"], "d"),
                str(r["state_dim"]),
                f"{_fmt(r['rel_frobenius_mean'])} ± {_fmt(r['rel_frobenius_std'], '.2g')}",
                _fmt(r["rmae_mean"]),
                _fmt(r["max_rel_mean"]),
                _fmt(r["optimal_rel"]),
                _fmt(r["ratio_to_optimal"], ".3f"),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    ]
    out.insert(1, "  ".join("-" * w for w in widths))
    skipped = [r for r in rows if r.get("skipped")]
    if skipped:
        out.append("")
        out.append("skipped:")
        out.extend(
            f"  {r['map']} p={r['degree']} F={_fmt(r['num_features'], 'd')}: {r['skipped']}"
            for r in skipped
        )
    return "\n".join(out)


def format_row(row: dict) -> str:
    """One softmax-mode row as ``key=value`` pairs (floats to 3 significant digits)."""
    return "  ".join(f"{key}={_fmt(v) if isinstance(v, float) else v}" for key, v in row.items())


def measure_softmax(
    names: Sequence[str],
    *,
    seed: int = 0,
    progress: bool = True,
    trials: int | None = None,
    dim: int | None = None,
    num_features: int | None = None,
    lambda_features: int | None = None,
    radius: float | None = None,
    num_angles: int | None = None,
) -> list[dict]:
    """``softmax.angle_sweep`` on ``names``; the options left None keep its defaults."""
    return softmax.angle_sweep(
        names, seed=seed, progress=progress,
        **_given(trials=trials, dim=dim, radius=radius, num_angles=num_angles,
                 num_features=num_features, lambda_features=lambda_features),
    )  # fmt: skip


def write_softmax(rows: list[dict], out) -> list[Path]:
    """``angles.csv`` and ``angles.png`` of ``measure_softmax``'s rows."""
    out = Path(out)
    return [write_csv(rows, out / "angles.csv"), softmax.plot_angle_sweep(rows, out / "angles.png")]


def _given(**kwargs) -> dict:
    """The keyword arguments that are set (not None): the rest keep the callee's defaults."""
    return {key: value for key, value in kwargs.items() if value is not None}
