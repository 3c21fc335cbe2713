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

from .._checks import check_positive_int
from ..eval.mqar_sweep import add_arguments, parse_attention, run_from_args
from ._common import add_overwrite_argument, check_device, fail, io_error, prepare_out_dir

__all__ = ["add_parser", "run"]


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


def run(args: argparse.Namespace) -> int:
    """Check the options, ``--device`` and ``--out`` (error line, 2), then run the sweep."""
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
    try:
        return run_from_args(args)
    except OSError as err:
        return fail("mqar", io_error(err, out))
