"""LLoPS Table 3 on our models: RMAE (Eq. 21) of the PSF random sketch vs the fitted LLoPS map
on queries/keys captured from MQAR models trained with exact polynomial attention (p = 2, 3);
see ``experiments/llops_table3.py``.

Usage: python benchmarks/llops_table3.py [--out runs/llops_table3] [--steps 2000]
       [--degrees 2 3] [--feature-dims 64 256] [--fit-steps 1000] [--num 512] [--fit-num 4096]
       [--threads N]
       [--quick] [--reuse-captures]

Each (layer, head) is measured as ``polysketch approx --source TEST --fit-source FIT`` does, on
the captured files (kept in ``OUT/qk/``, so any other map can be measured on them later). Writes
``table3.csv``, ``table3.md`` and ``table3.png`` into ``--out``. ``--reuse-captures`` skips the
training and measures the files already in ``OUT/qk``. The defaults (README's run)
took 52 minutes of wall time on one CPU core while another job used the other (two models of
about 10 minutes each, then 12 ``approx`` runs of about 80 s); ``--quick`` is a seconds-long
smoke run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from polysketch.eval.mqar_sweep import QUICK

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: experiments

from experiments.llops_table3 import SETTINGS, run  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/llops_table3")
    parser.add_argument("--steps", type=int, default=SETTINGS["steps"])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--degrees", nargs="+", type=int, default=[2, 3])
    parser.add_argument("--feature-dims", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--fit-steps", type=int, default=1000)
    parser.add_argument("--num", type=int, default=512)
    parser.add_argument("--fit-num", type=int, default=4096, help="fitting vectors per head")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny smoke-test sizes")
    parser.add_argument(
        "--reuse-captures",
        action="store_true",
        help="measure the q/k files an earlier run left in OUT/qk (no training)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = {"steps": args.steps}
    if args.quick:
        settings = {**QUICK, "n_layer": 3, "steps": 4}
        args.feature_dims, args.fit_steps, args.num, args.trials = [8], 5, 32, 1
    run(args.out, degrees=args.degrees, settings=settings, lr=args.lr,
        feature_dims=args.feature_dims, fit_steps=args.fit_steps, num=args.num,
        fit_num=args.fit_num,
        trials=args.trials, seed=args.seed, reuse_captures=args.reuse_captures)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
