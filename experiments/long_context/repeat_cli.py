"""``long_context.py repeat``: the repeat (copy) probe table (``repeat_probe``).

For each attention and seed: train a model (``probe_training``; checkpoints in ``--runs``,
reused) on windows in which passages recur ``--distance`` tokens later
(``polysketch.data.repeat``; ``--text synthetic`` random letters written twice, or
``natural`` Shakespeare passages), then probe it on held-out windows: loss on first
occurrences and recurrences, the counterfactual and, for mixed attentions, the global-part
ablation. Writes ``repeat.csv``, ``repeat.md`` and ``repeat.png``.
"""

from __future__ import annotations

import time

from polysketch.data.repeat import RepeatConfig, make_repeat
from polysketch.eval.plots import save_png, subplots
from polysketch.train import MQARData

from .cli import add_common, guarded, header, out_dir
from .probe_training import (
    ProbeSettings,
    add_model_arguments,
    probe_settings,
    run_label,
    runs_dir,
    train_model,
)
from .repeat_probe import PROBE_COLUMNS, probe_model
from .report import ResultCSV, fmt, markdown_table, spec_label

__all__ = ["register", "DEFAULT_ATTENTIONS", "SMOKE", "probe_data"]

DEFAULT_ATTENTIONS = (
    "softmax", "polynomial", "psf_random", "psf_learned", "psf_mixed",
    "llops:num_features=32,degree=2,square=True",
    "llops:num_features=1024,degree=2,elementwise_square=True", "hedgehog", "taylor",
)  # fmt: skip
"""Issue 21's attentions (sliding-window exact attention, its local-only control, is not in
the library yet)."""

SMOKE = {"n_layer": 1, "n_embd": 32, "n_head": 2, "chunk_size": 16, "context": 64,
         "batch_size": 2, "steps": 3, "warmup_steps": 1}  # fmt: skip
SMOKE_LAYOUT = {"passage_len": 16, "distance": 32, "val_windows": 2}

COLUMNS = (
    "attention", "text", "seed", "steps", "context", "distance", "passage_len", "state_size",
    "params", "train_loss", *PROBE_COLUMNS, "train_s", "s_per_step", "eval_s",
)  # fmt: skip
KEY = ("attention", "text", "seed")
CURVE_COLUMNS = ("attention", "text", "seed", "step", *PROBE_COLUMNS)
CURVE_KEY = ("attention", "text", "seed", "step")


def register(subparsers) -> None:
    p = subparsers.add_parser("repeat", help="repeat (copy) probe: recurrence vs first occurrence")
    add_common(p, "repeat")
    p.add_argument("--attentions", nargs="+", default=list(DEFAULT_ATTENTIONS))
    p.add_argument("--text", choices=("synthetic", "natural"), default="synthetic")
    p.add_argument("--passage-len", type=int, default=1024)
    p.add_argument("--distance", type=int, default=1024, help="first token to recurrence")
    p.add_argument("--val-windows", type=int, default=16, help="probe windows (held out)")
    p.add_argument("--corpus", default="shakespeare", help="natural text source")
    p.add_argument(
        "--probe-every",
        type=int,
        default=None,
        help="also probe every N steps (repeat_curve.csv): to find a budget",
    )
    add_model_arguments(p, context=2048, steps=500, lr=1e-3, schedule="constant")
    p.set_defaults(run=lambda args, argv: guarded(_run, args, argv))


def probe_data(args, settings: ProbeSettings, seed: int):
    """(training MQARData, factual RepeatSet, counterfactual RepeatSet) for one seed."""
    layout = SMOKE_LAYOUT if args.smoke else vars(args)
    config = RepeatConfig(seq_len=settings.context, passage_len=layout["passage_len"],
                          distance=layout["distance"], text=args.text)  # fmt: skip
    train_src = val_src = None
    if args.text == "natural":
        from polysketch.data.corpus import load_corpus

        corpus = load_corpus(args.corpus, max_bytes=300_000 if args.smoke else None)
        train_src, val_src = corpus.train, corpus.val
    n_train = settings.steps * settings.batch_size
    train_set = make_repeat(config, n_train, source=train_src, seed=2 * seed)
    val_n = layout["val_windows"]
    factual = make_repeat(config, val_n, source=val_src, seed=2 * seed + 1)
    counter = make_repeat(config, val_n, source=val_src, seed=2 * seed + 1, counterfactual=True)
    data = MQARData(train_set.inputs, train_set.targets, factual.inputs, factual.targets, 256)
    return data, factual, counter


