"""``polysketch mqar``: MQAR recall accuracy vs decode-state size across attentions.

Trains one small TransformerLM per attention (default: softmax, polysketch, llops,
tensorsketch, hybrid_angular, taylor, elu) with the same size, seed, data and schedule on
multi-query associative recall, prints recall accuracy against the floats each model keeps per
sequence while decoding, and writes ``mqar.csv`` and ``mqar.png`` into ``--out`` (a non-empty
``--out`` is refused unless ``--overwrite``). ``--quick`` runs a seconds-long smoke version.
See ``polysketch.eval.mqar_sweep``.
"""

from __future__ import annotations

import argparse

import torch

from .._checks import check_positive_int
from ..eval.mqar_sweep import (
    FULL,
    QUICK,
    SETTINGS,
    format_table,
    parse_attention,
    plot_sweep,
    run_sweep,
    write_csv,
)
from ._common import add_overwrite_argument, check_device, fail, io_error, prepare_out_dir

__all__ = ["add_parser", "add_arguments", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``mqar`` on the top-level CLI's ``subparsers``."""
    parser = subparsers.add_parser(
        "mqar",
        help="MQAR recall vs decode state size for several attentions (CSV, PNG)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    add_overwrite_argument(parser, "mqar.csv and mqar.png")
    parser.set_defaults(func=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``polysketch mqar`` options."""
    parser.add_argument(
        "--attentions", nargs="+", default=None, metavar="NAME[:k=v,...]",
        help="attentions, optionally with model (qk_dim, short_conv, chunk_size, qk_norm, rope) or "
        "feature-map keywords, e.g. llops:num_features=256,degree=4 (default: the setting's list)",
    )  # fmt: skip
    parser.add_argument(
        "--setting", choices=tuple(SETTINGS), default="default",
        help="llops: LLoPS Table 4's model (d_model 128, short convolutions) and attentions; "
        "long / long512: long-range recall at T = 1024 / 512, every query >= T/2 after its key",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny smoke-test sizes")
    parser.add_argument(
        "--lrs", nargs="+", type=float, default=None, metavar="LR",
        help="learning rates to sweep; each attention is reported at its best (default: --lr)",
    )  # fmt: skip
    for key, value in FULL.items():
        parser.add_argument(
            "--" + key.replace("_", "-"), type=type(value), default=None,
            help=f"(default {value}; --quick: {QUICK[key]})",
        )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--out", default="runs/mqar", help="folder for mqar.csv and mqar.png")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar per model")


def run(args: argparse.Namespace) -> int:
    """Check the options, ``--device`` and ``--out`` (error line, 2), run the sweep, print the
    table, write ``mqar.csv`` (after every model, so a stopped sweep keeps its runs) and
    ``mqar.png``."""
    try:
        for spec in args.attentions or []:  # bad options are reported before --out is touched
            parse_attention(spec)
        if args.threads is not None:
            check_positive_int(args.threads, "threads")
        if args.lrs is not None and not all(x > 0 for x in args.lrs):
            raise ValueError(f"lrs must be positive numbers, got {args.lrs}")
        check_device(args.device)
        out = prepare_out_dir(args.out, overwrite=args.overwrite)
    except (ValueError, TypeError) as err:
        return fail("mqar", err)
    base, default_attentions = SETTINGS[args.setting]
    if args.quick:
        base = {**QUICK, "min_distance": min(base["min_distance"], QUICK["seq_len"] // 2)}
    attentions = args.attentions if args.attentions is not None else default_attentions
    settings = {k: (getattr(args, k) if getattr(args, k) is not None else v)
                for k, v in base.items()}  # fmt: skip
    try:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        rows = run_sweep(
            attentions,
            settings=settings,
            lrs=args.lrs,
            seed=args.seed,
            device=args.device,
            progress=not args.no_progress,
            on_row=lambda done: write_csv(done, out / "mqar.csv"),
        )
        print(format_table(rows))
        csv_path = write_csv(rows, out / "mqar.csv")
        title = (
            f"MQAR: T={settings['seq_len']}, {settings['num_kv_pairs']} pairs, "
            f"{settings['n_layer']} layers × {settings['n_embd']}"
        )
        if settings["min_distance"]:
            title += f", query ≥ {settings['min_distance']} after key"
        png_path = plot_sweep(rows, out / "mqar.png", title=title)
    except OSError as err:
        return fail("mqar", io_error(err, out))
    except (ValueError, TypeError, ImportError) as err:  # ImportError: matplotlib (plot extra)
        return fail("mqar", err)
    print(f"wrote {csv_path} and {png_path}")
    return 0
