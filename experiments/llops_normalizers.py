"""Signed LLoPS scores inside normalized attention: how many normalizers go negative.

Trains one MQAR model of ``polysketch mqar --setting llops`` (d_model 128, 2 layers, short
convolutions) with the given attention spec for ``--steps`` steps, then reports
``experiments.quality_diagnosis.normalizer_sign_stats`` per layer on validation
sequences: the share of negative scores and normalizers, and how much of Σ|s| cancels. Step 0
reports the freshly built model.

    python -m experiments.llops_normalizers \\
        --attention "llops:num_features=256,degree=4,init='monomial'" --lr 1e-3 --steps 400
"""

from __future__ import annotations

import argparse
import time

import torch

from polysketch.eval import mqar_sweep
from polysketch.nn import TransformerLM

from .quality_diagnosis import normalizer_sign_stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attention", default="llops:num_features=256,degree=4")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=400, help="0: the freshly built model")
    p.add_argument("--sequences", type=int, default=32, help="validation sequences measured")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = {**mqar_sweep.LLOPS, "steps": max(args.steps, 1)}
    data = mqar_sweep.make_data(settings)
    name, model_options, map_kwargs = mqar_sweep.parse_attention(args.attention)
    t0 = time.perf_counter()
    if args.steps == 0:
        torch.manual_seed(0)
        model = TransformerLM(
            mqar_sweep.model_config_for(
                name, data, settings=settings, model_options=model_options, map_kwargs=map_kwargs
            )
        )
        note = "freshly built"
    else:
        history = mqar_sweep.train_one(
            name, data, settings=settings, lr=args.lr, model_options=model_options,
            map_kwargs=map_kwargs, progress=True,
        )  # fmt: skip
        model = history["model"]
        val = history["val"][-1]
        note = f"after {args.steps} steps at lr {args.lr:g}: val loss {val['loss']:.3f}, "
        note += f"recall {val['accuracy']:.3f}"
    print(f"{args.attention} {note} ({time.perf_counter() - t0:.0f} s)")
    model.eval()
    for r in normalizer_sign_stats(model, data.val_inputs[: args.sequences]):
        print(
            f"  layer {r['layer']}: median |s| {r['median_abs_score']:.3g}, negative scores "
            f"{r['negative_scores']:.2f}, negative normalizers {r['negative_normalizers']:.2f}, "
            f"median |Σs|/Σ|s| {r['median_kept']:.3f}, rows with |Σs| < 0.1 Σ|s| "
            f"{r['cancelled_rows']:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
