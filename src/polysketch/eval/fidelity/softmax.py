"""Measuring softmax-kernel estimators SM(x, y) = exp(x·y) (HRF paper, Sec. 4.1).

* ``angle_sweep`` — the paper's Fig. 2 / Fig. 5: same-length inputs x, y on the sphere of
  radius r at angle θ ∈ [0, π]; the empirical relative error sqrt(MSE)/SM(x, y) over seeded
  redraws (Definition 3.3, ε_{θ,r}). For trig and positive it follows Lemma 3.4 (Eq. 25);
  for the angular hybrid it vanishes at θ = 0 and θ = π (Theorem 3.5).
* ``plot_angle_sweep`` — its PNG figure (Agg backend, log-scale y).

Maps are given by registry name; each is built with ``create(name, D, num_features=m,
seed=s)`` (plus ``lambda_features=n`` for maps that take it). Maps with a ``fit(q, k,
clusters=...)`` method (``hybrid_clustered``) are fitted on the inputs first: per angle with one
cluster each (so Eq. 21 is minimized at the very pair; the sweep then shows the best case of the
clustering-based HRF). The helpers below (building a map by name, its estimates over redraws,
checking rows) are shared with ``experiments/hrf_table1.py``, the paper's Table 1 on UCI data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from ..._checks import check_float, check_int, check_positive_int
from ...features import FeatureMap, create, get_class
from ...random import make_generator, orthogonal_gaussian
from ..plots import log_axes, pyplot, save_png

__all__ = [
    "angle_sweep",
    "plot_angle_sweep",
    "softmax_map_names",
    "build_softmax_estimator",
    "fits_clusters",
    "trial_estimates",
    "check_rows",
]


# ----- building maps ---------------------------------------------------------------------------
def softmax_map_names(maps) -> list[str]:
    """``maps`` (one registry name or several) as a list, each name checked (ValueError or
    TypeError naming ``maps``)."""
    names = [maps] if isinstance(maps, str) else list(maps)
    if not names:
        raise ValueError("maps must name at least one feature map")
    for name in names:
        try:
            get_class(name)
        except (TypeError, ValueError) as err:
            raise type(err)(f"maps: {err}") from err
    return names


def build_softmax_estimator(
    name: str, dim: int, num_features: int, lambda_features: int, seed: int
) -> FeatureMap:
    """The map ``name`` in float64 (``lambda_features`` where it takes them), refused unless it
    is an unbiased or exact, non-square estimator of exp(x·y) at its default scale."""
    kwargs = {"num_features": num_features, "seed": seed}
    if get_class(name).takes("lambda_features"):
        kwargs["lambda_features"] = lambda_features
    feature_map = create(name, dim, **kwargs).to(torch.float64)
    if feature_map.kind not in ("unbiased", "exact") or feature_map.square:
        raise ValueError(f"maps: {name!r} is not an estimator of the softmax kernel")
    probe = torch.eye(2, dim, dtype=torch.float64)
    expected = torch.exp(probe @ probe.T)
    if not torch.allclose(feature_map.target_kernel(probe, probe), expected):
        raise ValueError(f"maps: {name!r} does not target exp(x·y) with its default scale")
    return feature_map


def fits_clusters(feature_map: FeatureMap) -> bool:
    """Whether the map is fitted on clustered inputs (``fit(q, k, clusters=...)``)."""
    return "clusters" in type(feature_map).fit_keywords


def _estimates(feature_map: FeatureMap, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """φq(x_p)·φk(y_p) for paired rows: (P, D), (P, D) -> (P,)."""
    return (feature_map.query(x) * feature_map.key(y)).sum(-1)


def trial_estimates(feature_map, x, y, trials: int, generator) -> torch.Tensor:
    """Estimates over ``trials`` redraws from ``generator``: (trials, P)."""
    out = []
    for _ in range(trials):
        feature_map.redraw_(generator)
        out.append(_estimates(feature_map, x, y))
    return torch.stack(out)


# ----- angle sweep (Fig. 2) --------------------------------------------------------------------
def angle_sweep(
    maps,
    *,
    dim: int = 16,
    radius: float = 1.0,
    num_angles: int = 25,
    num_features: int = 16,
    lambda_features: int = 4,
    trials: int = 200,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Empirical relative error ε_{θ,r} = sqrt(MSE)/SM(x, y) against the angle θ (Fig. 2).

    x = r·e, y = r(cos θ e + sin θ e') for a random orthonormal pair (e, e') (drawn from
    ``seed``), θ on ``num_angles`` evenly spaced points of [0, π]; MSE is the mean of
    (SM̂ − SM)² over ``trials`` redraws of each map (all angles share a draw).

    Returns one row per (map, θ): {"map", "theta", "radius", "num_features", "feature_dim",
    "mse", "rel_err"}.
    """
    names = softmax_map_names(maps)
    dim = check_int(dim, "dim", minimum=2)
    radius = check_float(radius, "radius", minimum=0.0, strict_minimum=True)
    num_angles = check_int(num_angles, "num_angles", minimum=2)
    num_features = check_positive_int(num_features, "num_features")
    lambda_features = check_positive_int(lambda_features, "lambda_features")
    trials = check_int(trials, "trials", minimum=2)
    seed = check_int(seed, "seed", minimum=0)

    basis = orthogonal_gaussian(2, dim, generator=make_generator(seed)).double()
    basis = basis / basis.norm(dim=-1, keepdim=True)
    theta = torch.linspace(0.0, math.pi, num_angles, dtype=torch.float64)
    x = radius * basis[0].expand(num_angles, dim)
    y = radius * (torch.cos(theta)[:, None] * basis[0] + torch.sin(theta)[:, None] * basis[1])
    exact = torch.exp((x * y).sum(-1))

    rows = []
    bar = tqdm(total=len(names) * trials, desc="angle sweep", disable=not progress)
    for name in names:
        feature_map = build_softmax_estimator(name, dim, num_features, lambda_features, seed)
        generator = make_generator(seed + 1)
        if fits_clusters(feature_map):  # one cluster pair per angle, fitted at the pair
            per_angle, feature_dim = [], None
            for a in range(num_angles):
                feature_map.fit(x[a : a + 1], y[a : a + 1], clusters=1)
                feature_dim = feature_map.feature_dim
                per_angle.append(
                    trial_estimates(feature_map, x[a : a + 1], y[a : a + 1], trials, generator)
                )
            est = torch.cat(per_angle, dim=1)
            bar.update(trials)
        else:
            feature_dim = feature_map.feature_dim
            est = []
            for _ in range(trials):
                feature_map.redraw_(generator)
                est.append(_estimates(feature_map, x, y))
                bar.update(1)
            est = torch.stack(est)
        mse = (est - exact).square().mean(0)
        for a in range(num_angles):
            rows.append(
                {
                    "map": name,
                    "theta": float(theta[a]),
                    "radius": radius,
                    "num_features": num_features,
                    "feature_dim": int(feature_dim),
                    "mse": float(mse[a]),
                    "rel_err": float(mse[a].sqrt() / exact[a]),
                }
            )
    bar.close()
    return rows


