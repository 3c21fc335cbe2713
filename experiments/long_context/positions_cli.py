"""``long_context.py positions``: loss by position bucket on long documents (``positions``).

For each attention and seed: train at ``--context`` (default 2048) on the corpus' training
split with random windows (``polysketch.train.train`` on a ``Corpus``; checkpoints in
``--runs``, shared with any table of the same settings), then evaluate windows of every
``--eval-lengths`` (default 2048, 8192, 32768: extrapolation past the training length) that
lie inside one validation document. Writes ``positions.csv`` (one row per attention, seed,
eval length and bucket), ``positions.md`` and ``positions.png``.

Exact quadratic attentions (``softmax`` through the reference path, ``polynomial``) build a
T × T score matrix per head: an (attention, length) whose matrix would exceed
``--max-quadratic-gb`` is left out and named in the markdown.
"""

from __future__ import annotations

import time

from polysketch.data.corpus import load_corpus
from polysketch.eval.plots import save_png, subplots

from .cli import add_common, guarded, header, out_dir
from .positions import (
    bucket_edges,
    bucket_losses,
    document_windows,
    position_losses,
    validation_documents,
)
from .probe_training import add_model_arguments, probe_settings, run_label, runs_dir, train_model
from .report import ResultCSV, markdown_table

__all__ = ["register", "DEFAULT_ATTENTIONS", "SMOKE"]

DEFAULT_ATTENTIONS = ("softmax", "polynomial", "psf_random", "psf_mixed", "hedgehog", "taylor")

SMOKE = {"n_layer": 1, "n_embd": 32, "n_head": 2, "chunk_size": 16, "context": 64,
         "batch_size": 2, "steps": 3, "warmup_steps": 1}  # fmt: skip
SMOKE_EVAL = {"eval_lengths": [64, 128], "eval_windows": 2, "max_bytes": 300_000,
              "val_fraction": 0.6}  # fmt: skip

COLUMNS = ("attention", "seed", "train_context", "eval_length", "lo", "hi", "loss", "windows",
           "train_s", "eval_s")  # fmt: skip
KEY = ("attention", "seed", "eval_length", "lo")


def register(subparsers) -> None:
    p = subparsers.add_parser("positions", help="loss by position bucket; extrapolation")
    add_common(p, "positions")
    p.add_argument("--attentions", nargs="+", default=list(DEFAULT_ATTENTIONS))
    p.add_argument("--corpus", default="shakespeare")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--eval-lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--eval-windows", type=int, default=8, help="windows per eval length")
    p.add_argument("--max-quadratic-gb", type=float, default=4.0)
    add_model_arguments(p, context=2048, steps=300, lr=2e-3, schedule="cosine")
    p.set_defaults(run=lambda args, argv: guarded(_run, args, argv))


def _quadratic_gb(spec: str, model, length: int) -> float:
    """GB of one layer's T × T fp32 score matrices (all heads) for exact polynomial attention
    (softmax runs through SDPA, which does not build it)."""
    if any(getattr(m, "form", None) == "polynomial" for m in model.modules()):
        return model.config.n_head * length * length * 4 / 1e9
    return 0.0


