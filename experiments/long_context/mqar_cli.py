"""``long_context.py mqar``: long-range MQAR, recall vs decode state (``recall``).

Every query lies at least ``min_distance`` tokens after its key (``MQARConfig.min_distance``),
farther than any exact local window of the attentions compared, so recall must come from the
global part. The sweep is ``polysketch.eval.mqar_sweep``'s (``--setting long``: T = 1024,
``long512``: T = 512, ``long_curriculum``: T = 1024 through shorter stages, ``curriculum256``:
its screen; Zoology's larger settings are the reference, see ``LONG``), one
attention at a time so that ``--reuse`` continues a stopped table; the plot has the axes of
the README's MQAR plot (recall accuracy vs decode state at T). ``--estimate`` times a few
training steps per attention instead and projects the CPU time of a full run.
"""

from __future__ import annotations

import time

from polysketch.eval import mqar_sweep as ms

from .cli import add_common, guarded, header, out_dir
from .report import ResultCSV, markdown_table
from .timing import time_steps

__all__ = ["register", "SMOKE_ATTENTIONS"]

SMOKE_ATTENTIONS = ("softmax", "psf_mixed", "taylor:qk_dim=4")
COLUMNS = (*ms.COLUMNS, "setting", "seq_len", "num_kv_pairs", "min_distance", "steps",
           "curriculum_accuracy")  # fmt: skip
KEY = ("attention", "lr")


def register(subparsers) -> None:
    p = subparsers.add_parser("mqar", help="long-range MQAR: recall vs decode state")
    add_common(p, "mqar")
    p.add_argument(
        "--setting", default="long", choices=("long", "long512", "long_curriculum", "curriculum256")
    )
    p.add_argument("--attentions", nargs="+", default=None, help="(default: the setting's)")
    p.add_argument("--lrs", type=float, nargs="+", default=None)
    for key in ("seq_len", "num_kv_pairs", "min_distance", "steps", "batch_size", "num_train"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    p.add_argument(
        "--estimate",
        action="store_true",
        help="time --estimate-steps steps per attention and project a full run",
    )
    p.add_argument("--estimate-steps", type=int, default=2)
    p.add_argument(
        "--save-models",
        default=None,
        metavar="DIR",
        help="write each trained model's checkpoint and metrics to DIR/<attention>_lr<lr>/ "
        "(for diagnostics; default: none)",
    )
    p.set_defaults(run=lambda args, argv: guarded(_run, args, argv))


def _settings(args) -> tuple[dict, list[str]]:
    base, attentions = ms.SETTINGS[args.setting]
    s = dict(base)
    if args.smoke:
        s = {**ms.QUICK, "seq_len": 32, "num_kv_pairs": 2, "min_distance": 16, "steps": 2}
        if base.get("curriculum"):
            s["curriculum"] = ((16, 0, 2, 2),)
        attentions = SMOKE_ATTENTIONS
    for key in ("seq_len", "num_kv_pairs", "min_distance", "steps", "batch_size", "num_train"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    return s, list(args.attentions or attentions)


def _estimate(args, settings: dict, attentions: list[str], out, argv) -> int:
    start = time.perf_counter()
    data = ms.make_data({**settings, "num_train": 1, "num_val": 1}, seed=args.seed)
    rows = []
    for spec in attentions:
        name, model_opts, map_kwargs = ms.parse_attention(spec)
        cfg = ms.model_config_for(name, data, settings=settings, model_options=model_opts,
                                  map_kwargs=map_kwargs, seed=args.seed)  # fmt: skip
        seconds = 0.0  # the curriculum's stages, then the task
        for stage in (*ms.curriculum_settings(settings), settings):
            facts = time_steps(cfg, batch_size=stage["batch_size"], seq_len=stage["seq_len"],
                               steps=args.estimate_steps, seed=args.seed)  # fmt: skip
            seconds += facts["s_per_step"] * stage["steps"]
        hours = seconds / 3600
        rows.append((f"`{spec}`", f"{facts['s_per_step']:.2f}", f"{hours:.2f}",
                     f"{facts['state_size']:,}"))  # fmt: skip
        print(f"{spec}: {facts['s_per_step']:.2f} s/step, {hours:.2f} h for {settings['steps']}")
    md = markdown_table(("attention", "s/step (task)", f"hours for {settings['steps']} steps" +
                         (" and the curriculum" if settings.get("curriculum") else ""),
                         "decode state (floats)"), rows)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "estimate.md").write_text(
        header("Long-range MQAR: projected CPU time per run", argv,
               cpu_s=time.perf_counter() - start, resumable=False,
               extra=[f"Settings: {settings}; median of {args.estimate_steps} steps after one "
                      f"warm-up, batch {settings['batch_size']} × {settings['seq_len']}."])
        + "\n" + md + "\n"
    )  # fmt: skip
    print(md)
    return 0


def _run(args, argv) -> int:
    settings, attentions = _settings(args)
    out = out_dir(args)
    if args.estimate:
        return _estimate(args, settings, attentions, out, argv)
    lrs = args.lrs or [settings["lr"]]
    table = ResultCSV(out / "mqar.csv", COLUMNS, KEY,
                      settings={"setting": args.setting, **settings, "seed": args.seed},
                      reuse=args.reuse, overwrite=args.overwrite)  # fmt: skip
    for spec in attentions:
        for lr in lrs:
            if table.has({"attention": spec, "lr": lr}):
                continue
            (row,) = ms.run_sweep([spec], settings=settings, lrs=[lr], seed=args.seed,
                                  progress=not args.no_progress,
                                  save_dir=args.save_models)  # fmt: skip
            row.update(
                setting=args.setting,
                seq_len=settings["seq_len"],
                num_kv_pairs=settings["num_kv_pairs"],
                min_distance=settings["min_distance"],
                steps=settings["steps"],
            )
            table.add(row)
    rows = table.rows
    title = (f"MQAR: T={settings['seq_len']}, {settings['num_kv_pairs']} pairs, query ≥ "
             f"{settings['min_distance']} after key, {settings['n_layer']} layers × "
             f"{settings['n_embd']}")  # fmt: skip
    png = ms.plot_sweep(rows, out / "mqar.png", title=title)
    cpu = sum(float(r["train_s"]) for r in rows)
    extra = [
        f"Settings ({args.setting}): {settings}; seed {args.seed}. Reference: Zoology's "
        "larger MQAR settings (T = 512, 64 pairs, vocabulary 8192, 100k examples, "
        "d_model 64–512); see `polysketch.eval.mqar_sweep.LONG` for ours and why."
    ]
    md = header("Long-range MQAR", argv, cpu_s=cpu, extra=extra)
    (out / "mqar.md").write_text(md + "\n```\n" + ms.format_table(rows) + "\n```\n")
    print(ms.format_table(rows))
    print(f"wrote {table.path}, {out / 'mqar.md'}, {png}")
    return 0
