"""``polysketch mqar``: MQAR recall accuracy vs decode-state size across attentions.

Trains one small TransformerLM per attention (default: softmax, polysketch, llops,
tensorsketch, hybrid_angular, taylor, elu) with the same size, seed, data and schedule on
multi-query associative recall, prints recall accuracy against the floats each model keeps per
sequence while decoding, and writes ``mqar.csv`` and ``mqar.png`` into ``--out``. ``--quick``
runs a seconds-long smoke version. See ``polysketch.eval.mqar_sweep``.
"""

from __future__ import annotations

import argparse

from ..eval.mqar_sweep import add_arguments, run_from_args

__all__ = ["add_parser"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``mqar`` on the top-level CLI's ``subparsers``."""
    parser = subparsers.add_parser(
        "mqar",
        help="MQAR recall vs decode state size for several attentions (CSV, PNG)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)
    return parser