# ----- plots -----------------------------------------------------------------------------------
def check_rows(rows, keys: Sequence[str]) -> list[dict]:
    """``rows`` as a list, refused when empty or when a row lacks one of ``keys``."""
    rows = list(rows)
    if not rows:
        raise ValueError("rows must not be empty")
    for row in rows:
        missing = [k for k in keys if k not in row]
        if missing:
            raise ValueError(f"rows: a row lacks the keys {missing}")
    return rows


def plot_angle_sweep(rows, path):
    """Relative error against θ, one line per (map, radius), log-scale y: writes a PNG.

    ``rows`` as returned by ``angle_sweep``; returns the ``pathlib.Path`` written.
    """
    rows = check_rows(rows, ("map", "theta", "radius", "rel_err"))
    fig, ax = pyplot().subplots(figsize=(6, 4))
    series = {}
    for row in rows:
        series.setdefault((row["map"], row["radius"]), []).append((row["theta"], row["rel_err"]))
    finite = [e for r in rows if (e := r["rel_err"]) > 0 and math.isfinite(e)]
    # θ = 0, π can be exactly 0 (up to rounding): show them on a floor 4 decades down
    floor = max(min(finite), 1e-4 * max(finite)) if finite else 1e-12
    for (name, r), points in series.items():
        points.sort()
        ax.plot(
            [t for t, _ in points],
            [max(e, floor) for _, e in points],
            marker="o",
            markersize=3,
            label=f"{name} (r={r:g})",
        )
    log_axes(ax, x=False, y=True)
    ax.set_xlabel("angle θ between x and y")
    ax.set_ylabel("relative error sqrt(MSE) / SM(x, y)")
    ax.set_title("Softmax kernel estimators on the sphere (HRF Fig. 2)")
    ax.legend(fontsize="small")
    return save_png(fig, path)