def _run(args, argv) -> int:
    out = out_dir(args)
    ev = SMOKE_EVAL if args.smoke else {
        "eval_lengths": args.eval_lengths, "eval_windows": args.eval_windows, "max_bytes": None,
        "val_fraction": args.val_fraction,
    }  # fmt: skip
    per_seed = {s: probe_settings(args, s, SMOKE) for s in args.seeds}
    base = vars(per_seed[args.seeds[0]]).copy()
    base.pop("seed")
    settings = {"model": base, "eval": ev, "corpus": args.corpus,
                "attentions": list(args.attentions)}  # fmt: skip
    table = ResultCSV(out / "positions.csv", COLUMNS, KEY, settings=settings, reuse=args.reuse,
                      overwrite=args.overwrite)  # fmt: skip
    corpus = load_corpus(args.corpus, val_fraction=ev["val_fraction"], max_bytes=ev["max_bytes"])
    docs = validation_documents(args.corpus, val_fraction=ev["val_fraction"],
                                max_bytes=ev["max_bytes"])  # fmt: skip
    left_out: list[str] = []
    for seed in args.seeds:
        ps = per_seed[seed]
        for spec in args.attentions:
            pending = [n for n in ev["eval_lengths"]
                       if not table.has({"attention": spec, "seed": seed, "eval_length": n,
                                         "lo": 0})]  # fmt: skip
            if not pending:
                continue
            run = runs_dir(args, out) / run_label(spec, "corpus", f"seed{seed}")
            model, facts = train_model(spec, corpus, ps, run, progress=not args.no_progress)
            for n in pending:
                gb = _quadratic_gb(spec, model, n)
                if gb > args.max_quadratic_gb:
                    left_out.append(f"`{spec}` at {n}: its T × T scores need {gb:.1f} GB")
                    continue
                start = time.perf_counter()
                windows = document_windows(docs, n, ev["eval_windows"], seed=seed)
                per_pos = position_losses(model, windows)
                eval_s = time.perf_counter() - start
                for lo, hi, loss in bucket_losses(per_pos, bucket_edges(n)):
                    table.add({"attention": spec, "seed": seed, "train_context": ps.context,
                               "eval_length": n, "lo": lo, "hi": hi, "loss": loss,
                               "windows": len(windows), "train_s": facts["train_s"],
                               "eval_s": eval_s})  # fmt: skip
                    facts["train_s"], eval_s = 0.0, 0.0  # counted once
    cpu = sum(float(r["train_s"]) + float(r["eval_s"]) for r in table.rows)
    extra = [
        f"Trained at context {base['context']} on the training split of `{args.corpus}` "
        f"(random windows): {base['n_layer']} layers × {base['n_embd']}, {base['n_head']} "
        f"heads, chunk {base['chunk_size']}, batch {base['batch_size']}, {base['steps']} steps, "
        f"lr {base['lr']} ({base['schedule']}); seeds {args.seeds}. Evaluated on "
        f"{ev['eval_windows']} windows per length inside validation documents; loss in "
        "nats/byte, mean over the windows and the positions of each bucket.",
    ]
    if left_out:
        extra.append("Left out: " + "; ".join(left_out))
    md = header("Loss by position; extrapolation", argv, cpu_s=cpu, extra=extra)
    md += "\n" + markdown(table.rows)
    (out / "positions.md").write_text(md)
    png = plot_positions(table.rows, out / "positions.png")
    print(markdown(table.rows))
    print(f"wrote {table.path}, {out / 'positions.md'}, {png}")
    return 0


def _mean_rows(rows) -> dict:
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["attention"], int(r["eval_length"]), int(r["lo"]), int(r["hi"])),
                          []).append(float(r["loss"]))  # fmt: skip
    return {k: sum(v) / len(v) for k, v in groups.items()}


def markdown(rows) -> str:
    """One table per eval length: attention × bucket, mean loss over seeds."""
    means = _mean_rows(rows)
    out = []
    for n in sorted({k[1] for k in means}):
        buckets = sorted({(k[2], k[3]) for k in means if k[1] == n})
        names = list(dict.fromkeys(k[0] for k in means if k[1] == n))
        body = [[f"`{a}`"] + [f"{means[(a, n, lo, hi)]:.4f}" if (a, n, lo, hi) in means else "-"
                              for lo, hi in buckets] for a in names]  # fmt: skip
        out += [f"Evaluated at length {n:,}:", "",
                markdown_table(["attention"] + [f"[{lo}, {hi})" for lo, hi in buckets], body),
                ""]  # fmt: skip
    return "\n".join(out)


def plot_positions(rows, path):
    """Loss per bucket (x: bucket end, log scale), one panel per eval length."""
    means = _mean_rows(rows)
    lengths = sorted({k[1] for k in means}) or [0]
    fig, axes = subplots(len(lengths), panel_size=(4.5, 3.5))
    for ax, n in zip(axes, lengths, strict=True):
        for a in dict.fromkeys(k[0] for k in means if k[1] == n):
            pts = sorted((k[3], v) for k, v in means.items() if k[0] == a and k[1] == n)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=a)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bucket end (position)")
        ax.set_ylabel("loss (nats/byte)")
        ax.set_title(f"evaluated at {n:,}", fontsize=9)
        ax.legend(fontsize=6)
    return save_png(fig, path)
