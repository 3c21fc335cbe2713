"""Language-model quality of attentions at equal model size, steps, data and seed.

PolySketchFormer §5 compares softmax, exact polynomial (degree 4) and sketched polynomial
attention by the perplexity of equally sized models trained identically. ``compare`` does that
on a byte-level corpus: one ``TransformerLM`` per attention, the same ``TransformerConfig``
except ``attention``, the same ``TrainConfig`` (so the same batches, schedule and
initialization of the shared weights), and returns each run's history. ``quality_table``
summarizes final / best validation loss (nats per byte; bits per byte = nats / ln 2),
parameters and throughput; ``plot_curves`` draws the training loss (running mean) and
validation loss against the step in one PNG.

``main`` is the command line; run it from the repository root::

    python -m experiments.quality [--steps 250] [--corpus shakespeare] [--out runs/quality]
        [--attentions softmax polynomial psf_random psf_learned] [--remedies] [--reuse] [--quick]

``--remedies`` adds the remedies of issue #10 (``remedy_attentions``; ``docs/quality_gap.md``).
Each label's result is saved as it finishes (``OUT/runs/LABEL.json``, checkpoint in
``OUT/runs/LABEL/``); ``--reuse`` skips labels whose result is there with the same settings.
Writes ``quality.csv``, ``quality.md`` (markdown table) and ``quality.png`` (loss curves) into
``--out``. The defaults (4 layers, 128 wide, 4 heads, block 256, batch 8) are sized for a few
minutes per attention on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch

from polysketch._files import write_csv
from polysketch.data.corpus import load_corpus
from polysketch.eval.plots import save_png, subplots
from polysketch.nn import PRESETS, TransformerConfig, valid_attentions
from polysketch.train import TrainConfig, train

__all__ = [
    "default_attentions",
    "remedy_attentions",
    "compare",
    "quality_table",
    "format_table",
    "plot_curves",
    "main",
]


def default_attentions() -> dict[str, tuple[str, dict]]:
    """label -> (attention, map_kwargs): softmax, exact degree-4 polynomial, PolySketchFormer
    (``psf_random`` if that preset exists, else polysketch non-negative degree 2, r = 32) and
    ``psf_learned`` when available."""
    out = {"softmax": ("softmax", {}), "polynomial": ("polynomial", {})}
    if "psf_random" in PRESETS:
        out["psf_random"] = ("psf_random", {})
    else:
        out["polysketch"] = ("polysketch", {"degree": 2, "num_features": 32, "nonnegative": True})
    if "psf_learned" in PRESETS:
        out["psf_learned"] = ("psf_learned", {})
    return out


def remedy_attentions(steps: int, warm_fraction: float = 0.3) -> dict[str, tuple]:
    """The remedies of issue #10 (``docs/quality_gap.md``), label -> (attention, map_kwargs,
    train overrides): ``psf_mixed``; ``psf_random`` with a polynomial warm start of
    ``warm_fraction·steps`` steps; with r = 64; with the public code's one-node sketch
    (``projection="product"``); ``psf_learned`` with the same warm start; ``psf_mixed`` at
    our former unbiased feature scale 1 (the preset now uses the public code's 1/√r, under
    which the far sketched scores weigh r² less than the exact local block); ``psf_learned``
    with normalizer offset 0 (its scores were ~1e-4 at torch's default init, so the 1 of 1 + Σ
    owned the normalizer); ``psf_random`` with both the one-node sketch and the warm start, and
    with both r = 64 (and r = 128) and the warm start; ``psf_learned`` with r = 64 and the
    warm start; ``psf_random`` without the q/k LayerNorm (the paper's §5 model names none;
    the public code has it), alone and with the warm start;
    and, as a reference rather than a remedy, exact degree-2 polynomial attention
    (``polynomial_degree2``): what a lower exact degree alone costs in the same
    configuration."""
    warm = {"warm_start_steps": max(1, int(round(warm_fraction * steps)))}
    return {
        "psf_mixed": ("psf_mixed", {}, {}),
        "psf_random+warm": ("psf_random", {}, warm),
        "psf_random_r64": ("psf_random", {"num_features": 64}, {}),
        "psf_random_product": ("psf_random", {"projection": "product"}, {}),
        "psf_learned+warm": ("psf_learned", {}, warm),
        "psf_mixed_unbiased_scale": ("psf_mixed", {"output_scale": 1.0}, {}),
        "psf_learned_offset0": ("psf_learned", {"denominator_offset": 0.0}, {}),
        "psf_random_product+warm": ("psf_random", {"projection": "product"}, warm),
        "psf_random_r64+warm": ("psf_random", {"num_features": 64}, warm),
        "psf_random_r128+warm": ("psf_random", {"num_features": 128}, warm),
        "psf_learned_r64+warm": ("psf_learned", {"num_features": 64}, warm),
        "psf_random_no_qk_norm": ("psf_random", {}, {}, {"qk_norm": False}),
        "psf_random_no_qk_norm+warm": ("psf_random", {}, warm, {"qk_norm": False}),
        "polynomial_degree2": ("polynomial", {"degree": 2}, {}),
    }


def compare(
    attentions: dict[str, tuple],
    corpus,
    model_config: TransformerConfig,
    train_config: TrainConfig,
    *,
    progress: bool = True,
    log=print,
) -> dict[str, dict]:
    """Train ``replace(model_config, attention=a, map_kwargs=kw)`` for each label -> (a, kw)
    or (a, kw, train_overrides) (fields of ``TrainConfig``, e.g. ``warm_start_steps``) or
    (a, kw, train_overrides, model_overrides) (fields of ``TransformerConfig``, e.g.
    ``qk_norm``).

    Returns label -> {"history": train rows, "val": val rows, "params", "train_s",
    "attention", "map_kwargs"}. ``train_config.out_dir`` (if set) gets one subfolder per label.
    """
    unknown = [spec[0] for spec in attentions.values() if spec[0] not in valid_attentions()]
    if unknown:
        raise ValueError(f"attentions: unknown {unknown}; choose from {valid_attentions()}")
    results = {}
    for label, (attention, map_kwargs, *extra) in attentions.items():
        train_overrides, model_overrides = (*extra, {}, {})[:2]
        mc = replace(model_config, attention=attention, map_kwargs=dict(map_kwargs),
                     **model_overrides)  # fmt: skip
        tc = replace(train_config, **train_overrides)
        if tc.out_dir is not None:
            tc = replace(tc, out_dir=str(Path(tc.out_dir) / label))
        t0 = time.perf_counter()
        history = train(mc, tc, corpus, progress=progress)
        results[label] = {
            "attention": attention,
            "map_kwargs": dict(map_kwargs),
            "train_overrides": dict(train_overrides),
            "model_overrides": dict(model_overrides),
            "history": history["train"],
            "val": history["val"],
            "params": history["model"].num_parameters(),
            "train_s": time.perf_counter() - t0,
        }
        if log is not None:
            v = history["val"][-1]
            log(f"{label:>12s}: val loss {v['loss']:.4f} ({results[label]['train_s']:.0f} s)")
    return results


def quality_table(results: dict[str, dict]) -> list[dict]:
    """One row per label: final and best validation loss (nats/byte), bits/byte, params,
    mean tokens/s, wall time."""
    rows = []
    for label, r in results.items():
        final = r["val"][-1]["loss"]
        tps = [h["tokens_per_s"] for h in r["history"][1:]] or [r["history"][0]["tokens_per_s"]]
        rows.append(
            {
                "attention": label,
                "val_loss": final,
                "best_val_loss": min(v["loss"] for v in r["val"]),
                "bits_per_byte": final / math.log(2),
                "val_accuracy": r["val"][-1]["accuracy"],
                "params": r["params"],
                "tokens_per_s": sum(tps) / len(tps),
                "train_s": r["train_s"],
            }
        )
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """A markdown table of ``quality_table`` rows."""
    lines = [
        "| attention | val loss (nats/byte) | bits/byte | best val | next-byte acc | params "
        "| tokens/s | time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['attention']} | {r['val_loss']:.4f} | {r['bits_per_byte']:.4f} "
            f"| {r['best_val_loss']:.4f} | {r['val_accuracy']:.4f} | {r['params']:,} "
            f"| {r['tokens_per_s']:.0f} | {r['train_s']:.0f} |"
        )
    return "\n".join(lines)


def _running_mean(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(results: dict[str, dict], path, *, title: str = "", window: int = 20) -> Path:
    """Training loss (running mean over ``window`` steps) and validation loss vs step."""
    fig, (ax_train, ax_val) = subplots(2, panel_size=(5.5, 4.0))
    for i, (label, r) in enumerate(results.items()):
        steps = [h["step"] for h in r["history"]]
        (line,) = ax_train.plot(
            steps,
            _running_mean([h["loss"] for h in r["history"]], window),
            label=label,
            ls="-" if i < 10 else "--",  # the default color cycle has 10 colors
        )
        ax_val.plot(
            [v["step"] for v in r["val"]],
            [v["loss"] for v in r["val"]],
            marker="o",
            ms=3,
            ls=line.get_linestyle(),
            color=line.get_color(),
            label=label,
        )
    ax_train.set_title(f"training loss (mean of {window} steps)")
    ax_val.set_title("validation loss")
    for ax in (ax_train, ax_val):
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/byte)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_png(fig, path)


def main(argv=None) -> int:
    """The command line of the module docstring; returns the exit status."""
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
