"""The quality and speed sections of ``polysketch demo`` and the sizes of every section.

Each ``section_*(args, sizes, report, state) -> dict`` runs one section, adds its blocks to
``report`` (a ``polysketch.eval.report.Report``), prints its table and returns its numbers for
``results.json``; ``state`` carries what later sections reuse (trained models, the corpus).
``args`` is the parsed ``polysketch demo`` namespace (``out``, ``corpus``, ``seed``,
``lengths``, ``threads``, ``no_progress``). The fidelity section is in ``demo_fidelity``.

1. quality: the same tiny ``TransformerLM`` trained with exact softmax and with
   PolySketchFormer's ``psf_random`` attention (``polysketch`` if the preset is missing).
3. speed: causal attention time vs T against ``scaled_dot_product_attention``, the crossover
   length and decode-step time vs position (``polysketch.eval.bench``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

__all__ = ["DemoSizes", "FULL", "QUICK", "polysketch_attention", "section_quality", "section_speed"]


@dataclass(frozen=True)
class DemoSizes:
    """Sizes of every section (``FULL`` ≈ 10 minutes on 2 cores, ``QUICK`` ≈ 1 minute)."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch_size: int
    steps: int
    eval_interval: int
    eval_batches: int
    lr: float
    warmup_steps: int
    max_bytes: int | None  # corpus bytes read (None: all)
    sample_tokens: int
    capture_batch: int  # validation sequences run through the model to capture q/k
    num: int  # queries and keys per head in fidelity
    feature_dims: tuple[int, ...]
    trials: int
    fit_steps: int
    lengths: tuple[int, ...]
    min_time: float
    matmul_n: int


FULL = DemoSizes(
    n_layer=4, n_head=2, n_embd=64, block_size=128, batch_size=16, steps=600,
    eval_interval=50, eval_batches=8, lr=2e-3, warmup_steps=50, max_bytes=None,
    sample_tokens=240, capture_batch=8, num=256, feature_dims=(16, 32, 64, 128), trials=3,
    fit_steps=200, lengths=(256, 512, 1024, 2048, 4096, 8192), min_time=0.2, matmul_n=2048,
)  # fmt: skip
CUDA_FULL = DemoSizes(
    n_layer=6, n_head=6, n_embd=384, block_size=1024, batch_size=16, steps=600,
    eval_interval=100, eval_batches=8, lr=1e-3, warmup_steps=60, max_bytes=None,
    sample_tokens=400, capture_batch=8, num=256, feature_dims=(16, 32, 64, 128), trials=3,
    fit_steps=200, lengths=(1024, 2048, 4096, 8192, 16384, 32768, 65536), min_time=0.2,
    matmul_n=4096,
)  # fmt: skip
"""On a CUDA device: the paper's head dim 64 (6 × 384, 6 heads) at context 1024 trained under
bf16 autocast, and attention timed to 64k (forward, decode, and forward + backward)."""
QUICK = DemoSizes(
    n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=4, steps=8, eval_interval=4,
    eval_batches=2, lr=3e-3, warmup_steps=2, max_bytes=200_000, sample_tokens=30,
    capture_batch=2, num=48, feature_dims=(8, 16), trials=1, fit_steps=5,
    lengths=(64, 128, 256), min_time=0.0, matmul_n=256,
)  # fmt: skip


# ----- 1. quality -------------------------------------------------------------------------------
def polysketch_attention() -> str:
    """The polysketch attention the demo compares with softmax: ``psf_random`` if present."""
    from ..nn import PRESETS

    return "psf_random" if "psf_random" in PRESETS else "polysketch"


