"""The HRF paper's Table 1: softmax-kernel estimators on UCI data, at equal features or FLOPs.

MSE of the estimates of SM(x, y) = exp(x·y) over random pairs of rows of a UCI data set (wine;
the paper's Boston housing is no longer shipped by scikit-learn, we offer diabetes), each map
given the largest number of random features whose feature dimension (``--match features``) or
FLOPs (``--match flops``, the paper's matching) fits the budget. Needs scikit-learn (the
``eval`` extra). The kernel-fidelity check a user runs, the error against the angle between x
and y (HRF Fig. 2), stays in the package: ``polysketch approx --kernel softmax``.

* ``load_dataset`` — the rows of a data set, standardized and rescaled to a common norm;
* ``feature_flops`` — the FLOP model used for the matching;
* ``dataset_mse`` — one row per map: its matched size, the MSE and its spread over redraws;
* ``plot_dataset_mse`` — a PNG (Agg backend, log-scale y);
* ``main`` — the command line, writing ``datasets.csv`` and ``datasets.png`` into ``--out``:

    python -m experiments.hrf_table1 [--dataset wine diabetes] [--match features|flops]
        [--budget 64] [--pairs 100] [--trials 50] [--out runs/hrf_table1] [--overwrite]

Maps are built by registry name as in ``polysketch.eval.fidelity.softmax`` (whose helpers
this module uses); maps with a ``fit(q, k, clusters=...)`` method (``hybrid_clustered``) are
fitted on the data rows first.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tqdm.auto import tqdm

from polysketch._checks import check_choice, check_float, check_int, check_positive_int
from polysketch._files import write_csv
from polysketch.commands._common import add_overwrite_argument, prepare_out_dir
from polysketch.commands.approx import check_maps
from polysketch.eval.fidelity.approx import SOFTMAX_MAPS, default_maps, format_row
from polysketch.eval.fidelity.softmax import (
    build_softmax_estimator,
    check_rows,
    fits_clusters,
    softmax_map_names,
    trial_estimates,
)
from polysketch.eval.plots import log_axes, pyplot, save_png
from polysketch.features import FeatureMap
from polysketch.random import make_generator

__all__ = [
    "DATASETS",
    "dataset_mse",
    "feature_flops",
    "load_dataset",
    "main",
    "plot_dataset_mse",
]

DATASETS = ("wine", "diabetes")


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


# ----- UCI data --------------------------------------------------------------------------------
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
            "the UCI data sets need scikit-learn: pip install 'polysketch[eval]'"
        ) from err
    loader = {"wine": datasets.load_wine, "diabetes": datasets.load_diabetes}[name]
    data = torch.as_tensor(loader().data, dtype=torch.float64)
    data = (data - data.mean(0)) / data.std(0).clamp_min(1e-12)
    return radius * data / data.norm(dim=-1, keepdim=True).clamp_min(1e-12)


# ----- the table -------------------------------------------------------------------------------
def _matched_map(name, dim, budget, match, lambda_features, seed, data) -> FeatureMap:
    """The map with the largest num_features whose size (F or FLOPs) fits the budget."""

    def build(m):
        feature_map = build_softmax_estimator(name, dim, m, lambda_features, seed)
        if fits_clusters(feature_map):
            feature_map.fit(data, data)
        return feature_map

    def cost(feature_map):
        return feature_map.feature_dim if match == "features" else feature_flops(feature_map)

    limit = budget
    if match == "flops":  # the FLOPs of positive random features with F = budget
        limit = feature_flops(
            build_softmax_estimator("positive", dim, max(budget // 2, 1), 1, seed)
        )
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
    names = softmax_map_names(maps)
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
        est = trial_estimates(feature_map, x, y, trials, make_generator(seed + 1))
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


def plot_dataset_mse(rows, path):
    """MSE per map (bars with ± std over trials), one group per data set, log-scale y."""
    rows = check_rows(rows, ("map", "dataset", "mse", "mse_std"))
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


# ----- command line ----------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.hrf_table1",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--maps",
        nargs="+",
        default=None,
        metavar="NAME",
        help="softmax-kernel estimators to compare (default: every registered one that builds)",
    )
    parser.add_argument(
        "--dataset",
        nargs="+",
        choices=DATASETS,
        default=["wine"],
        help="UCI data sets, one group of bars each (diabetes stands in for Boston housing)",
    )
    parser.add_argument(
        "--match",
        choices=("features", "flops"),
        default="features",
        help="compare estimators at equal feature dimension or at equal FLOPs",
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=64,
        help="feature dimension (or, with --match flops, that of positive random features "
        "whose FLOPs) each map may use",
    )
    parser.add_argument(
        "--pairs", "--num", dest="pairs", type=int, default=100, help="pairs of data rows"
    )
    parser.add_argument("--trials", type=int, default=50, help="seeded redraws of every map")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lambda-features",
        type=int,
        default=4,
        help="random features of the hybrids' λ estimators",
    )
    parser.add_argument("--radius", type=float, default=1.0, help="L2 norm of every data row")
    parser.add_argument("--out", default="runs/hrf_table1", help="output directory")
    add_overwrite_argument(parser, "result files")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return parser


def _error(message) -> int:
    print(f"hrf_table1: error: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    """The command line of the module docstring; returns the exit status (2, with one
    ``error:`` line on stderr, for a refused argument or a missing scikit-learn)."""
    args = _parser().parse_args(argv)
    try:
        check_maps(args.maps or (), "softmax")  # before --out is touched
        names = args.maps
        out = prepare_out_dir(args.out, overwrite=args.overwrite)
    except (TypeError, ValueError) as err:
        return _error(err)
    rows = []
    try:
        for dataset in args.dataset:
            if names is None:  # the registered estimators that build at the first set's dim
                dim = load_dataset(dataset).shape[-1]
                names = default_maps(SOFTMAX_MAPS, dim, log=print)[0]
            rows += dataset_mse(
                names, dataset=dataset, budget=args.budget, match=args.match,
                pairs=args.pairs, trials=args.trials, seed=args.seed,
                lambda_features=args.lambda_features, radius=args.radius,
                progress=not args.no_progress,
            )  # fmt: skip
    except (TypeError, ValueError, ImportError) as err:
        return _error(err)
    for row in rows:
        print(format_row(row))
    print(f"wrote {write_csv(rows, out / 'datasets.csv')}")
    print(f"wrote {plot_dataset_mse(rows, out / 'datasets.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
