"""Section 1 of ``polysketch demo``: the same tiny ``TransformerLM`` trained with exact softmax
and with PolySketchFormer's ``psf_random`` attention (``polysketch`` if the preset is missing).

Each ``section_*(args, sizes, report, state) -> dict`` (here and in ``fidelity``, ``speed``)
runs one section, adds its blocks to ``report`` (a ``polysketch.eval.demo.report.Report``),
prints its table and returns its numbers for ``results.json``; ``state`` carries what later
sections reuse (trained models, the corpus). ``args`` is the parsed ``polysketch demo``
namespace (``out``, ``corpus``, ``seed``, ``lengths``, ``threads``, ``device``,
``no_progress``).
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch

from ...data.corpus import load_corpus
from ...data.tokenizer import ByteTokenizer
from ...nn import TransformerConfig
from ...train import TrainConfig, train
from ..tables import format_table
from .figures import plot_loss_curves
from .report import load_average
from .settings import DemoSizes, polysketch_attention

__all__ = ["section_quality", "state_crossover", "step_throughput"]


def step_throughput(history: dict) -> tuple[float, float, float]:
    """(median, 10th, 90th percentile) of the per-step training tokens/s of a ``train``
    history, leaving out the first 5% of the steps (warm-up; at least the first step).
    Per-step rates time the optimizer step alone (no evaluation, no checkpoint)."""
    rates = [r["tokens_per_s"] for r in history["train"]]
    rates = rates[max(1, len(rates) // 20) :] or rates
    if len(rates) < 2:
        return rates[0], rates[0], rates[0]
    deciles = statistics.quantiles(rates, n=10, method="inclusive")
    return statistics.median(rates), deciles[0], deciles[-1]


def _whole(x: float) -> int:
    return int(round(x))


def state_crossover(model, kv_model) -> tuple[int, int]:
    """(KV-cache floats per token of ``kv_model``, the least T from which ``model``'s decode
    state is never larger than ``kv_model``'s KV cache).

    ``kv_model`` must keep a KV cache (decode floats exactly proportional to T: P·T).
    ``model``'s decode floats are bounded by their largest value over the first two blocks
    and its window (constant for linear attention; periodic in T for mixed attention), S;
    then P·T ≥ S for every T ≥ ⌈S / P⌉.
    """
    config = model.config
    horizon = 2 * max(config.chunk_size, kv_model.config.chunk_size) + (config.local_window or 0)
    per_token = kv_model.decode_state_size(1)
    if per_token <= 0 or any(
        kv_model.decode_state_size(t) != per_token * t for t in range(2, horizon + 2)
    ):
        raise ValueError("kv_model must decode from a KV cache (floats proportional to T)")
    bound = max(model.decode_state_size(t) for t in range(1, horizon + 1))
    return per_token, -(-bound // per_token)


def _prompt(val, length: int):
    """The first ``length`` validation bytes from the first line start among the first
    ``4 · length`` bytes (the very start when there is none)."""
    newlines = (val[: 4 * length] == ord("\n")).nonzero().flatten()
    start = int(newlines[0]) + 1 if len(newlines) else 0  # begin at a line start if one is near
    prompt_ids = val[start : start + length]
    return prompt_ids if prompt_ids.numel() >= 2 else val[:length]


def _train_one(attention: str, corpus, sizes: DemoSizes, args, prompt_ids, tok):
    """(history, result row) of one model trained with ``attention``; the row's ``sample``
    continues ``prompt_ids`` (temperature 0.8, top-k 20, seeded)."""
    mc = TransformerConfig(
        vocab_size=corpus.vocab_size, block_size=sizes.block_size, n_layer=sizes.n_layer,
        n_head=sizes.n_head, n_embd=sizes.n_embd, attention=attention,
        chunk_size=min(64, sizes.block_size), seed=args.seed,
    )  # fmt: skip
    tc = TrainConfig(
        steps=sizes.steps, batch_size=sizes.batch_size, lr=sizes.lr, min_lr=sizes.lr / 10,
        warmup_steps=min(sizes.warmup_steps, sizes.steps // 4),
        eval_interval=max(1, min(sizes.eval_interval, sizes.steps)),
        eval_batches=sizes.eval_batches, log_interval=max(1, sizes.steps // 20),
        seed=args.seed, out_dir=str(Path(args.out) / "runs" / attention), device=args.device,
        amp="bf16" if torch.device(args.device).type == "cuda" else None,
    )  # fmt: skip
    print(f"[quality] training {attention}: {sizes.steps} steps", flush=True)
    load_before = load_average()
    start = time.perf_counter()
    history = train(mc, tc, corpus, progress=not args.no_progress)
    seconds = time.perf_counter() - start
    load_after = load_average()
    rate, rate_low, rate_high = step_throughput(history)
    model = history["model"]
    gen = torch.Generator().manual_seed(args.seed)
    ids = model.generate(
        prompt_ids[None].to(next(model.parameters()).device), sizes.sample_tokens,
        temperature=0.8, top_k=20, generator=gen,
    )  # fmt: skip
    train_losses = [r["loss"] for r in history["train"]]
    tail = train_losses[-max(1, len(train_losses) // 10) :]
    val = history["val"][-1]
    row = {
        "attention": attention,
        "parameters": model.num_parameters(),
        "steps": sizes.steps,
        "train_loss": sum(tail) / len(tail),
        "val_loss": val["loss"],
        "val_bits_per_byte": val["loss"] / math.log(2),
        "val_accuracy": val["accuracy"],
        "train_seconds": seconds,
        "tokens_per_s": _whole(rate),
        "tokens_per_s_p10": _whole(rate_low),
        "tokens_per_s_p90": _whole(rate_high),
        "load_average": [load_before, load_after],
        "state_floats_at_block": model.decode_state_size(sizes.block_size),
        "sample": tok.decode(ids[0, len(prompt_ids) :]),
        "checkpoint": str(Path(tc.out_dir) / "ckpt.pt"),
    }
    return history, row


def section_quality(args, sizes: DemoSizes, report, state: dict) -> dict:
    """Train softmax and the polysketch attention on ``args.corpus``; report and return the
    losses, speeds, decode-state sizes and samples."""
    corpus = load_corpus(args.corpus, max_bytes=sizes.max_bytes)
    tok = ByteTokenizer()
    out = Path(args.out)
    prompt_ids = _prompt(corpus.val, max(8, sizes.block_size // 4))
    prompt = tok.decode(prompt_ids)
    runs, results = {}, []
    for attention in ("softmax", polysketch_attention()):
        runs[attention], row = _train_one(attention, corpus, sizes, args, prompt_ids, tok)
        state.setdefault("models", {})[attention] = runs[attention]["model"]
        results.append(row)
    state["corpus"] = corpus
    png = plot_loss_curves(runs, out / "quality_loss.png")
    soft, ours = results[0], results[1]
    per_token, crossover = state_crossover(runs[ours["attention"]]["model"],
                                           runs["softmax"]["model"])  # fmt: skip
    soft["kv_floats_per_token"], ours["state_smaller_from_T"] = per_token, crossover

    headers = ["attention", "params", "steps", "train loss", "val loss", "val bits/byte",
               "val next-byte acc", "train s", "tokens/s (median step)", "tokens/s p10",
               "tokens/s p90", f"decode floats @T={sizes.block_size}",
               "state ≤ KV cache from T"]  # fmt: skip
    keys = ["attention", "parameters", "steps", "train_loss", "val_loss", "val_bits_per_byte",
            "val_accuracy", "train_seconds", "tokens_per_s", "tokens_per_s_p10",
            "tokens_per_s_p90", "state_floats_at_block", "state_smaller_from_T"]  # fmt: skip
    rows = [[r.get(k) for k in keys] for r in results]
    block = sizes.block_size
    kv_at_block = per_token * block
    state_text = (
        f"Decoding: `{ours['attention']}` keeps {ours['state_floats_at_block']:,} floats per "
        f"sequence at any length; softmax's KV cache grows by {per_token:,} floats per token "
        f"({kv_at_block:,} at the trained context T = {block}), so the state is the smaller "
        f"one from T = {crossover:,} on"
    )
    if crossover > block:
        state_text += (
            f", {crossover / block:.1f}× the context these models were trained at: at "
            f"T = {block} the state is {ours['state_floats_at_block'] / kv_at_block:.1f}× "
            "the KV cache"
        )
    report.heading("1. Quality: the same tiny language model, softmax vs polysketch attention")
    report.paragraph(
        f"Both models: {sizes.n_layer} layer(s), {sizes.n_head} heads, width {sizes.n_embd}, "
        f"context {block} bytes, {sizes.steps} AdamW steps of {sizes.batch_size} "
        f"sequences, seed {args.seed}, byte-level corpus `{corpus.source}` "
        f"({corpus.train.numel():,} training / {corpus.val.numel():,} validation bytes). "
        f"`{ours['attention']}` reached validation loss {ours['val_loss']:.3f} vs "
        f"{soft['val_loss']:.3f} for exact softmax (difference "
        f"{ours['val_loss'] - soft['val_loss']:+.3f} nats/byte). {state_text}."
    )
    report.paragraph(_throughput_text(soft, ours, block))
    report.table(headers, rows)
    report.image(png.name, "training (moving average) and validation loss per step")
    report.paragraph(
        "Samples (temperature 0.8, top-k 20, the same sampling seed) continuing the first "
        "validation bytes:"
    )
    report.pre(f"prompt: {prompt!r}")
    for r in results:
        report.pre(f"[{r['attention']}]\n{prompt}{r['sample']}")
    report.paragraph(
        "Checkpoints are in `runs/<attention>/ckpt.pt` (continue with `polysketch generate "
        "--checkpoint ...`); per-step metrics in `runs/<attention>/metrics.csv`."
    )
    print(format_table(headers, rows), flush=True)
    return {"runs": results, "prompt": prompt}


def _throughput_text(soft: dict, ours: dict, block: int) -> str:
    """What the tokens/s columns support: the median step rates and whether the per-step
    10–90% ranges separate the two models (the models train one after the other, so a
    change of load between them moves the ratio: the load averages are given)."""
    ratio = ours["tokens_per_s"] / soft["tokens_per_s"]
    if ours["tokens_per_s_p10"] > soft["tokens_per_s_p90"]:
        verdict = f"`{ours['attention']}` trained faster ({ratio:.2f}× softmax's median rate)"
    elif ours["tokens_per_s_p90"] < soft["tokens_per_s_p10"]:
        verdict = f"`{ours['attention']}` trained slower ({ratio:.2f}× softmax's median rate)"
    else:
        verdict = (f"the 10–90% ranges of the step rates overlap (median ratio {ratio:.2f}): "
                   "no difference is claimed")  # fmt: skip
    loads = "; ".join(f"{r['attention']} {_loads(r['load_average'])}" for r in (soft, ours))
    return (
        f"Training speed (tokens/s of each optimizer step, median and 10th–90th percentile "
        f"over the steps after warm-up) at context {block}: {verdict}. At this short context "
        "the attention is a small part of a step; section 3 times attention alone at longer "
        f"T. 1-minute load average before–after each training: {loads} "
        "(on a loaded machine the rates are lower and noisier)."
    )


def _loads(pair) -> str:
    known = [x for x in pair if x is not None]
    return "–".join(f"{x:.2f}" for x in known) if known else "unknown"
