"""``long_context.py retrieval``: the kernel-level retrieval table (``retrieval_table``).

Writes ``retrieval.csv`` (one row per input, head, attention, t, draw), ``retrieval.md``
(command, seeds, CPU time, the check against the issue's numbers, per-input tables) and
``retrieval.png``. ``--inputs captured`` measures the q/k of every head of the model in
``--checkpoint`` (a ``polysketch train`` checkpoint) on the corpus' validation text.
``--trained CKPT ...`` adds the feature map of every layer and head of trained models, as
they were trained (rows ``trained:<run folder>:layer<l>.head<h>``): a learned map such as
``soft_hash`` is fitted by training, not by ``fit``.
"""

from __future__ import annotations

import time

from .cli import add_common, guarded, header, out_dir
from .report import ResultCSV
from .retrieval_report import plot_retrieval, reproduction_lines, retrieval_markdown
from .retrieval_table import (
    COLUMNS,
    CONTEXTS,
    DEFAULT_ATTENTIONS,
    KEY,
    RetrievalSettings,
    captured_sources,
    gaussian_source,
    run_retrieval,
    summarize,
    trained_kernels,
)

__all__ = ["register", "SMOKE"]

SMOKE = {"contexts": [16, 64], "draws": 1, "queries": 8, "dim": 16, "fit_num": 64,
         "fit_steps": 3}  # fmt: skip
"""``--smoke`` sizes: every default attention, two contexts, one draw (seconds)."""


def register(subparsers) -> None:
    p = subparsers.add_parser("retrieval", help="weight on the matching key vs context t")
    add_common(p, "retrieval")
    p.add_argument("--inputs", nargs="+", default=["gaussian"], choices=("gaussian", "captured"))
    p.add_argument("--checkpoint", default=None, help="model to capture q/k from (captured)")
    p.add_argument("--corpus", default="shakespeare", help="text the capture runs on")
    p.add_argument("--attentions", nargs="+", default=list(DEFAULT_ATTENTIONS),
                   metavar="NAME[:k=v,...]")  # fmt: skip
    p.add_argument("--trained", nargs="+", default=[], metavar="CKPT",
                   help="also measure the feature maps of these trained models (polysketch "
                   "train checkpoints), every layer and head, as trained")  # fmt: skip
    p.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    p.add_argument("--draws", type=int, default=3, help="draws of keys (and of random maps)")
    p.add_argument("--queries", type=int, default=64, help="matching keys per t and draw")
    p.add_argument("--dim", type=int, default=64, help="D of the Gaussian input")
    p.add_argument("--fit-num", type=int, default=4096, help="fit samples per source")
    p.add_argument("--fit-steps", type=int, default=None, help="(default: each map's own)")
    p.set_defaults(run=lambda args, argv: guarded(_run, args, argv))


def _settings(args) -> RetrievalSettings:
    values = {
        "attentions": args.attentions, "contexts": args.contexts, "draws": args.draws,
        "queries": args.queries, "dim": args.dim, "seed": args.seed, "fit_num": args.fit_num,
        "fit_steps": args.fit_steps, "inputs": args.inputs, "checkpoint": args.checkpoint,
        "trained": args.trained,
    }  # fmt: skip
    if args.smoke:
        values.update(SMOKE)
    if "captured" in args.inputs:
        values["extra"] = {"corpus": args.corpus}
    return RetrievalSettings(**values)


def _run(args, argv) -> int:
    settings = _settings(args)
    out = out_dir(args)
    table = ResultCSV(out / "retrieval.csv", COLUMNS, KEY, settings=settings.as_dict(),
                      reuse=args.reuse, overwrite=args.overwrite)  # fmt: skip
    sources, notes = [], {}
    if "gaussian" in settings.inputs:
        sources.append(gaussian_source(settings))
        notes["gaussian"] = f"LayerNorm'd N(0, I), D = {settings.dim}"
    capture_s = 0.0
    if "captured" in settings.inputs:
        from polysketch.data.corpus import load_corpus

        from .inputs import capture_heads, load_model

        start = time.process_time()
        model = load_model(settings.checkpoint)
        corpus = load_corpus(args.corpus, max_bytes=200_000 if args.smoke else None)
        captured = capture_heads(
            model, corpus.val, num_positions=max(settings.contexts) + settings.fit_num,
            num_fit=settings.fit_num, seed=settings.seed,
        )  # fmt: skip
        capture_s = time.process_time() - start
        sources += captured_sources(captured, settings)
        cfg = model.config
        notes["captured"] = (
            f"q/k after the q/k LayerNorm and RoPE of every head of `{settings.checkpoint}` "
            f"(`{cfg.attention}`, {cfg.n_layer} layers × {cfg.n_embd}, {cfg.n_head} heads of "
            f"{cfg.n_embd // cfg.n_head}), {captured.windows} validation windows of "
            f"{captured.window_len} bytes of `{args.corpus}`; {settings.fit_num} positions fit "
            f"the learnable maps, {captured.keys.shape[1]:,} others are measured"
        )
    trained = trained_kernels(settings.trained)
    left_out = run_retrieval(settings, sources, table, trained=trained,
                             progress=not args.no_progress)  # fmt: skip
    summary = summarize(table.rows)
    cpu = sum(float(r["cpu_s"]) + float(r["fit_s"] or 0) for r in table.rows) + capture_s
    repro = reproduction_lines(summary) if settings.dim == 64 else []
    extra = [
        f"Seeds: --seed {settings.seed}; {settings.draws} draws of keys per t (random maps "
        f"redrawn per draw), {settings.queries} matching keys per t and draw; learnable maps "
        f"fitted with their defaults (steps {settings.fit_steps or 'default'}) on "
        f"{settings.fit_num} held-out q/k per source. Weights are means over queries, heads "
        "and draws; ± is the standard deviation over draws. [≤ b] is the bound "
        "min(1, F′/t) on the mean exact-match weight of non-negative scores.",
        "Maps left out: none (every map's features are formed at every t, in chunks).",
    ]
    if repro:
        extra.append("Check against issue 21 (Gaussian input, query = key):\n\n"
                     + "\n".join(f"- {line}" for line in repro))  # fmt: skip
    if left_out:
        extra.append("Left out: " + "; ".join(left_out))
    md = header("Retrieval: weight on the matching key vs context", argv, cpu_s=cpu, extra=extra)
    md += "\n" + retrieval_markdown(summary, inputs_note=notes)
    (out / "retrieval.md").write_text(md)
    png = plot_retrieval(summary, out / "retrieval.png", title="weight on the matching key")
    print(retrieval_markdown(summary, inputs_note=notes))
    for line in repro:
        print(line)
    print(f"wrote {table.path}, {out / 'retrieval.md'}, {png}")
    return 0
