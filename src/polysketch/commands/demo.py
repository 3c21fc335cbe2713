"""``polysketch demo``: what polysketch is for, measured on this machine, as a report.

Writes ``--out`` (default ``demo-report/``) with ``README.md`` and ``index.html`` (same
blocks, PNGs referenced by relative path) and ``results.json`` (every number in the report).
Three sections, each printing its table when it finishes:

1. quality — the same tiny ``TransformerLM`` (same size, steps, seed, data order) trained on
   ``--corpus`` with exact softmax attention and with PolySketchFormer's ``psf_random``
   attention (linear time; ``polysketch`` if the preset is missing): loss curves, final
   validation loss, a generated sample from the same prompt with the same sampling seed.
2. fidelity — kernel error ‖φq(Q)φk(K)ᵀ − E‖_F/‖E‖_F vs feature dim of every feature map
   against its target kernel E (polynomial maps at degree 4: (q·k)^4; softmax random
   features: exp(q·k/√D)), on the queries/keys the trained models feed their attention
   (after the q/k LayerNorm and RoPE, ``polysketch.eval.capture``) and on Gaussian data; and
   the ratio to the Eckart–Young optimum of any map with that state size (LLoPS Thm 3.1).
3. speed — causal attention time vs T against ``scaled_dot_product_attention``, the
   crossover length, and decode-step time vs position (``polysketch.eval.bench``).

Every number comes from this run (with ``--sections fidelity`` alone, the captured q/k come
from the models a previous run saved in ``--out/runs``, and the report says so). ``--quick``
is a one-minute version (tiny model, few steps, short sequences) used by the tests.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .._checks import check_positive_int

__all__ = ["DemoSizes", "FULL", "QUICK", "SECTIONS", "add_parser", "run"]

SECTIONS = ("quality", "fidelity", "speed")
MAX_FEATURE_DIM = 2**14  # fidelity: maps with more features (exact maps at degree 4) are skipped
NOT_CALIBRATED = frozenset({"learned_polysketch"})  # trained inside a model (psf_learned), not
# fitted to a kernel: at initialisation its kernel error says nothing, and fitting it is slow


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
    max_repeats: int
    matmul_n: int


FULL = DemoSizes(
    n_layer=4, n_head=2, n_embd=64, block_size=128, batch_size=16, steps=600,
    eval_interval=50, eval_batches=8, lr=2e-3, warmup_steps=50, max_bytes=None,
    sample_tokens=240, capture_batch=8, num=256, feature_dims=(16, 32, 64, 128), trials=3,
    fit_steps=200, lengths=(256, 512, 1024, 2048, 4096, 8192), min_time=0.2, max_repeats=10,
    matmul_n=2048,
)  # fmt: skip
QUICK = DemoSizes(
    n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=4, steps=8, eval_interval=4,
    eval_batches=2, lr=3e-3, warmup_steps=2, max_bytes=200_000, sample_tokens=30,
    capture_batch=2, num=48, feature_dims=(8, 16), trials=1, fit_steps=5,
    lengths=(64, 128, 256), min_time=0.0, max_repeats=1, matmul_n=256,
)  # fmt: skip


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``demo`` on the top-level CLI's ``subparsers``."""
    parser = subparsers.add_parser(
        "demo",
        help="train, measure and benchmark; write a Markdown + HTML report",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="demo-report", help="report folder (default %(default)s)")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run"
    )
    parser.add_argument(
        "--corpus", default="shakespeare", help="shakespeare (default), stdlib or a text path"
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per model")
    parser.add_argument("--lengths", default=None, help="speed: sequence lengths, e.g. 1k,2k,4k")
    parser.add_argument("--quick", action="store_true", help="one-minute version (tiny sizes)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.set_defaults(func=run)
    return parser


def _finite(x):
    """JSON-safe copy: NaN/inf floats -> None, tensors/paths -> plain values."""
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (int, str, bool)) or x is None:
        return x
    return str(x)


# ----- 1. quality -------------------------------------------------------------------------------
def _polysketch_attention() -> str:
    from ..nn import PRESETS

    return "psf_random" if "psf_random" in PRESETS else "polysketch"


def section_quality(args, sizes: DemoSizes, report, state: dict) -> dict:
    from ..data.corpus import load_corpus
    from ..data.tokenizer import ByteTokenizer
    from ..eval.report import format_table, plot_loss_curves
    from ..nn import TransformerConfig
    from ..train import TrainConfig, train

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
    for attention in ("softmax", _polysketch_attention()):
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
            seed=args.seed, out_dir=str(out / "runs" / attention),
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


# ----- 2. fidelity ------------------------------------------------------------------------------
def _trained_model(attention: str, args, state: dict):
    """The model trained by section 1 in this run, else the one its checkpoint in --out holds."""
    model = state.get("models", {}).get(attention)
    if model is not None:
        return model, "trained in this run"
    path = Path(args.out) / "runs" / attention / "ckpt.pt"
    if not path.is_file():
        return None, f"no trained `{attention}` model (run the quality section first)"
    from ..nn import TransformerConfig, TransformerLM
    from ..train import load_checkpoint

    ckpt = load_checkpoint(path, restore_rng=False)
    model = TransformerLM(TransformerConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model, f"loaded from `{path}`"


def _captured(model, args, sizes: DemoSizes, state: dict, seed: int):
    """(q, k, q_fit, k_fit) per-head samples (L·H, N, D) from validation text, disjoint tokens."""
    from ..data.corpus import load_corpus
    from ..eval.capture import capture_qk, head_samples, split_tokens

    corpus = state.get("corpus") or load_corpus(args.corpus, max_bytes=sizes.max_bytes)
    t = model.config.block_size
    n_seq = max(1, min(sizes.capture_batch, (corpus.val.numel() - 1) // t))
    idx = corpus.val[: n_seq * t].reshape(n_seq, t) if n_seq * t <= corpus.val.numel() else None
    if idx is None:
        idx = corpus.train[: sizes.capture_batch * t].reshape(-1, t)
    captured = capture_qk(model, idx)
    test, fit = split_tokens(idx.numel(), 2, seed=seed)
    q, k = head_samples(captured, num=sizes.num, seed=seed, positions=test)
    qf, kf = head_samples(captured, num=sizes.num, seed=seed + 1, positions=fit)
    return q, k, qf, kf


def _family_rows(family: str, q, k, fit, sizes: DemoSizes, args) -> tuple[list, list]:
    """Fidelity rows of every map of ``family`` on (q, k) and the optimum [(rank, rel)]."""
    from ..eval.fidelity import evaluate_map, optimal_curve, optimal_rank_error_of, sweep
    from ..features import available, create
    from ..nn.presets import POLYNOMIAL_MAPS, SOFTMAX_MAPS

    d = q.shape[-1]
    common_eval = dict(trials=sizes.trials, seed=args.seed)
    common = dict(common_eval, progress=not args.no_progress)
    if family == "polynomial":
        names = sorted((POLYNOMIAL_MAPS & set(available())) - NOT_CALIBRATED)
        rows = sweep(
            names, q, k, degrees=[4], feature_dims=sizes.feature_dims, fit_data=fit,
            max_feature_dim=MAX_FEATURE_DIM, fit_steps=sizes.fit_steps, **common,
        )  # fmt: skip
        if "polysketch" in names:  # the psf_random map: degree-2 sketch, squared -> (q·k)^4
            for f in sizes.feature_dims:
                r = max(2, math.isqrt(f))
                row = evaluate_map(
                    "polysketch", q, k, degree=2, num_features=r, trials=sizes.trials,
                    seed=args.seed, nonnegative=True,
                )  # fmt: skip
                row.update(map="polysketch² (psf_random)", degree=4, skipped="")
                rows.append(row)
        ranks = sorted({r["state_dim"] for r in rows if not r.get("skipped")})
        optimum = [
            (o["rank"], o["relative"]) for o in optimal_curve(q, k, degrees=[4], ranks=ranks)
        ]
        return rows, optimum
    names = sorted(SOFTMAX_MAPS & set(available()))
    scale = 1.0 / math.sqrt(d)
    rows = []
    jobs = [(n, f) for n in names for f in sizes.feature_dims]
    for name, f in tqdm(jobs, desc="fidelity", unit="map", disable=not common["progress"]):
        try:  # built here (scale=1/√D); evaluate_map redraws it per trial, fits hybrid_clustered
            fm = create(name, d, num_features=f, scale=scale, seed=args.seed)
            if fm.feature_dim > MAX_FEATURE_DIM:
                raise ValueError(f"feature_dim {fm.feature_dim} > {MAX_FEATURE_DIM}")
            row = evaluate_map(fm, q, k, fit_steps=sizes.fit_steps, fit_data=fit, **common_eval)
        except (ValueError, TypeError, RuntimeError) as err:
            rows.append({"map": name, "num_features": f, "skipped": f"{type(err).__name__}: {err}"})
            continue
        row.update(map=name, num_features=f, skipped="")
        rows.append(row)
    exact = create("positive", d, scale=scale, seed=0).target_kernel(q, k)
    ranks = sorted({r["state_dim"] for r in rows if not r.get("skipped")})
    return rows, [(m, optimal_rank_error_of(exact, m).relative) for m in ranks]


def _scale_stats(q: torch.Tensor, k: torch.Tensor) -> str:
    """Mean ‖q‖, ‖k‖ and the largest |q·k|/√D of a sample: what drives the kernels' range."""
    logits = float((q @ k.transpose(-1, -2)).abs().max()) / math.sqrt(q.shape[-1])
    qn, kn = float(q.norm(dim=-1).mean()), float(k.norm(dim=-1).mean())
    return f"mean ‖q‖ {qn:.3g}, mean ‖k‖ {kn:.3g}, max |q·k|/√D {logits:.3g}"


def section_fidelity(args, sizes: DemoSizes, report, state: dict) -> dict:
    from ..eval.data_sources import load_qk
    from ..eval.report import format_table, plot_fidelity_panels

    out = Path(args.out)
    report.heading("2. Fidelity: how well each feature map reproduces its kernel")
    report.paragraph(
        "Relative Frobenius error ‖φq(Q)φk(K)ᵀ − E‖_F / ‖E‖_F of each map against its target "
        "kernel E, vs the state size m of the map (F, or F² for self-tensored maps), mean over "
        f"{sizes.trials} seeded draws, on {sizes.num} queries × {sizes.num} keys per (layer, "
        "head) as the trained models feed them to the attention core (after the q/k LayerNorm "
        "and RoPE; fitted maps are calibrated on other tokens), and on Gaussian q, k with "
        "q·k of unit variance. `ratio` = error / the Eckart–Young optimum, the least error of "
        "any rank-m approximation of E (LLoPS Thm 3.1; n/a where E has rank ≤ m, e.g. exact "
        "maps). `polysketch² (psf_random)` is the sketch the psf_random attention uses: a "
        "degree-2 sketch of r features, squared (F asked = r, state r²). "
        "`learned_polysketch` is left out: it is trained inside a model (psf_learned), not "
        "fitted to a kernel."
    )
    result = {}
    for family, attention, target in (
        ("polynomial", _polysketch_attention(), "(q·k)^4"),
        ("softmax", "softmax", "exp(q·k/√D)"),
    ):
        model, origin = _trained_model(attention, args, state)
        panels, sources = {}, {}
        if model is None:
            report.note(f"{family} maps on captured q/k skipped: {origin}.")
            d = sizes.n_embd // sizes.n_head
        else:
            q, k, qf, kf = _captured(model, args, sizes, state, args.seed)
            d = q.shape[-1]
            sources[f"captured from `{attention}` model ({origin})"] = (q, k, (qf, kf))
        gq, gk = load_qk("gaussian", dim=d, num=sizes.num, seed=args.seed)
        fq, fk = load_qk("gaussian", dim=d, num=sizes.num, seed=args.seed + 1)
        sources["Gaussian q, k"] = (gq, gk, (fq, fk))
        print(f"[fidelity] {family} maps vs {target}", flush=True)
        table: dict[tuple, dict] = {}
        skipped = []
        for label, (q, k, fit) in sources.items():
            rows, optimum = _family_rows(family, q, k, fit, sizes, args)
            comparable = [r for r in rows if family == "softmax" or r.get("target") == target]
            panels[label.split(" (")[0].replace("`", "")] = (comparable, optimum)
            for r in rows:
                if r.get("skipped"):
                    skipped.append(f"{r['map']} F={r['num_features']}: {r['skipped']}")
                    continue
                key = (r["map"], r["num_features"], r["state_dim"])
                table.setdefault(key, {})[label] = r
        png = plot_fidelity_panels(panels, out / f"fidelity_{family}.png")
        labels = list(sources)
        headers = ["map", "measured against", "F asked", "state dim"]
        for label in labels:
            short = "captured" if label.startswith("captured") else "Gaussian"
            headers += [f"error ({short})", f"ratio ({short})"]
        rows = []
        for (name, f, m), per in table.items():
            against = next(iter(per.values())).get("target", target)
            row = [name, target if family == "softmax" else against, f, m]
            for label in labels:
                r = per.get(label)
                row += (
                    [None, None] if r is None else [r["rel_frobenius_mean"], r["ratio_to_optimal"]]
                )
            rows.append(row)
        report.heading(f"{family.capitalize()} maps, target {target}", level=3)
        stats = "; ".join(f"{lb}: {_scale_stats(q, k)}" for lb, (q, k, _) in sources.items())
        note = (
            "Random-feature estimators of exp(q·k/√D) have relative mean squared error growing "
            "like exp(‖q + k‖²/√D)/m (HRF Lemma 2.2, Eq. 7), so they degrade sharply when "
            "trained queries and keys have large norms."
            if family == "softmax"
            else "`own kernel`: a map whose target is not a polynomial kernel (measured "
            "against that target)."
        )
        report.paragraph(f"Data ({stats}). Head dim D = {d}. {note}")
        report.table(headers, rows)
        report.image(
            png.name,
            f"{family} maps: error vs state dim against {target} (maps measured against their "
            "own kernel are in the table only)",
        )
        if skipped:
            report.paragraph("Not measured: " + "; ".join(sorted(set(skipped))) + ".")
        print(format_table(headers, rows), flush=True)
        result[family] = {"headers": headers, "rows": rows, "skipped": sorted(set(skipped))}
    return result


# ----- 3. speed ---------------------------------------------------------------------------------
def section_speed(args, sizes: DemoSizes, report, state: dict) -> dict:
    from ..eval.bench import (
        BenchConfig,
        format_report,
        parse_lengths,
        plot_results,
        run_benchmark,
        write_csv,
    )

    out = Path(args.out)
    lengths = parse_lengths(args.lengths) if args.lengths else sizes.lengths
    config = BenchConfig(
        lengths=lengths, decode_positions=lengths, min_time=sizes.min_time, min_repeats=1,
        max_repeats=sizes.max_repeats, matmul_n=sizes.matmul_n, threads=args.threads,
        seed=args.seed, progress=not args.no_progress,
    )  # fmt: skip
    print(f"[speed] causal attention and decoding at T in {list(lengths)}", flush=True)
    result = run_benchmark(config)
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
        f"Median wall time on {result['device']} with {result['threads']} threads, fp32, "
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
    report.image(png.name, "time vs sequence length (left) and decode step time vs position")
    report.paragraph("Full measurements (GFLOP/s, memory estimates): `speed.csv`.")
    print(format_report(result), flush=True)
    return {"summary": result["summary"], "tables": tables, "peak_gflops": result["peak_gflops"]}


# ----- driver -----------------------------------------------------------------------------------
SECTION_FUNCS = {"quality": section_quality, "fidelity": section_fidelity, "speed": section_speed}


def run(args) -> int:
    """Run the chosen sections and write the report; 1 if a section failed (reported)."""
    sizes = QUICK if args.quick else FULL
    if args.steps is not None:
        sizes = replace(sizes, steps=check_positive_int(args.steps, "steps"))
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(check_positive_int(args.threads, "threads"))
    try:
        return _run(args, sizes)
    finally:
        torch.set_num_threads(threads)


def _run(args, sizes: DemoSizes) -> int:
    from ..eval.report import Report, machine_info

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    report = Report("polysketch demo report" + (" (quick)" if sizes is QUICK else ""))
    report.paragraph(
        "polysketch replaces the T×T softmax attention matrix by kernel feature maps, "
        "s(q, k) ≈ φq(q)·φk(k), so causal attention costs O(T) and decoding keeps a "
        "constant-size state instead of a growing KV cache. This report, produced by "
        "`polysketch demo` on this machine, shows what that buys and costs: model quality "
        "(section 1), how well the maps approximate their kernels (section 2) and speed (3)."
    )
    body = Report("")
    timings, results, failures, state = {}, {}, [], {}
    for name in [s for s in SECTIONS if s in args.sections]:
        start = time.perf_counter()
        try:
            results[name] = SECTION_FUNCS[name](args, sizes, body, state)
        except Exception as err:  # a section that cannot run is reported, the others go on
            failures.append(name)
            detail = "".join(traceback.format_exception_only(type(err), err)).strip()
            body.heading(f"{name}: not run")
            body.note(f"the {name} section failed: {detail}")
            print(f"[{name}] FAILED: {detail}", flush=True)
            traceback.print_exc()
        timings[name] = time.perf_counter() - start
        print(f"[{name}] {timings[name]:.1f} s", flush=True)
    report.heading("Machine and run")
    report.table(
        ["CPUs", "torch threads", "torch", "CUDA", "Python", "platform", "date"],
        [[machine["cpu_count"], machine["torch_threads"], machine["torch_version"],
          machine["cuda_available"], machine["python"], machine["platform"], machine["date"]]],
    )  # fmt: skip
    report.table(
        ["section", "wall time (s)"],
        [[n, t] for n, t in timings.items()] + [["total", sum(timings.values())]],
    )
    report.blocks += body.blocks
    md, page = report.write(out)
    with open(out / "results.json", "w", encoding="utf-8") as fh:
        json.dump(
            _finite({"machine": machine, "seconds": timings, "sizes": sizes.__dict__,
                     "failed": failures, **results}), fh, indent=1,
        )  # fmt: skip
    print(f"wrote {md}, {page} and {out / 'results.json'}")
    return 1 if failures else 0
