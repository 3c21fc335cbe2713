"""Validation loss of softmax vs exact polynomial vs PolySketchFormer attention (same model size,
steps, data and seed), on the default corpus; see ``experiments/quality.py``.

Usage: python benchmarks/quality.py [--steps 250] [--corpus shakespeare] [--out runs/quality]
       [--attentions softmax polynomial psf_random psf_learned] [--remedies] [--reuse]
       [--quick]

``--remedies`` adds the remedies of issue #10 (``experiments.quality.remedy_attentions``: psf_mixed,
polynomial warm start, r = 64, the public code's one-node sketch; ``docs/quality_gap.md``).
Each label's result is saved as it finishes (``OUT/runs/LABEL.json``, checkpoint in
``OUT/runs/LABEL/``); ``--reuse`` skips labels whose result is there with the same settings.

Writes ``quality.csv``, ``quality.md`` (markdown table) and ``quality.png`` (loss curves) into
``--out``. The defaults (4 layers, 128 wide, 4 heads, block 256, batch 8) are sized so the four
runs take about 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from polysketch._files import write_csv
from polysketch.data.corpus import load_corpus
from polysketch.nn import TransformerConfig
from polysketch.train import TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: experiments

from experiments.quality import (  # noqa: E402
    compare,
    default_attentions,
    format_table,
    plot_curves,
    quality_table,
    remedy_attentions,
)


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
    p.add_argument("--remedies", action="store_true", help="add the issue #10 remedies")
    p.add_argument("--warm-fraction", type=float, default=0.3, help="warm start: share of steps")
    p.add_argument("--reuse", action="store_true", help="skip labels already run (same setup)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.n_layer, args.n_embd, args.block_size = 20, 1, 32, 64
        args.eval_interval, args.eval_batches, args.max_bytes = 10, 2, 200_000

    choices = dict(default_attentions())
    if args.remedies:
        choices.update(remedy_attentions(args.steps, args.warm_fraction))
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
    out = Path(args.out)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    train_config.out_dir = str(runs)
    train_key = {k: v for k, v in asdict(train_config).items() if k != "out_dir"}
    # the output folder does not change a result: runs copied between folders are reused
    key = {"model": asdict(model_config), "train": train_key, "corpus": corpus.source}
    results = {}
    for label in labels:  # one at a time, saved as it finishes (--reuse skips finished ones)
        path = runs / f"{label.replace('/', '_')}.json"
        spec = [choices[label][0], choices[label][1], *choices[label][2:]]
        if args.reuse and path.is_file():
            saved = json.loads(path.read_text())
            if saved["key"] == json.loads(json.dumps(key)) and saved["spec"] == spec:
                results[label] = saved["result"]
                print(f"{label:>12s}: reused {path}")
                continue
        one = {label: choices[label]}
        results.update(
            compare(one, corpus, model_config, train_config, progress=not args.no_progress)
        )
        path.write_text(json.dumps({"key": key, "spec": spec, "result": results[label]}))
    rows = quality_table(results)
    table = format_table(rows)
    setup = (
        f"corpus={corpus.source} ({len(corpus.train):,} train / {len(corpus.val):,} val bytes), "
        f"{args.n_layer} layers × {args.n_embd}, {args.n_head} heads, block {args.block_size}, "
        f"batch {args.batch_size}, {args.steps} steps, lr {args.lr}, seed {args.seed}, "
        f"threads {torch.get_num_threads()}; {sum(r['train_s'] for r in results.values()):.0f} s "
        f"of training in all ({time.perf_counter() - t0:.0f} s in this invocation)"
    )
    print(setup)
    print(table)
    write_csv(rows, out / "quality.csv")
    (out / "quality.md").write_text(setup + "\n\n" + table + "\n")
    (out / "curves.json").write_text(
        json.dumps({k: {"train": r["history"], "val": r["val"]} for k, r in results.items()})
    )
    plot_curves(results, out / "quality.png", title=f"{corpus.source}: {args.steps} steps")
    print(f"wrote {out / 'quality.csv'}, {out / 'quality.md'}, {out / 'quality.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
