"""``polysketch approx``: how well do feature maps approximate their kernel?

Polynomial mode (default) measures, for every polynomial map × degree p × feature dim F, the
relative Frobenius error, RMAE (LLoPS Eq. 21) and max relative error of φq(Q)φk(K)ᵀ against
the map's target kernel on sampled queries/keys, next to the Eckart–Young optimum for a map
of the same state size (LLoPS Thm 3.1). It prints a table and writes ``results.csv``,
``optimal.csv`` and ``fidelity.png`` into ``--out`` (a non-empty ``--out`` is refused unless
``--overwrite``).

Softmax mode (``--kernel softmax``) runs the hybrid-random-features experiments of
``polysketch.eval.softmax_fidelity``: the error of softmax-kernel estimators vs the angle
between q and k (``--experiment angles``, HRF Fig. 2 style) or their MSE on a UCI data set
(``--experiment datasets``), writing ``angles.csv``/``angles.png`` or
``datasets.csv``/``datasets.png``.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
import time
from pathlib import Path

from .._files import atomic_write
from ..features import available, create
from ..nn import presets
from ._common import add_overwrite_argument, fail, io_error, prepare_out_dir

__all__ = ["POLYNOMIAL_MAPS", "SOFTMAX_MAPS", "add_parser", "run", "default_maps", "write_csv"]

# Derived from the maps' declared families: polynomial mode measures the polynomial maps and the
# baselines with a kernel of their own (elu, taylor); softmax mode the softmax-kernel estimators.
POLYNOMIAL_MAPS = tuple(available("polynomial", "own"))
SOFTMAX_MAPS = tuple(sorted(presets.SOFTMAX_MAPS))


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``approx`` on the top-level CLI's ``subparsers``."""
    parser = subparsers.add_parser(
        "approx",
        help="kernel-approximation fidelity of the feature maps (tables, CSV, plots)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--kernel", choices=("polynomial", "softmax"), default="polynomial")
    parser.add_argument(
        "--maps",
        nargs="+",
        default=None,
        metavar="NAME",
        help="maps to measure (default: every available map of --kernel's family)",
    )
    parser.add_argument(
        "--degrees", nargs="+", type=int, default=[2, 4], metavar="P", help="polynomial degrees p"
    )
    parser.add_argument(
        "--feature-dims",
        nargs="+",
        type=int,
        default=None,
        metavar="F",
        help="feature dims asked (polynomial: 16 32 64 128; softmax: the first "
        "is m per estimator / the budget, default that function's own)",
    )
    parser.add_argument(
        "--source",
        default="gaussian",
        help="q/k samples: gaussian, sphere, or a .pt/.npz/.npy file",
    )
    parser.add_argument(
        "--dim",
        type=int,
        default=None,
        help="head dim D (synthetic sources: default 16; files: checked)",
    )
    parser.add_argument(
        "--num",
        type=int,
        default=None,
        help="queries and keys sampled (polynomial: default 256; softmax "
        "datasets: number of pairs)",
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=None,
        help="seeded draws per random map (polynomial default 5)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="approx-results", help="output directory")
    add_overwrite_argument(parser, "result files")
    parser.add_argument(
        "--target",
        choices=("map", "polynomial"),
        default="map",
        help="measure against each map's own target_kernel, or against (q·k)^p at each degree",
    )
    parser.add_argument(
        "--fit-steps",
        type=int,
        default=50,
        help="Adam steps calibrating learnable maps with a fit() method (LLoPS) "
        "on a held-out sample before measuring; 0 measures them at init",
    )
    parser.add_argument(
        "--fit-init",
        choices=("data", "current"),
        default=None,
        help="start of the fit: LLoPS's closed-form data-driven start (its default) or the "
        "constructed draw; with --fit-steps 0, 'data' measures the closed-form start alone",
    )
    parser.add_argument(
        "--fit-lr",
        type=float,
        default=None,
        help="learning rate of the fit (default: the map's own, 1e-2 for LLoPS)",
    )
    parser.add_argument(
        "--fit-source",
        default=None,
        metavar="FILE",
        help="q/k samples (.pt/.npz/.npy, as --source) to fit learnable maps on, e.g. "
        "other tokens of the same model; default: a fresh draw for synthetic sources, "
        "the measured samples themselves for files",
    )
    parser.add_argument(
        "--fit-num",
        type=int,
        default=2048,
        help="queries and keys drawn from --fit-source (all if it holds fewer)",
    )
    parser.add_argument(
        "--fit-maps",
        nargs="+",
        default=["llops"],
        metavar="NAME",
        help="the learnable maps that --fit-steps calibrates (others are measured as built)",
    )
    parser.add_argument(
        "--max-feature-dim",
        type=int,
        default=2**14,
        help="skip maps whose F exceeds this (exact maps at high degree)",
    )
    parser.add_argument(
        "--rel-floor",
        type=float,
        default=1e-3,
        help="RMAE / max-rel denominator floor, relative to max |exact|",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    softmax = parser.add_argument_group("softmax mode")
    softmax.add_argument("--experiment", choices=("angles", "datasets"), default="angles")
    softmax.add_argument("--radius", type=float, default=None, help="‖q‖ = ‖k‖ (angles)")
    softmax.add_argument("--num-angles", type=int, default=None, help="angles in [0, π]")
    softmax.add_argument(
        "--lambda-features",
        type=int,
        default=None,
        help="random features of the hybrids' λ estimators",
    )
    softmax.add_argument("--dataset", choices=("wine", "diabetes"), default="wine")
    softmax.add_argument(
        "--match",
        choices=("features", "flops"),
        default="features",
        help="compare estimators at equal feature count or equal FLOPs",
    )
    parser.set_defaults(func=run)
    return parser


def default_maps(family: tuple[str, ...], dim: int) -> tuple[list[str], list[str]]:
    """Registered maps of ``family`` that build with defaults: (usable, 'name: reason' skipped)."""
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
    return names, skipped


def write_csv(rows: list[dict], path: Path) -> Path:
    """Write ``rows`` (union of their keys as columns, in first-seen order) to ``path``
    (atomically, ``polysketch._files.atomic_write``)."""
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=columns, restval="")
    writer.writeheader()
    writer.writerows(rows)
    return atomic_write(Path(path), buffer.getvalue().encode())


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


def _run_polynomial(args, out: Path) -> int:
    from ..eval.data_sources import load_qk
    from ..eval.fidelity import optimal_curve, sweep
    from ..eval.plots import plot_fidelity_sweep

    dim = (
        args.dim
        if args.dim is not None
        else (16 if args.source in ("gaussian", "sphere") else None)
    )
    num = args.num if args.num is not None else 256
    trials = args.trials if args.trials is not None else 5
    feature_dims = args.feature_dims or [16, 32, 64, 128]
    try:
        q, k = load_qk(args.source, dim=dim, num=num, seed=args.seed)
    except (ValueError, TypeError) as err:  # a user error in --source/--dim/--num: no traceback
        print(f"polysketch approx: error: {err}", file=sys.stderr)
        return 2
    fit_data = None
    if args.fit_steps > 0 or args.fit_init is not None:
        if args.fit_source is not None:
            try:
                fit_data = load_qk(
                    args.fit_source, dim=q.shape[-1], num=args.fit_num, seed=args.seed + 1
                )
            except (ValueError, TypeError) as err:
                print(f"polysketch approx: error: --fit-source: {err}", file=sys.stderr)
                return 2
        elif args.source in ("gaussian", "sphere"):  # a fresh draw: fit and test are disjoint
            fit_data = load_qk(args.source, dim=dim, num=num, seed=args.seed + 1)
        else:  # files: fit in-sample (noted in the output)
            print("note: learnable maps are fitted on the same samples they are measured on")
    if args.maps:
        names = list(args.maps)
    else:
        names, skipped = default_maps(POLYNOMIAL_MAPS, q.shape[-1])
        for line in skipped:
            print(f"skipping {line}")
    if not names:
        print("no polynomial feature maps are available")
        return 1
    print(
        f"measuring {len(names)} maps on {q.shape[0]} queries x {k.shape[0]} keys "
        f"(D={q.shape[-1]}, source={args.source}), degrees {args.degrees}, "
        f"F in {feature_dims}, {trials} trials"
    )
    start = time.perf_counter()
    rows = sweep(
        names,
        q,
        k,
        degrees=args.degrees,
        feature_dims=feature_dims,
        trials=trials,
        seed=args.seed,
        progress=not args.no_progress,
        max_feature_dim=args.max_feature_dim,
        rel_floor=args.rel_floor,
        fit_steps=args.fit_steps,
        fit_init=args.fit_init,
        fit_lr=args.fit_lr,
        fit_data=fit_data,
        target=args.target,
        fit_maps=args.fit_maps,
    )
    ranks = sorted({int(r["state_dim"]) for r in rows if not r.get("skipped")} | set(feature_dims))
    optimal = optimal_curve(q, k, degrees=args.degrees, ranks=ranks)
    print(format_table(rows))
    print(
        f"({time.perf_counter() - start:.1f} s; optimum = least relative Frobenius error of "
        "any map with that state_dim, LLoPS Thm 3.1; ratio = error / optimum)"
    )
    paths = [
        write_csv(rows, out / "results.csv"),
        write_csv(optimal, out / "optimal.csv"),
        plot_fidelity_sweep(rows, out / "fidelity.png", optimal=optimal),
    ]
    for path in paths:
        print(f"wrote {path}")
    return 0


def _given(**kwargs) -> dict:
    """The keyword arguments the user set (not None): the rest keep the callee's defaults."""
    return {key: value for key, value in kwargs.items() if value is not None}


def _run_softmax(args, out: Path) -> int:
    # Imported at call time: the softmax tools are optional for the polynomial mode.
    from ..eval import softmax_fidelity as sf

    if args.maps:
        names = list(args.maps)
    else:
        names, skipped = default_maps(SOFTMAX_MAPS, args.dim or 16)
        for line in skipped:
            print(f"skipping {line}")
    if not names:
        print("no softmax feature maps are available")
        return 1
    common = {"seed": args.seed, "progress": not args.no_progress}
    if args.trials is not None:
        common["trials"] = args.trials
    first_f = args.feature_dims[0] if args.feature_dims else None
    if args.experiment == "angles":
        rows = sf.angle_sweep(
            names,
            **common,
            **_given(
                dim=args.dim,
                radius=args.radius,
                num_angles=args.num_angles,
                num_features=first_f,
                lambda_features=args.lambda_features,
            ),
        )
        stem, plot = "angles", sf.plot_angle_sweep
    else:
        rows = sf.dataset_mse(
            names,
            **common,
            dataset=args.dataset,
            match=args.match,
            **_given(
                budget=first_f,
                pairs=args.num,
                lambda_features=args.lambda_features,
                radius=args.radius,
            ),
        )
        stem, plot = "datasets", sf.plot_dataset_mse
    for row in rows:
        print(
            "  ".join(f"{key}={_fmt(v) if isinstance(v, float) else v}" for key, v in row.items())
        )
    csv_path = write_csv(rows, out / f"{stem}.csv")
    png_path = out / f"{stem}.png"
    plot(rows, png_path)
    print(f"wrote {csv_path}")
    print(f"wrote {png_path}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the measurement chosen by ``args`` (see ``add_parser``); returns the exit status."""
    try:
        out = prepare_out_dir(args.out, overwrite=args.overwrite)
    except ValueError as err:
        return fail("approx", err)
    try:
        if args.kernel == "softmax":
            return _run_softmax(args, out)
        return _run_polynomial(args, out)
    except OSError as err:
        return fail("approx", io_error(err, out))