def _run(args, argv) -> int:
    out = out_dir(args)
    layout = SMOKE_LAYOUT if args.smoke else {
        "passage_len": args.passage_len, "distance": args.distance,
        "val_windows": args.val_windows,
    }  # fmt: skip
    per_seed = {s: probe_settings(args, s, SMOKE) for s in args.seeds}
    base = vars(per_seed[args.seeds[0]]).copy()
    base.pop("seed")
    settings = {"model": base, "layout": layout, "text": args.text, "corpus": args.corpus,
                "attentions": list(args.attentions)}  # fmt: skip
    table = ResultCSV(out / "repeat.csv", COLUMNS, KEY, settings=settings, reuse=args.reuse,
                      overwrite=args.overwrite)  # fmt: skip
    runs = runs_dir(args, out)
    curve = None
    if args.probe_every:
        curve = ResultCSV(out / "repeat_curve.csv", CURVE_COLUMNS, CURVE_KEY, settings=settings,
                          reuse=args.reuse, overwrite=args.overwrite)  # fmt: skip
    for seed in args.seeds:
        ps = per_seed[seed]
        data = None
        for spec in args.attentions:
            row = {"attention": spec, "text": args.text, "seed": seed}
            if table.has(row):
                continue
            if data is None:
                data, factual, counter = probe_data(args, ps, seed)
            run = runs / run_label(spec, args.text, f"seed{seed}")

            def on_probe(model, step, row=row, factual=factual, counter=counter):
                point = {**row, "step": step}
                if not curve.has(point):
                    curve.add({**point, **probe_model(model, factual, counter)})
                    print(f"{row['attention']} step {step}: drop {curve.rows[-1]['drop']:.3f}")

            model, facts = train_model(
                spec,
                data,
                ps,
                run,
                progress=not args.no_progress,
                probe_every=args.probe_every,
                on_probe=on_probe if curve is not None else None,
            )
            start = time.perf_counter()
            row.update(probe_model(model, factual, counter))
            if curve is not None and not curve.has({**row, "step": facts["steps"]}):
                curve.add(
                    {k: row[k] for k in ("attention", "text", "seed", *PROBE_COLUMNS)}
                    | {"step": facts["steps"]}
                )
            row.update(
                steps=facts["steps"], context=ps.context, distance=layout["distance"],
                passage_len=layout["passage_len"], state_size=model.decode_state_size(ps.context),
                params=model.num_parameters(), train_loss=facts["train_loss"],
                train_s=facts["train_s"], s_per_step=facts["s_per_step"],
                eval_s=time.perf_counter() - start,
            )  # fmt: skip
            table.add(row)
            print(f"{spec} seed {seed}: first {row['first']:.3f}  second {row['second']:.3f}  "
                  f"drop {row['drop']:.3f}  counterfactual drop {row['cf_drop']:.3f}  "
                  f"ablated drop {fmt(row['ablated_drop'])}")  # fmt: skip
    summary = summarize(table.rows)
    cpu = sum(float(r["train_s"]) + float(r["eval_s"]) for r in table.rows)
    extra = [
        f"Layout: {args.text} text, passages of {layout['passage_len']} bytes recurring "
        f"{layout['distance']} bytes after they start, windows of {base['context']} aligned to "
        f"the passages; {layout['val_windows']} held-out windows per seed. Model: "
        f"{base['n_layer']} layers × {base['n_embd']}, {base['n_head']} heads, chunk "
        f"{base['chunk_size']}, batch {base['batch_size']} × {base['context']}, "
        f"{base['steps']} steps, lr {base['lr']} ({base['schedule']}, warmup "
        f"{base['warmup_steps']}); seeds {args.seeds}. Losses in nats/byte; drop = first − "
        "second; cf = the first occurrence replaced by other text; ablated = the far blocks' "
        "scores zeroed (mixed attentions only). CPU time = training + probing (wall seconds "
        "of one-thread runs).",
    ]
    md = header("Repeat (copy) probe", argv, cpu_s=cpu, extra=extra) + "\n" + markdown(summary)
    if curve is not None:
        md += "\nDuring training (repeat_curve.csv):\n\n" + curve_markdown(curve.rows)
    (out / "repeat.md").write_text(md)
    png = plot_drops(summary, out / "repeat.png")
    print(markdown(summary))
    print(f"wrote {table.path}, {out / 'repeat.md'}, {png}")
    return 0