def section_quality(args, sizes: DemoSizes, report, state: dict) -> dict:
    from ..data.corpus import load_corpus
    from ..data.tokenizer import ByteTokenizer
    from ..nn import TransformerConfig
    from ..train import TrainConfig, train
    from .report import format_table, plot_loss_curves

    corpus = load_corpus(args.corpus, max_bytes=sizes.max_bytes)
    tok = ByteTokenizer()
    out = Path(args.out)
    length = max(8, sizes.block_size // 4)
    newlines = (corpus.val[: 4 * length] == ord("\n")).nonzero().flatten()
    start = int(newlines[0]) + 1 if len(newlines) else 0  # begin at a line start if one is near
    prompt_ids = corpus.val[start : start + length]
    if prompt_ids.numel() < 2:
        prompt_ids = corpus.val[:length]
    prompt = tok.decode(prompt_ids)
    runs, results = {}, []
    for attention in ("softmax", polysketch_attention()):
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
            seed=args.seed, out_dir=str(out / "runs" / attention), device=args.device,
            amp="bf16" if torch.device(args.device).type == "cuda" else None,
        )  # fmt: skip
        print(f"[quality] training {attention}: {sizes.steps} steps", flush=True)
        start = time.perf_counter()
        history = train(mc, tc, corpus, progress=not args.no_progress)
        seconds = time.perf_counter() - start
        model = history["model"]
        state.setdefault("models", {})[attention] = model
        gen = torch.Generator().manual_seed(args.seed)
        ids = model.generate(
            prompt_ids[None].to(next(model.parameters()).device), sizes.sample_tokens,
            temperature=0.8, top_k=20, generator=gen,
        )  # fmt: skip
        train_losses = [r["loss"] for r in history["train"]]
        tail = train_losses[-max(1, len(train_losses) // 10) :]
        val = history["val"][-1]
        runs[attention] = history
        results.append(
            {
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
        )
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


# ----- 3. speed ---------------------------------------------------------------------------------
def section_speed(args, sizes: DemoSizes, report, state: dict) -> dict:
    from .bench import (
        METHODS,
        BenchConfig,
        format_report,
        parse_lengths,
        plot_results,
        run_benchmark,
        write_csv,
    )

    out = Path(args.out)
    lengths = parse_lengths(args.lengths) if args.lengths else sizes.lengths
    cuda = torch.device(args.device).type == "cuda"
    config = BenchConfig(
        lengths=lengths, decode_positions=lengths, min_time=sizes.min_time, min_repeats=1,
        matmul_n=sizes.matmul_n, threads=args.threads,
        seed=args.seed, progress=not args.no_progress, device=args.device,
        dtype="bf16" if cuda else "fp32",
        # CPU keeps the demo's earlier methods and time budget; CUDA adds psf_mixed
        methods=METHODS if cuda else ("sdpa", "polysketch", "positive"),
    )  # fmt: skip
    print(f"[speed] causal attention and decoding at T in {list(lengths)}", flush=True)
    result = run_benchmark(config)
    training = None
    if cuda:  # training speed (forward + backward) against FlashAttention, bf16
        print(f"[speed] forward + backward at T in {list(lengths)}", flush=True)
        training = run_benchmark(replace(config, mode="train"))
        write_csv(training["rows"], out / "speed_train.csv")
    write_csv(result["rows"], out / "speed.csv")
    png = plot_results(result["rows"], out / "speed.png")
    rows = result["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    tables = {}
    for section, key, unit in (
        ("forward", "median_ms", "ms"),
        ("decode", "median_ms", "ms"),
        ("memory", "mem_mib", "MiB"),
    ):
        kind = "forward" if section == "forward" else "decode"
        found = {(r["method"], r["T"]): r for r in rows if r["section"] == kind}
        body = []
        for t in sorted({t for _, t in found}):
            cells = [found.get((m, t)) for m in methods]
            body.append([t] + [r[key] if r and r["status"] == "ok" else None for r in cells])
        first = "T" if section == "forward" else "position P"
        tables[section] = ([first] + [f"{m} {unit}" for m in methods], body)
    cfg = result["config"]
    report.heading("3. Speed and memory: causal attention and decoding")
    report.paragraph(
        f"Median wall time on {result['device']} with {result['threads']} threads, "
        f"{cfg.dtype} inputs, "
        f"B={cfg.batch}, H={cfg.heads}, D=E={cfg.head_dim}, block b={cfg.chunk_size}; "
        f"measured matmul peak {result['peak_gflops']:.1f} GFLOP/s. `sdpa` is "
        "torch.nn.functional.scaled_dot_product_attention (exact softmax, O(T²)); "
        f"`polysketch` is the psf_random map (r={cfg.sketch_dim}, squared) with the block "
        f"lower-triangular algorithm; `positive` is FAVOR+ with F={2 * cfg.plain_pairs}; "
        "feature maps included."
    )
    lines = []
    for name, s in result["summary"].items():
        cross = s["crossover"]
        lines.append(
            f"`{name}`: "
            + (f"faster than SDPA from T = {cross} on" if cross is not None
               else f"not faster than SDPA up to T = {max(lengths)} on this machine")
            + (f"; decode step time varies by ×{s['decode_max_over_min']:.2f} across positions"
               if s["decode_max_over_min"] is not None else "")
        )  # fmt: skip
    report.paragraph("Crossover: " + "; ".join(lines) + ".")
    report.heading("Causal forward time", level=3)
    report.table(*tables["forward"])
    report.heading("Decode step time (one new token at position P)", level=3)
    report.table(*tables["decode"])
    report.heading("Decoding memory per sequence: KV cache vs constant state (MiB)", level=3)
    report.table(*tables["memory"])
    if training is not None:
        trows = training["rows"]
        found = {(r["method"], r["T"]): r for r in trows}
        body = [
            [t] + [found[(m, t)]["median_ms"] if found.get((m, t), {}).get("status") == "ok"
                   else None for m in methods]
            for t in sorted({t for _, t in found})
        ]  # fmt: skip
        report.heading("Training step: forward + backward time (bf16)", level=3)
        report.paragraph(
            "`sdpa` is FlashAttention here (bf16 inputs on CUDA); our attentions run the "
            "`chunked` dispatch (fused Triton kernels when available, else the all-blocks "
            "layout) with the recomputing backward. Peak memory per call: `speed_train.csv`."
        )
        report.table(["T"] + [f"{m} ms" for m in methods], body)
        tables["train"] = (["T"] + [f"{m} ms" for m in methods], body)
        print(format_report(training), flush=True)
    report.image(png.name, "time vs sequence length (left) and decode step time vs position")
    report.paragraph("Full measurements (GFLOP/s, memory estimates): `speed.csv`.")
    print(format_report(result), flush=True)
    return {"summary": result["summary"], "tables": tables, "peak_gflops": result["peak_gflops"]}
