"""Long context (issue 21 §1): does an attention use what lies far back? One table per
sub-command, each writing CSV + PNG + a markdown table to ``--out`` (default
``docs/results/long_context/TABLE``), resumable with ``--reuse``, with a seconds-long
``--smoke`` mode that the tests run.

Sub-commands (``python benchmarks/long_context.py CMD --help``):

  retrieval   kernel-level weight on the matching key among t = 64 … 64k keys
  repeat      repeat (copy) probe: loss on a passage's recurrence vs its first occurrence,
              the counterfactual and the global-part ablation; also the softmax budget
  positions   loss by position bucket on long documents; extrapolation past the train length
  mqar        long-range MQAR: every query farther from its key than any exact local window
  mqar-diagnose  what saved MQAR models' soft-hash far branches see (weight on the answer)
  timing      seconds per training step of the planned model sizes, per attention
  grid        the copy probe over distances × schedules × batch sizes × seeds (issue 44):
              softmax's onset, a candidate's gain at 1.5× it and at the budget, ablated
  grid-collect  one grid's tables and report from cells measured into several folders
  heldout     the held-out table of a grid run to its budget (issue 70): gains as means of
              three evaluations, the target per cell

The experiments live in ``experiments/long_context/`` (the repository root goes on
``sys.path``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/

from experiments.long_context import (  # noqa: E402
    grid_cli,
    grid_collect_cli,
    heldout_cli,
    mqar_cli,
    mqar_diagnose_cli,
    positions_cli,
    repeat_cli,
    retrieval_cli,
    timing_cli,
)

from polysketch import hold_freed_memory  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="long_context.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    modules = (retrieval_cli, repeat_cli, positions_cli, mqar_cli, mqar_diagnose_cli,
               timing_cli, grid_cli, grid_collect_cli, heldout_cli)  # fmt: skip
    for module in modules:
        module.register(sub)
    return parser


def main(argv=None) -> int:
    hold_freed_memory()  # training steps reuse their pages (polysketch._malloc), as the CLI's
    args = build_parser().parse_args(argv)
    return args.run(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
