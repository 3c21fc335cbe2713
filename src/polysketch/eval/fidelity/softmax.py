"""Measuring softmax-kernel estimators SM(x, y) = exp(x·y) (HRF paper, Sec. 4.1).

* ``angle_sweep`` — the paper's Fig. 2 / Fig. 5: same-length inputs x, y on the sphere of
  radius r at angle θ ∈ [0, π]; the empirical relative error sqrt(MSE)/SM(x, y) over seeded
  redraws (Definition 3.3, ε_{θ,r}). For trig and positive it follows Lemma 3.4 (Eq. 25);
  for the angular hybrid it vanishes at θ = 0 and θ = π (Theorem 3.5).
* ``dataset_mse`` — the paper's Table 1: MSE of the estimates of exp(x·y) on random pairs of
  rows of a UCI data set (wine; the paper's Boston is no longer shipped by scikit-learn, we
  offer diabetes), with the number of features matched by feature dimension or by FLOPs.
* ``feature_flops`` — the FLOP model used for the matching.
* ``plot_angle_sweep`` / ``plot_dataset_mse`` — PNG figures (Agg backend, log-scale y).

Maps are given by registry name; each is built with ``create(name, D, num_features=m,
seed=s)`` (plus ``lambda_features=n`` for maps that take it). Maps with a ``fit(q, k,
clusters=...)`` method (``hybrid_clustered``) are fitted on the inputs first: per angle with one
cluster each in ``angle_sweep`` (so Eq. 21 is minimized at the very pair; the sweep then shows
the best case of the clustering-based HRF), on the data rows in ``dataset_mse``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from ..._checks import check_choice, check_float, check_int, check_positive_int
from ...features import FeatureMap, create, get_class
from ...random import make_generator, orthogonal_gaussian
from ..plots import log_axes, pyplot, save_png

__all__ = [
    "angle_sweep",
    "dataset_mse",
    "feature_flops",
    "load_dataset",
    "plot_angle_sweep",
    "plot_dataset_mse",
]

DATASETS = ("wine", "diabetes")


# ----- building maps ---------------------------------------------------------------------------
def _map_names(maps) -> list[str]:
    names = [maps] if isinstance(maps, str) else list(maps)
    if not names:
        raise ValueError("maps must name at least one feature map")
    for name in names:
        try:
            get_class(name)
        except (TypeError, ValueError) as err:
            raise type(err)(f"maps: {err}") from err
    return names


def _build(name: str, dim: int, num_features: int, lambda_features: int, seed: int) -> FeatureMap:
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


def _fits_clusters(feature_map: FeatureMap) -> bool:
    return "clusters" in type(feature_map).fit_keywords


def _estimates(feature_map: FeatureMap, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """φq(x_p)·φk(y_p) for paired rows: (P, D), (P, D) -> (P,)."""
    return (feature_map.query(x) * feature_map.key(y)).sum(-1)


def _trial_estimates(feature_map, x, y, trials: int, generator) -> torch.Tensor:
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
    names = _map_names(maps)
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
        feature_map = _build(name, dim, num_features, lambda_features, seed)
        generator = make_generator(seed + 1)
        if _fits_clusters(feature_map):  # one cluster pair per angle, fitted at the pair
            per_angle, feature_dim = [], None
            for a in range(num_angles):
                feature_map.fit(x[a : a + 1], y[a : a + 1], clusters=1)
                feature_dim = feature_map.feature_dim
                per_angle.append(
                    _trial_estimates(feature_map, x[a : a + 1], y[a : a + 1], trials, generator)
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


# ----- FLOP model ------------------------------------------------------------------------------
def feature_flops(feature_map: FeatureMap) -> int:
    """FLOPs to compute the features of one input, (φq(x) and φk(y))/2, under our model.

    Model: 2·M·N·K for every matrix product (mm/bmm/addmm, einsum), counted by
    ``torch.utils.flop_counter.FlopCounterMode`` on the map's own code path, plus one FLOP per
    output feature (the exp/sin/cos that produces it). Element-wise work on D-vectors (norms,
    diagonal scalings) is not counted. This follows the paper's cost model (App. L, Eq. 106:
    the cost is dominated by the products of the input with the random directions). What it
    gives, with D the input dim, m = ``num_features``, n = ``lambda_features``:

        trig, positive:     2mD + 2m                     (F = 2m)
        complex_exp:        2D² + 4mD + F  (real A; the D×D product with A plus [ω; −ω])
        hybrid_angular:     4mD + 2nD + F, F = 4m(n + 1) (two sets of directions + τ)
        hybrid_gaussian:    sum of its base and λ projections + F
        hybrid_clustered:   2uD (nearest center) + 2·w·(2m)·D (projections of the active
                            cluster's w blocks; u for keys) + F, F = u·w·2m

    The maps must be ready to compute features (``hybrid_clustered`` fitted).
    """
    from torch.utils.flop_counter import FlopCounterMode

    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a FeatureMap, got {type(feature_map).__name__}")
    ref = next(iter(feature_map.buffers()), None)
    x = torch.ones(1, feature_map.dim, dtype=torch.float64 if ref is None else ref.dtype)
    if ref is not None:
        x = x.to(ref.device)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        feature_map.query(x)
        feature_map.key(x)
    return int(counter.get_total_flops()) // 2 + feature_map.feature_dim


# ----- UCI data (Table 1) ----------------------------------------------------------------------
def load_dataset(name: str = "wine", *, radius: float = 1.0) -> torch.Tensor:
    """Rows of a UCI data set bundled with scikit-learn, preprocessed: (N, D) float64.

    Every column is standardized (zero mean, unit variance), then every row is rescaled to
    L2 norm ``radius``. The paper (Sec. 4.1, Table 1) does not spell out its preprocessing;
    we follow App. H.3 ("we normalize the data points by controlling their ℓ2 norms to make
    the true softmax value be within a reasonable range") with the radius r = 1 of Fig. 2.
    Datasets: "wine" (178 × 13) and "diabetes" (442 × 10; stands in for Boston housing,
    which scikit-learn no longer ships).
    """
    name = check_choice(name, "dataset", DATASETS)
    radius = check_float(radius, "radius", minimum=0.0, strict_minimum=True)
    try:
        from sklearn import datasets
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "dataset_mse needs scikit-learn for the UCI data sets: pip install polysketch[eval]"
        ) from err
    loader = {"wine": datasets.load_wine, "diabetes": datasets.load_diabetes}[name]
    data = torch.as_tensor(loader().data, dtype=torch.float64)
    data = (data - data.mean(0)) / data.std(0).clamp_min(1e-12)
    return radius * data / data.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _matched_map(name, dim, budget, match, lambda_features, seed, data) -> FeatureMap:
    """The map with the largest num_features whose size (F or FLOPs) fits the budget."""

    def build(m):
        feature_map = _build(name, dim, m, lambda_features, seed)
        if _fits_clusters(feature_map):
            feature_map.fit(data, data)
        return feature_map

    def cost(feature_map):
        return feature_map.feature_dim if match == "features" else feature_flops(feature_map)

    limit = budget
    if match == "flops":  # the FLOPs of positive random features with F = budget
        limit = feature_flops(_build("positive", dim, max(budget // 2, 1), 1, seed))
    lo, best = 1, build(1)
    if cost(best) > limit:
        return best  # even m = 1 is over budget: the smallest map
    hi = 2
    while cost(candidate := build(hi)) <= limit:
        lo, best, hi = hi, candidate, hi * 2
    while hi - lo > 1:  # invariant: cost(lo) <= limit < cost(hi)
        mid = (lo + hi) // 2
        candidate = build(mid)
        if cost(candidate) <= limit:
            lo, best = mid, candidate
        else:
            hi = mid
    return best


def dataset_mse(
    maps,
    *,
    dataset: str = "wine",
    budget: int = 64,
    match: str = "features",
    pairs: int = 100,
    trials: int = 50,
    seed: int = 0,
    lambda_features: int = 4,
    radius: float = 1.0,
    progress: bool = True,
) -> list[dict]:
    """MSE of the estimates of exp(x·y) over random pairs of data rows (Table 1).

    ``pairs`` pairs (x, y) of distinct rows of ``load_dataset(dataset, radius=radius)`` are
    drawn from ``seed``. Each map gets the largest ``num_features`` with feature_dim ≤
    ``budget`` (``match="features"``) or with ``feature_flops`` ≤ that of positive random
    features of dimension ``budget`` (``match="flops"``, the paper's FLOP matching; see
    ``feature_flops`` for the model). For t = 1..``trials`` redraws, mse_t = mean over pairs
    of (SM̂ − SM)²; the row reports their mean and standard deviation.

    Returns one row per map: {"map", "dataset", "match", "budget", "num_features",
    "feature_dim", "flops", "mse", "mse_std"}.
    """
    names = _map_names(maps)
    budget = check_int(budget, "budget", minimum=2)
    match = check_choice(match, "match", ("features", "flops"))
    pairs = check_positive_int(pairs, "pairs")
    trials = check_int(trials, "trials", minimum=2)
    seed = check_int(seed, "seed", minimum=0)
    lambda_features = check_positive_int(lambda_features, "lambda_features")
    data = load_dataset(dataset, radius=radius)
    n, dim = data.shape
    gen = make_generator(seed)
    first = torch.randint(0, n, (pairs,), generator=gen)
    second = (first + torch.randint(1, n, (pairs,), generator=gen)) % n  # distinct rows
    x, y = data[first], data[second]
    exact = torch.exp((x * y).sum(-1))

    rows = []
    for name in tqdm(names, desc=f"{dataset} MSE", disable=not progress):
        feature_map = _matched_map(name, dim, budget, match, lambda_features, seed, data)
        est = _trial_estimates(feature_map, x, y, trials, make_generator(seed + 1))
        per_trial = (est - exact).square().mean(-1)
        rows.append(
            {
                "map": name,
                "dataset": dataset,
                "match": match,
                "budget": budget,
                "num_features": int(feature_map.num_features),
                "feature_dim": int(feature_map.feature_dim),
                "flops": feature_flops(feature_map),
                "mse": float(per_trial.mean()),
                "mse_std": float(per_trial.std()),
            }
        )
    return rows


# ----- plots -----------------------------------------------------------------------------------
def _check_rows(rows, keys: Sequence[str]) -> list[dict]:
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
    rows = _check_rows(rows, ("map", "theta", "radius", "rel_err"))
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


def plot_dataset_mse(rows, path):
    """MSE per map (bars with ± std over trials), one group per data set, log-scale y."""
    rows = _check_rows(rows, ("map", "dataset", "mse", "mse_std"))
    fig, ax = pyplot().subplots(figsize=(6, 4))
    sets = list(dict.fromkeys(r["dataset"] for r in rows))
    names = list(dict.fromkeys(r["map"] for r in rows))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs, ys, errs = [], [], []
        for j, ds in enumerate(sets):
            for row in rows:
                if row["map"] == name and row["dataset"] == ds:
                    xs.append(j + (i - (len(names) - 1) / 2) * width)
                    ys.append(row["mse"])
                    errs.append(row["mse_std"])
        ax.bar(xs, ys, width=width, yerr=errs, capsize=2, label=name)
    ax.set_xticks(range(len(sets)), sets)
    log_axes(ax, x=False, y=True)
    ax.set_ylabel("MSE of exp(x·y) estimates")
    ax.set_title("Softmax kernel MSE on UCI data (HRF Table 1)")
    ax.legend(fontsize="small")
    return save_png(fig, path)
