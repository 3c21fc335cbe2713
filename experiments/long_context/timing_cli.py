"""``long_context.py timing``: seconds per training step of the planned sizes (``timing``).

One row per (size, attention): ``--sizes`` as LAYERSxWIDTH (default 2x128 and 4x128), with
``--n-head`` heads, chunk ``--chunk-size``, batch ``--batch-size`` × ``--context``, at
``--threads`` (default 1). Writes ``timing.csv``, ``timing.md`` (with the projected hours of
``--plan-steps`` steps) and ``timing.png``.
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from polysketch.eval.plots import save_png, subplots

from .cli import add_common, guarded, header, out_dir
from .probe_training import ProbeSettings, model_config
from .report import ResultCSV, markdown_table, spec_label
from .timing import time_steps

__all__ = ["register", "DEFAULT_ATTENTIONS", "parse_size"]

DEFAULT_ATTENTIONS = ("softmax", "polynomial", "psf_random", "psf_mixed", "hedgehog", "taylor")
SMOKE = {"sizes": ["1x32"], "n_head": 2, "chunk_size": 16, "context": 64, "batch_size": 2,
         "steps": 1}  # fmt: skip
COLUMNS = ("size", "attention", "n_layer", "n_embd", "n_head", "chunk_size", "batch_size",
           "context", "threads", "s_per_step", "tokens_per_s", "params", "state_size",
           "timed_steps", "wall_s")  # fmt: skip
KEY = ("size", "attention")


def parse_size(text: str) -> tuple[int, int]:
    """'4x128' -> (4, 128); ValueError naming --sizes otherwise."""
    layers, sep, width = text.lower().partition("x")
    if not sep or not layers.isdigit() or not width.isdigit():
        raise ValueError(f"--sizes expects LAYERSxWIDTH such as 4x128, got {text!r}")
    return int(layers), int(width)


def register(subparsers) -> None:
    p = subparsers.add_parser("timing", help="seconds per training step of planned sizes")
    add_common(p, "timing")
    p.add_argument("--attentions", nargs="+", default=list(DEFAULT_ATTENTIONS))
    p.add_argument("--sizes", nargs="+", default=["2x128", "4x128"])
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed steps (median), after 1 warm-up")
    p.add_argument("--plan-steps", type=int, default=500, help="steps of the projected run")
    p.set_defaults(run=lambda args, argv: guarded(_run, args, argv))


def _run(args, argv) -> int:
    import torch

    out = out_dir(args)
    s = {"sizes": args.sizes, "n_head": args.n_head, "chunk_size": args.chunk_size,
         "context": args.context, "batch_size": args.batch_size, "steps": args.steps}  # fmt: skip
    for text in args.sizes:  # checked even when --smoke replaces them
        parse_size(text)
    if args.smoke:
        s.update(SMOKE)
    sizes = [(text, *parse_size(text)) for text in s["sizes"]]
    settings = {**s, "threads": torch.get_num_threads(), "attentions": list(args.attentions)}
    table = ResultCSV(out / "timing.csv", COLUMNS, KEY, settings=settings, reuse=args.reuse,
                      overwrite=args.overwrite)  # fmt: skip
    units = [(t, layers, width, spec) for t, layers, width in sizes for spec in args.attentions]
    for text, layers, width, spec in tqdm(units, desc="timing", disable=args.no_progress):
        row = {"size": text, "attention": spec}
        if not table.has(row):
            ps = ProbeSettings(n_layer=layers, n_embd=width, n_head=s["n_head"],
                               chunk_size=s["chunk_size"], context=s["context"],
                               batch_size=s["batch_size"], seed=args.seed)  # fmt: skip
            start = time.perf_counter()
            facts = time_steps(model_config(spec, ps), batch_size=ps.batch_size,
                               seq_len=ps.context, steps=s["steps"], seed=args.seed)  # fmt: skip
            row.update(n_layer=layers, n_embd=width, n_head=ps.n_head, chunk_size=ps.chunk_size,
                       batch_size=ps.batch_size, context=ps.context,
                       threads=torch.get_num_threads(), s_per_step=facts["s_per_step"],
                       tokens_per_s=facts["tokens_per_s"], params=facts["params"],
                       state_size=facts["state_size"], timed_steps=facts["steps"],
                       wall_s=time.perf_counter() - start)  # fmt: skip
            table.add(row)
            print(f"{text} {spec}: {facts['s_per_step']:.2f} s/step")
    md_table = markdown(table.rows, args.plan_steps)
    cpu = sum(float(r["wall_s"]) for r in table.rows)
    extra = [f"Median of {s['steps']} timed steps after one warm-up step, wall seconds on a "
             "CPU shared with other jobs (compare rows loosely); random tokens, no data "
             "loading, evaluation or checkpoints."]  # fmt: skip
    (out / "timing.md").write_text(header("Seconds per training step", argv, cpu_s=cpu,
                                          extra=extra) + "\n" + md_table)  # fmt: skip
    png = plot(table.rows, out / "timing.png")
    print(md_table)
    print(f"wrote {table.path}, {out / 'timing.md'}, {png}")
    return 0


def markdown(rows, plan_steps: int) -> str:
    head = ("size", "attention", "heads × D", "batch × T", "threads", "s/step", "tokens/s",
            f"hours for {plan_steps} steps", "decode state (floats)")  # fmt: skip
    body = [(r["size"], f"`{r['attention']}`",
             f"{r['n_head']} × {int(r['n_embd']) // int(r['n_head'])}",
             f"{r['batch_size']} × {r['context']}", r["threads"], f"{r['s_per_step']:.2f}",
             f"{r['tokens_per_s']:,.0f}", f"{r['s_per_step'] * plan_steps / 3600:.2f}",
             f"{int(r['state_size']):,}") for r in rows]  # fmt: skip
    return markdown_table(head, body) + "\n"


def plot(rows, path):
    sizes = list(dict.fromkeys(r["size"] for r in rows)) or ["-"]
    fig, axes = subplots(len(sizes), panel_size=(5.0, 3.5))
    for ax, size in zip(axes, sizes, strict=True):
        here = [r for r in rows if r["size"] == size]
        ax.bar(range(len(here)), [float(r["s_per_step"]) for r in here])
        ax.set_xticks(range(len(here)))
        ax.set_xticklabels([spec_label(r["attention"]) for r in here], rotation=30, fontsize=7)
        ax.set_ylabel("seconds per step")
        ax.set_title(f"{size}", fontsize=9)
    return save_png(fig, path)
