"""Validation loss of softmax vs exact polynomial vs PolySketchFormer attention (same model size,
steps, data and seed), on the default corpus; see ``polysketch.eval.quality``.

Usage: python benchmarks/quality.py [--steps 250] [--corpus shakespeare] [--out runs/quality]
       [--attentions softmax polynomial psf_random psf_learned] [--quick]

Writes ``quality.csv``, ``quality.md`` (markdown table) and ``quality.png`` (loss curves) into
``--out``. The defaults (4 layers, 128 wide, 4 heads, block 256, batch 8) are sized so the four
runs take about 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import torch

from polysketch.data.corpus import load_corpus
from polysketch.eval.quality import (
    compare,
    default_attentions,
    format_table,
    plot_curves,
    quality_table,
)
from polysketch.nn import TransformerConfig
from polysketch.train import TrainConfig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="shakespeare")
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("--attentions", nargs="+", default=None, help="labels of the defaults")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--out", default="runs/quality")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.n_layer, args.n_embd, args.block_size = 20, 1, 32, 64
        args.eval_interval, args.eval_batches, args.max_bytes = 10, 2, 200_000

    choices = default_attentions()
    labels = args.attentions or list(choices)
    missing = [a for a in labels if a not in choices]
    if missing:
        p.error(f"--attentions: unknown {missing}; choose from {list(choices)}")
    corpus = load_corpus(args.corpus, max_bytes=args.max_bytes)
    model_config = TransformerConfig(
        vocab_size=corpus.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        chunk_size=64,
        seed=args.seed,
    )
    train_config = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        block_size=args.block_size,
        lr=args.lr,
        min_lr=args.lr / 10,
        warmup_steps=max(1, args.steps // 20),
        eval_interval=args.eval_interval,
        eval_batches=args.eval_batches,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    results = compare(
        {k: choices[k] for k in labels},
        corpus,
        model_config,
        train_config,
        progress=not args.no_progress,
    )
    rows = quality_table(results)
    table = format_table(rows)
    setup = (
        f"corpus={corpus.source} ({len(corpus.train):,} train / {len(corpus.val):,} val bytes), "
        f"{args.n_layer} layers × {args.n_embd}, {args.n_head} heads, block {args.block_size}, "
        f"batch {args.batch_size}, {args.steps} steps, lr {args.lr}, seed {args.seed}; "
        f"{time.perf_counter() - t0:.0f} s in all"
    )
    print(setup)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "quality.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "quality.md").write_text(setup + "\n\n" + table + "\n")
    (out / "curves.json").write_text(
        json.dumps({k: {"train": r["history"], "val": r["val"]} for k, r in results.items()})
    )
    plot_curves(results, out / "quality.png", title=f"{corpus.source}: {args.steps} steps")
    print(f"wrote {out / 'quality.csv'}, {out / 'quality.md'}, {out / 'quality.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
