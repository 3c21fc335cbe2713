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
import time
from pathlib import Path

import torch

from ...data.corpus import load_corpus
from ...data.tokenizer import ByteTokenizer
from ...nn import TransformerConfig
from ...train import TrainConfig, train
from ..tables import format_table
from .figures import plot_loss_curves
from .settings import DemoSizes, polysketch_attention

__all__ = ["section_quality"]


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
    start = time.perf_counter()
    history = train(mc, tc, corpus, progress=not args.no_progress)
    seconds = time.perf_counter() - start
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
        "tokens_per_s": history["train"][-1]["tokens"] / max(seconds, 1e-9),
        "state_floats_at_block": model.decode_state_size(sizes.block_size),
        "state_floats_at_8192": model.decode_state_size(8192),
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

    headers = ["attention", "params", "steps", "train loss", "val loss", "val bits/byte",
               "val next-byte acc", "train s", "tokens/s", f"decode floats @T={sizes.block_size}",
               "decode floats @T=8192"]  # fmt: skip
    keys = ["attention", "parameters", "steps", "train_loss", "val_loss", "val_bits_per_byte",
            "val_accuracy", "train_seconds", "tokens_per_s", "state_floats_at_block",
            "state_floats_at_8192"]  # fmt: skip
    rows = [[r[k] for k in keys] for r in results]
    soft, ours = results[0], results[1]
    report.heading("1. Quality: the same tiny language model, softmax vs polysketch attention")
    report.paragraph(
        f"Both models: {sizes.n_layer} layer(s), {sizes.n_head} heads, width {sizes.n_embd}, "
        f"context {sizes.block_size} bytes, {sizes.steps} AdamW steps of {sizes.batch_size} "
        f"sequences, seed {args.seed}, byte-level corpus `{corpus.source}` "
        f"({corpus.train.numel():,} training / {corpus.val.numel():,} validation bytes). "
        f"`{ours['attention']}` reached validation loss {ours['val_loss']:.3f} vs "
        f"{soft['val_loss']:.3f} for exact softmax (difference "
        f"{ours['val_loss'] - soft['val_loss']:+.3f} nats/byte), while its decoding state is "
        f"{ours['state_floats_at_8192']:,} floats at any length instead of a KV cache of "
        f"{soft['state_floats_at_8192']:,} floats at T = 8192."
    )
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