def summarize(rows) -> list[dict]:
    """Mean and std over seeds of the probe numbers, per (attention, text)."""
    out = []
    for key in dict.fromkeys((r["attention"], r["text"]) for r in rows):
        group = [r for r in rows if (r["attention"], r["text"]) == key]
        row = {"attention": key[0], "text": key[1], "seeds": len(group),
               "state_size": group[0]["state_size"]}  # fmt: skip
        for col in (*PROBE_COLUMNS, "s_per_step"):
            vals = [float(r[col]) for r in group if r[col] != ""]
            if vals:
                m = sum(vals) / len(vals)
                row[col] = m
                row[col + "_std"] = (sum((v - m) ** 2 for v in vals) / max(1, len(vals) - 1)) ** 0.5
        out.append(row)
    return out


def markdown(summary) -> str:
    def cell(r, c):
        if c not in r:
            return "-"
        s = f"{r[c]:.3f}"
        return s + (f" ± {r[c + '_std']:.3f}" if r["seeds"] > 1 else "")

    cols = ("first", "second", "drop", "cf_drop", "ablated_second", "ablated_drop")
    head = (
        "attention",
        "text",
        "seeds",
        "decode state (floats)",
        "first",
        "recurrence",
        "drop",
        "counterfactual drop",
        "ablated recurrence",
        "ablated drop",
        "s/step",
    )
    rows = [
        (
            f"`{r['attention']}`",
            r["text"],
            r["seeds"],
            fmt(r["state_size"]),
            *(cell(r, c) for c in cols),
            f"{r['s_per_step']:.2f}",
        )
        for r in summary
    ]
    return markdown_table(head, rows) + "\n"  # fmt: skip


def curve_markdown(rows) -> str:
    head = ("attention", "text", "seed", "step", "first", "recurrence", "drop", "cf drop")
    body = [
        (
            f"`{r['attention']}`",
            r["text"],
            r["seed"],
            r["step"],
            f"{r['first']:.3f}",
            f"{r['second']:.3f}",
            f"{r['drop']:.3f}",
            f"{r['cf_drop']:.3f}",
        )
        for r in sorted(rows, key=lambda r: (r["attention"], r["seed"], r["step"]))
    ]
    return markdown_table(head, body) + "\n"  # fmt: skip


def plot_drops(summary, path):
    """Bars of drop, counterfactual drop and ablated drop per attention."""
    fig, (ax,) = subplots(1, panel_size=(max(6.0, 0.9 * len(summary)), 4.0))
    width = 0.27
    for i, (col, label) in enumerate((("drop", "drop"), ("cf_drop", "counterfactual"),
                                      ("ablated_drop", "global part zeroed"))):  # fmt: skip
        xs = [j + (i - 1) * width for j, r in enumerate(summary) if col in r]
        ys = [r[col] for r in summary if col in r]
        if xs:
            ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(summary)))
    ax.set_xticklabels([spec_label(r["attention"]) for r in summary], rotation=30, fontsize=7)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_ylabel("loss drop on the recurrence (nats/byte)")
    ax.legend(fontsize=7)
    return save_png(fig, path)
