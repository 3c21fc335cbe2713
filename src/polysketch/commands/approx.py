"""``polysketch approx``: how well do feature maps approximate their kernel?

Polynomial mode (default) measures, for every polynomial map × degree p × feature dim F, the
relative Frobenius error, RMAE (LLoPS Eq. 21) and max relative error of φq(Q)φk(K)ᵀ against
the map's target kernel on sampled queries/keys, next to the Eckart–Young optimum for a map
of the same state size (LLoPS Thm 3.1). It prints a table and writes ``results.csv``,
``optimal.csv`` and ``fidelity.png`` into ``--out`` (a non-empty ``--out`` is refused unless
``--overwrite``). A ``--maps`` name that is not a map of the mode's family is an error before
anything is written, and so is a run in which every map was skipped.

Softmax mode (``--kernel softmax``) measures the error of softmax-kernel estimators against
the angle between q and k on the sphere (``polysketch.eval.fidelity.softmax.angle_sweep``, HRF
Fig. 2 style), writing ``angles.csv`` and ``angles.png``.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

from .._files import write_csv  # noqa: F401  (re-exported: polysketch.commands.approx.write_csv)
from ..eval.fidelity import approx
from ..eval.fidelity.approx import POLYNOMIAL_MAPS, SOFTMAX_MAPS, default_maps, format_table
from ..eval.fidelity.data_sources import SYNTHETIC_SOURCES, load_qk
from ..features import available
from ._common import add_overwrite_argument, fail, io_error, prepare_out_dir

__all__ = [
    "POLYNOMIAL_MAPS",
    "SOFTMAX_MAPS",
    "add_parser",
    "run",
    "default_maps",
    "format_table",
    "write_csv",
]


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
        "is m per estimator, default angle_sweep's own)",
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
        help="queries and keys sampled (polynomial mode; default 256)",
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
    softmax.add_argument("--radius", type=float, default=None, help="‖q‖ = ‖k‖")
    softmax.add_argument("--num-angles", type=int, default=None, help="angles in [0, π]")
    softmax.add_argument(
        "--lambda-features",
        type=int,
        default=None,
        help="random features of the hybrids' λ estimators",
    )
    parser.set_defaults(func=run)
    return parser


def check_maps(names, kernel: str) -> None:
    """Refuse (ValueError naming ``--maps``) a name that is not a registered feature map, or,
    in softmax mode, not an estimator of the softmax kernel (``SOFTMAX_MAPS``)."""
    family = SOFTMAX_MAPS if kernel == "softmax" else tuple(available())
    for name in names:
        if name in family:
            continue
        if kernel == "softmax" and name in available():
            raise ValueError(
                f"--maps: {name!r} is not an estimator of the softmax kernel; --kernel softmax "
                f"measures {list(SOFTMAX_MAPS)} (use --kernel polynomial for {name!r})"
            )
        close = difflib.get_close_matches(name, family, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"--maps: unknown feature map {name!r}{hint}; available: {list(family)}")


def _run_polynomial(args, out: Path) -> int:
    synthetic = args.source in SYNTHETIC_SOURCES
    dim = args.dim if args.dim is not None else (16 if synthetic else None)
    num = args.num if args.num is not None else 256
    trials = args.trials if args.trials is not None else 5
    feature_dims = args.feature_dims or [16, 32, 64, 128]
    try:
        q, k = load_qk(args.source, dim=dim, num=num, seed=args.seed)
    except (ValueError, TypeError) as err:  # a user error in --source/--dim/--num: no traceback
        return fail("approx", err)
    fit_data = None
    if args.fit_steps > 0 or args.fit_init is not None:
        try:
            fit_data = approx.fit_samples(
                args.source, dim=q.shape[-1], num=num, seed=args.seed,
                fit_source=args.fit_source, fit_num=args.fit_num,
            )  # fmt: skip
        except (ValueError, TypeError) as err:
            return fail("approx", f"--fit-source: {err}")
        if fit_data is None:  # files: fit in-sample (noted in the output)
            print("note: learnable maps are fitted on the same samples they are measured on")
    names = list(args.maps or default_maps(POLYNOMIAL_MAPS, q.shape[-1], log=print)[0])
    if not names:
        print("no polynomial feature maps are available")
        return 1
    print(
        f"measuring {len(names)} maps on {q.shape[0]} queries x {k.shape[0]} keys "
        f"(D={q.shape[-1]}, source={args.source}), degrees {args.degrees}, "
        f"F in {feature_dims}, {trials} trials"
    )
    result = approx.measure_polynomial(
        q, k, names, degrees=args.degrees, feature_dims=feature_dims, trials=trials,
        seed=args.seed, progress=not args.no_progress, max_feature_dim=args.max_feature_dim,
        rel_floor=args.rel_floor, fit_steps=args.fit_steps, fit_init=args.fit_init,
        fit_lr=args.fit_lr, fit_data=fit_data, target=args.target, fit_maps=args.fit_maps,
    )  # fmt: skip
    print(format_table(result["rows"]))
    if all(r.get("skipped") for r in result["rows"]):
        return fail("approx", "nothing was measured: every map was skipped (reasons above)")
    print(
        f"({result['seconds']:.1f} s; optimum = least relative Frobenius error of "
        "any map with that state_dim, LLoPS Thm 3.1; ratio = error / optimum)"
    )
    for path in approx.write_polynomial(result, out):
        print(f"wrote {path}")
    return 0


def _run_softmax(args, out: Path) -> int:
    names = list(args.maps or default_maps(SOFTMAX_MAPS, args.dim or 16, log=print)[0])
    if not names:
        print("no softmax feature maps are available")
        return 1
    rows = approx.measure_softmax(
        names, seed=args.seed, progress=not args.no_progress, trials=args.trials, dim=args.dim,
        num_features=args.feature_dims[0] if args.feature_dims else None,
        lambda_features=args.lambda_features, radius=args.radius, num_angles=args.num_angles,
    )  # fmt: skip
    for row in rows:
        print(approx.format_row(row))
    for path in approx.write_softmax(rows, out):
        print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the measurement chosen by ``args`` (see ``add_parser``); returns the exit status."""
    try:
        check_maps(args.maps or (), args.kernel)
        out = prepare_out_dir(args.out, overwrite=args.overwrite)
    except ValueError as err:
        return fail("approx", err)
    try:
        if args.kernel == "softmax":
            return _run_softmax(args, out)
        return _run_polynomial(args, out)
    except OSError as err:
        return fail("approx", io_error(err, out))
    except ImportError as err:  # the figure without matplotlib: the error names the extra
        return fail("approx", err)
