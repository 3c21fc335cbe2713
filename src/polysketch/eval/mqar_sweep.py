"""MQAR recall vs decode-state size across attentions (Zoology / BASED's recall benchmark).

For every attention in the sweep, one ``TransformerLM`` of the same size is trained with the
same seed, data and schedule on multi-query associative recall (``polysketch.data.mqar``) and
scored on a held-out set by *recall accuracy*: the fraction of queried keys whose value is
the model's argmax next token. Each row also records the floats a model holds per sequence
while decoding at position T = ``seq_len`` (``TransformerLM.decode_state_size``): constant
for feature-map attention, 2·L·H·D·T for the softmax KV cache. Recall at a given state size is
the trade-off BASED's paper studies; softmax attention is the reference.

``run_sweep`` does the work; ``write_csv`` and ``plot_sweep`` save ``mqar.csv`` and
``mqar.png``; ``add_arguments`` / ``run_from_args`` back ``polysketch mqar``.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .._checks import check_positive_int
from ..data.mqar import MQARConfig
from ..nn import TransformerConfig, valid_attentions
from ..train import MQARData, TrainConfig, train
from .plots import log_axes, save_png, subplots

__all__ = [
    "DEFAULT_ATTENTIONS",
    "FULL",
    "QUICK",
    "run_sweep",
    "write_csv",
    "plot_sweep",
    "format_table",
    "add_arguments",
    "run_from_args",
]

DEFAULT_ATTENTIONS = (
    "softmax",
    "polysketch",
    "llops",
    "tensorsketch",
    "hybrid_angular",
    "taylor",
    "elu",
)

FULL = {
    "vocab_size": 256, "seq_len": 64, "num_kv_pairs": 8, "num_train": 20000, "num_val": 1000,
    "n_layer": 2, "n_head": 2, "n_embd": 64, "steps": 3000, "batch_size": 64, "lr": 1e-3,
    "warmup_steps": 100,
}  # fmt: skip
"""Default sizes: about Zoology's smallest MQAR setting (T = 64, 8 pairs, d_model 64). At this
budget softmax solves the task (recall 0.974 on a 2-core CPU, 4 minutes); with lr 3e-3 and
2000 steps it reached only 0.21."""

QUICK = {
    "vocab_size": 32, "seq_len": 16, "num_kv_pairs": 2, "num_train": 256, "num_val": 64,
    "n_layer": 2, "n_head": 2, "n_embd": 16, "steps": 8, "batch_size": 16, "lr": 3e-3,
    "warmup_steps": 2,
}  # fmt: skip
"""``--quick``: a smoke run (seconds for the whole sweep on a CPU); accuracies are not
meaningful at this size."""

COLUMNS = ("attention", "state_size", "params", "val_loss", "accuracy", "train_s")


def run_sweep(
    attentions: Sequence[str] = DEFAULT_ATTENTIONS,
    *,
    settings: dict | None = None,
    seed: int = 0,
    device: str | None = None,
    progress: bool = False,
    log=print,
) -> list[dict]:
    """Train and score one model per attention; returns rows with the ``COLUMNS`` keys.

    ``settings`` overrides keys of ``FULL`` (data sizes, model size, steps, batch, lr).
    """
    s = {**FULL, **(settings or {})}
    unknown = [a for a in attentions if a not in valid_attentions()]
    if unknown:
        raise ValueError(f"attentions: unknown {unknown}; choose from {valid_attentions()}")
    if not attentions:
        raise ValueError("attentions must name at least one attention")
    task = MQARConfig(
        vocab_size=s["vocab_size"], seq_len=s["seq_len"], num_kv_pairs=s["num_kv_pairs"]
    )
    data = MQARData.make(task, num_train=s["num_train"], num_val=s["num_val"], seed=seed)
    rows = []
    for name in attentions:
        model_config = TransformerConfig(
            vocab_size=task.vocab_size,
            block_size=task.seq_len,
            n_layer=s["n_layer"],
            n_head=s["n_head"],
            n_embd=s["n_embd"],
            attention=name,
            chunk_size=min(64, task.seq_len),
            seed=seed,
        )
        train_config = TrainConfig(
            steps=s["steps"],
            batch_size=s["batch_size"],
            block_size=task.seq_len,
            lr=s["lr"],
            min_lr=s["lr"] / 10,
            warmup_steps=s["warmup_steps"],
            weight_decay=0.1,
            eval_interval=None,
            seed=seed,
            device=device,
        )
        t0 = time.perf_counter()
        history = train(model_config, train_config, data, progress=progress)
        model, val = history["model"], history["val"][-1]
        row = {
            "attention": name,
            "state_size": model.decode_state_size(task.seq_len),
            "params": model.num_parameters(),
            "val_loss": val["loss"],
            "accuracy": val["accuracy"],
            "train_s": time.perf_counter() - t0,
        }
        rows.append(row)
        if log is not None:
            log(
                f"{name:>16s}: accuracy {row['accuracy']:.3f}  val loss {row['val_loss']:.3f}  "
                f"state {row['state_size']:,} floats  ({row['train_s']:.1f} s)"
            )
    return rows


def write_csv(rows: Sequence[dict], path) -> Path:
    """Write the sweep rows to ``path`` (CSV with ``COLUMNS``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows({k: r[k] for k in COLUMNS} for r in rows)
    return path


def plot_sweep(rows: Sequence[dict], path, *, title: str = "MQAR") -> Path:
    """Recall accuracy vs decode state size (log₂ x axis), one labelled point per attention."""
    fig, (ax,) = subplots(1, panel_size=(6.0, 4.0))
    for r in rows:
        marker = "*" if r["attention"] == "softmax" else "o"
        ax.scatter([r["state_size"]], [r["accuracy"]], marker=marker, s=60)
        ax.annotate(r["attention"], (r["state_size"], r["accuracy"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")  # fmt: skip
    log_axes(ax, x=True, y=False)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("decode state per sequence at T = seq_len (floats)")
    ax.set_ylabel("recall accuracy")
    ax.set_title(title)
    return save_png(fig, path)


def format_table(rows: Sequence[dict]) -> str:
    """A plain-text table of the rows, sorted by state size."""
    head = ("attention", "state floats", "params", "val loss", "acc")
    lines = ["{:>16s} {:>13s} {:>9s} {:>9s} {:>6s}".format(*head)]
    for r in sorted(rows, key=lambda r: r["state_size"]):
        lines.append(
            f"{r['attention']:>16s} {r['state_size']:>13,d} {r['params']:>9,d} "
            f"{r['val_loss']:>9.4f} {r['accuracy']:>6.3f}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``polysketch mqar`` options."""
    parser.add_argument("--attentions", nargs="+", default=list(DEFAULT_ATTENTIONS), metavar="NAME")
    parser.add_argument("--quick", action="store_true", help="tiny smoke-test sizes")
    for key, value in FULL.items():
        parser.add_argument(
            "--" + key.replace("_", "-"), type=type(value), default=None,
            help=f"(default {value}; --quick: {QUICK[key]})",
        )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--out", default="runs/mqar", help="folder for mqar.csv and mqar.png")
    parser.add_argument("--progress", action="store_true", help="progress bar per model")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the sweep, print the table, write CSV and PNG; 2 on bad input."""
    base = QUICK if args.quick else FULL
    settings = {k: (getattr(args, k) if getattr(args, k) is not None else v)
                for k, v in base.items()}  # fmt: skip
    try:
        if args.threads is not None:
            torch.set_num_threads(check_positive_int(args.threads, "threads"))
        rows = run_sweep(
            args.attentions,
            settings=settings,
            seed=args.seed,
            device=args.device,
            progress=args.progress,
        )
    except (ValueError, TypeError) as err:
        print(f"polysketch mqar: error: {err}", file=sys.stderr)
        return 2
    print(format_table(rows))
    out = Path(args.out)
    csv_path = write_csv(rows, out / "mqar.csv")
    png_path = plot_sweep(
        rows, out / "mqar.png",
        title=f"MQAR: T={settings['seq_len']}, {settings['num_kv_pairs']} pairs, "
        f"{settings['n_layer']} layers × {settings['n_embd']}",
    )  # fmt: skip
    print(f"wrote {csv_path} and {png_path}")
    return 0
