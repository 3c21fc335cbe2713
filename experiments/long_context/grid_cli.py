"""``long_context.py grid``: the copy probe over distances, schedules, batch sizes and seeds.

Every cell (``grid``: distance d, schedule, batch size B, seed, attention) trains the repeat
probe's model (``probe_training.train_model``; checkpoints in ``--runs``) on windows of
T = 2d with passages of d random letters recurring d tokens later (``repeat_cli.probe_data``),
probing it at step 0 and every ``--probe-every`` steps on held-out windows (loss on first
occurrences and recurrences, and with the global branch switched off), and, every
``--diagnose-every`` steps for soft-hash global branches, what that branch sees
(``grid_diagnostics``). Softmax runs first in each (d, schedule, B, seed): the other
attentions stop early only past 1.5× its onset (``grid.copied``; with ``--stop-at-target``,
there whether or not they copied: ``grid.past_target``).

Writes ``grid.csv`` (one row per cell), ``grid_curve.csv`` (every evaluation),
``grid_diag.csv`` (the diagnostics), ``grid.md``, ``grid.png`` and ``grid_diag.png``
(``grid_report``). Rows
are appended as they are measured; ``--reuse`` continues a stopped grid or extends it with
new distances, schedules, batch sizes, seeds or attentions (the cells already in
``grid.csv`` are skipped, a half-trained cell resumes from its checkpoint).

A candidate may carry training-only remedies of issue 44 item 2 as tags,
``SPEC@surrogate=A:B:T`` (a decaying surrogate weight, ``surrogate_schedule``),
``SPEC@linear=A:B:T`` (a fading linear term, ``linear_schedule``), ``SPEC@values=MU`` (a
surrogate that trains the values, ``surrogate_values``) and ``SPEC@push=S`` (the surrogate's
pushes scaled by S, ``surrogate_push``) and ``SPEC@outinit=S`` (``SPEC`` with
``global_out_init=S``, ``global_init``), combined as ``SPEC@tag@tag``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from types import SimpleNamespace

from polysketch.nn import TransformerLM
from polysketch.nn.ablate import ablate_global, global_parts

from .cli import add_common, guarded, header, out_dir, record_command
from .global_init import split_outinit
from .grid import CELL_KEY, SCHEDULES, copied, onset, past_target, schedule_options
from .grid_diagnostics import DIAG_COLUMNS, diagnose
from .grid_report import markdown, plot_diag, plot_grid, settings_text
from .linear_schedule import faded_linear, split_linear
from .probe_training import ProbeSettings, model_config, run_label, train_model
from .repeat_cli import probe_data
from .repeat_probe import split_losses, token_losses
from .report import ResultCSV
from .surrogate_push import split_push, surrogate_push
from .surrogate_schedule import Scale, scaled_surrogate, split_schedule
from .surrogate_values import split_values, surrogate_values

__all__ = ["register", "COLUMNS", "CURVE_COLUMNS", "SMOKE"]

COLUMNS = (
    *CELL_KEY, "context", "budget", "last_step", "stopped", "onset", "first", "second", "gain",
    "ablated_gain", "state_size", "params", "train_s", "cpu_s",
)  # fmt: skip
CURVE_COLUMNS = (*CELL_KEY, "step", "first", "second", "gain", "ablated_second",
                 "ablated_gain", "cpu_s")  # fmt: skip
DIAG_KEY = (*CELL_KEY, "step", "layer")
SMOKE = {"n_layer": 1, "n_embd": 32, "n_head": 2, "chunk_size": 8, "steps": 4,
         "probe_every": 2, "val_windows": 2, "diagnose_every": 2, "distances": [16],
         "batch_sizes": [2]}  # fmt: skip
REFERENCE = "softmax"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "grid", help="copy probe over distances × schedules × batch sizes × seeds (issue 44)"
    )
    add_common(p, "grid")
    p.add_argument("--attentions", nargs="+", default=[REFERENCE, "soft_hash_far_local"],
                   help="softmax (the reference, run first) and candidates")  # fmt: skip
    p.add_argument("--distances", type=int, nargs="+", default=[512, 1024, 2048],
                   help="d: passages of d letters recur d tokens later; context 2d")  # fmt: skip
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=["cli", "constant"],
                   help="cli: what polysketch train --steps gives (its default_warmup, cosine "
                   "decay over the budget); warmup100: the same with 100 warm-up steps (the "
                   "grid's `cli` before 2026-12-07); constant: lr 1e-3 after 50 warm-up "
                   "steps")  # fmt: skip
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=500, help="the fixed budget of every cell")
    p.add_argument("--probe-every", type=int, default=25)
    p.add_argument("--val-windows", type=int, default=8, help="held-out windows per seed")
    p.add_argument("--diagnose-every", type=int, default=50,
                   help="global-branch diagnostics every N steps (0: never)")  # fmt: skip
    p.add_argument("--diagnose-windows", type=int, default=2)
    p.add_argument("--stop-fraction", type=float, default=0.95,
                   help="stop a run once its gain is >= this × ln 26 and its recurrence loss "
                   "<= (1 - this) × ln 26 (past 1.5× softmax's "
                   "onset for the others); 1: never")  # fmt: skip
    p.add_argument("--stop-at-target", action="store_true",
                   help="screening: stop a candidate at its first evaluation at or past 1.5x "
                   "softmax's onset, where the target is read (its value at the budget is then "
                   "not measured; grid.past_target)")  # fmt: skip
    p.add_argument("--report-only", action="store_true",
                   help="with --reuse: rewrite grid.md, grid.png and grid_diag.png from the "
                   "CSVs, training nothing (e.g. after cells were stopped by hand)")  # fmt: skip
    g = p.add_argument_group("model (ProbeSettings)")
    g.add_argument("--n-layer", type=int, default=2)
    g.add_argument("--n-embd", type=int, default=128)
    g.add_argument("--n-head", type=int, default=2)
    g.add_argument("--chunk-size", type=int, default=64)
    g.add_argument("--runs", default=None, help="checkpoint folder (default "
                   "runs/long_context/NAME for --out .../NAME; --smoke: OUT/runs)")  # fmt: skip
    p.set_defaults(run=lambda args, argv: guarded(_run, args, argv))


def _options(args) -> dict:
    keys = ("n_layer", "n_embd", "n_head", "chunk_size", "steps", "probe_every", "val_windows",
            "diagnose_every", "distances", "batch_sizes")  # fmt: skip
    opts = {k: getattr(args, k) for k in keys}
    if args.smoke:
        opts.update(SMOKE)
    for name in ("steps", "probe_every", "val_windows", "diagnose_windows"):
        value = opts.get(name, getattr(args, name))
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if opts["diagnose_every"] < 0:
        raise ValueError(f"--diagnose-every must be >= 0, got {opts['diagnose_every']}")
    for d in opts["distances"]:
        if d < 2:
            raise ValueError(f"--distances must be >= 2, got {d}")
    for attention in args.attentions:
        remedies(attention)
    return opts


def _probe(model, factual) -> dict:
    """first, second, gain and, with a global part, the same with it switched off."""
    losses = token_losses(model, factual.inputs, factual.targets)
    first, second, gain = split_losses(losses, factual.first_mask, factual.second_mask)
    row = {"first": first, "second": second, "gain": gain, "ablated_second": "",
           "ablated_gain": ""}  # fmt: skip
    if global_parts(model):
        with ablate_global(model):
            ablated = token_losses(model, factual.inputs, factual.targets)
        _, row["ablated_second"], row["ablated_gain"] = split_losses(
            ablated, factual.first_mask, factual.second_mask
        )
    return row


def _run(args, argv) -> int:
    from tqdm.auto import tqdm

    opts = _options(args)
    out = out_dir(args)
    if not 0 < args.stop_fraction <= 1:
        raise ValueError(f"--stop-fraction must be in (0, 1], got {args.stop_fraction}")
    if args.report_only and not args.reuse:
        raise ValueError("--report-only rewrites the report of an existing grid: add --reuse")
    model = {k: opts[k] for k in ("n_layer", "n_embd", "n_head", "chunk_size")}
    settings = {"model": model, "steps": opts["steps"], "probe_every": opts["probe_every"],
                "val_windows": opts["val_windows"], "diagnose_every": opts["diagnose_every"],
                "diagnose_windows": args.diagnose_windows, "stop_fraction": args.stop_fraction,
                "schedules": {s: schedule_options(s, opts["steps"])
                              for s in SCHEDULES}}  # fmt: skip
    if args.stop_at_target:  # only when set: grids measured without it keep their settings
        settings["stop_at_target"] = True
    kw = dict(settings=settings, reuse=args.reuse, overwrite=args.overwrite)
    tables = SimpleNamespace(
        cells=ResultCSV(out / "grid.csv", COLUMNS, CELL_KEY, **kw),
        curve=ResultCSV(out / "grid_curve.csv", CURVE_COLUMNS, (*CELL_KEY, "step"), **kw),
        diag=ResultCSV(out / "grid_diag.csv", (*CELL_KEY, "step", *DIAG_COLUMNS), DIAG_KEY,
                       **kw),
    )  # fmt: skip
    # one checkpoint folder per --out: two grids sharing one would resume each other's cells
    runs = args.runs or (out / "runs" if args.smoke else Path("runs/long_context") / out.name)
    attentions = sorted(dict.fromkeys(args.attentions), key=lambda a: a != REFERENCE)
    cells = [
        {"distance": d, "schedule": s, "batch_size": b, "seed": seed, "attention": a}
        for d in opts["distances"] for s in args.schedules for b in opts["batch_sizes"]
        for seed in args.seeds for a in attentions
    ]  # fmt: skip
    todo = [] if args.report_only else [c for c in cells if not tables.cells.has(c)]
    data_key, data = None, None
    for cell in tqdm(todo, desc="grid cells", disable=args.no_progress):
        ps = ProbeSettings(**model, context=2 * cell["distance"], batch_size=cell["batch_size"],
                           steps=opts["steps"], seed=cell["seed"],
                           **schedule_options(cell["schedule"], opts["steps"]))  # fmt: skip
        key = (cell["distance"], cell["batch_size"], cell["seed"])
        if key != data_key:
            layout = SimpleNamespace(smoke=False, passage_len=cell["distance"],
                                     distance=cell["distance"], val_windows=opts["val_windows"],
                                     text="synthetic", corpus=None)  # fmt: skip
            data_key, data = key, probe_data(layout, ps, cell["seed"])
        row = _run_cell(cell, ps, data, tables, opts, args, runs)
        tables.cells.add(row)
        tqdm.write(f"{_label(cell)}: onset {row['onset'] or 'none'}, gain {row['gain']:.3f} at "
                   f"step {row['last_step']} ({row['stopped']})")  # fmt: skip
    for table in (tables.cells, tables.curve, tables.diag):  # with rows of runs beside this one
        table.reload()
    cpu = sum(float(r["cpu_s"]) for r in tables.cells.rows)
    extra = [settings_text(settings)]
    commands = record_command(out / "grid.commands.txt", argv, wrote=bool(todo),
                              fresh=args.overwrite)  # fmt: skip
    md = header("Copy-probe robustness grid (issue 44)", argv, cpu_s=cpu, extra=extra,
                commands=commands)  # fmt: skip
    md += "\n" + markdown(tables.cells.rows, tables.curve.rows, tables.diag.rows)
    (out / "grid.md").write_text(md)
    png = plot_grid(tables.cells.rows, tables.curve.rows, out / "grid.png")
    plot_diag(tables.diag.rows, out / "grid_diag.png")
    print(f"wrote {tables.cells.path}, {out / 'grid.md'}, {png}")
    return 0


def _label(cell) -> str:
    return (f"d={cell['distance']} {cell['schedule']} B={cell['batch_size']} "
            f"seed {cell['seed']} {cell['attention']}")  # fmt: skip


def _same_cell(row, cell) -> bool:
    return all(str(row[k]) == str(cell[k]) for k in CELL_KEY)


_TAGS = {"values": split_values, "surrogate": split_schedule, "linear": split_linear,
         "push": split_push, "outinit": split_outinit}  # fmt: skip
"""The grid's training-only remedies, spelled ``SPEC@name=...`` (each its module)."""


def remedies(attention: str) -> tuple:
    """``SPEC@tag@tag...`` -> (the spec to build, μ of ``@values``, the ``@surrogate``
    schedule, the ``@linear`` schedule, s of ``@push``, S of ``@outinit`` (already in the
    spec)), None where a tag is absent; each tag's parser sees the spec built so far.
    ValueError naming an unknown tag."""
    spec, *tags = attention.split("@")
    found = {}
    for tag in tags:
        name = tag.partition("=")[0]
        if name not in _TAGS or name in found:
            raise ValueError(
                f"attention {attention!r}: unknown or repeated tag @{name} "
                f"(one of {', '.join('@' + t for t in _TAGS)}, once each)"
            )
        spec, found[name] = _TAGS[name](f"{spec}@{tag}")
    return (spec, *(found.get(name) for name in _TAGS))


def _run_cell(cell, ps: ProbeSettings, data, tables, opts, args, runs) -> dict:
    """Train and probe one cell (module docstring); returns its ``grid.csv`` row."""
    train_data, factual, _ = data
    spec, mu, schedule, fade, push, _ = remedies(cell["attention"])  # @outinit: in spec
    is_ref = cell["attention"] == REFERENCE
    scale, linear_scale = Scale(), Scale()

    def set_weights(step: int) -> None:  # λ and α of the steps after ``step``
        if schedule is not None:
            scale.value = schedule.scale(step)
        if fade is not None:
            linear_scale.value = fade.scale(step)

    ref_onset = None
    if not is_ref:
        ref = {**cell, "attention": REFERENCE}
        ref_curve = [p for p in tables.curve.rows if _same_cell(p, ref)]
        ref_onset = onset(ref_curve) if tables.cells.has(ref) else None
    mcfg = model_config(spec, ps, vocab_size=train_data.vocab_size)
    clock = [time.process_time()]
    state = {"stop": None, "why": None}

    def stops(point) -> bool:
        step = int(point["step"])
        if step == 0:
            return False
        if copied(float(point["gain"]), float(point["second"]), step,
                  fraction=args.stop_fraction, reference_onset=ref_onset,
                  is_reference=is_ref):  # fmt: skip
            state["why"] = "copied"
        elif args.stop_at_target and not is_ref and past_target(step, reference_onset=ref_onset):
            state["why"] = "target"
        else:
            return False
        return True

    def record(model, step) -> bool:
        point = {**cell, "step": step}
        if not tables.curve.has(point):
            point.update(_probe(model, factual))
            every = opts["diagnose_every"]
            if every and step % every == 0 and not tables.diag.has({**point, "layer": 0}):
                for d in diagnose(model, factual, cell["distance"],
                                  num_windows=args.diagnose_windows):  # fmt: skip
                    tables.diag.add({**cell, "step": step, **d})
            now = time.process_time()
            point["cpu_s"], clock[0] = now - clock[0], now
            tables.curve.add(point)
        else:
            point = next(p for p in tables.curve.rows if _same_cell(p, cell)
                         and int(p["step"]) == step)  # fmt: skip
        set_weights(step)
        if stops(point):
            state["stop"] = step
            return True
        return False

    with (  # @push replaces the surrogate term: first, so that the others wrap it
        surrogate_push(push) if push is not None else contextlib.nullcontext(),
        scaled_surrogate(scale) if schedule else contextlib.nullcontext(),
        surrogate_values(mu) if mu is not None else contextlib.nullcontext(),
        faded_linear(linear_scale) if fade else contextlib.nullcontext(),
    ):
        init = TransformerLM(mcfg)
        record(init, 0)
        done = sorted((p for p in tables.curve.rows if _same_cell(p, cell)),
                      key=lambda p: int(p["step"]))  # fmt: skip
        set_weights(int(done[-1]["step"]))  # a resumed run continues from its last one
        stopped_before = next((p for p in done if stops(p)), None)
        run_dir = Path(runs) / run_label(cell["attention"], f"d{cell['distance']}",
                                         cell["schedule"], f"b{cell['batch_size']}",
                                         f"seed{cell['seed']}")  # fmt: skip
        train_s = ""
        if stopped_before is not None:  # a run that stopped in an earlier session
            state["stop"] = int(stopped_before["step"])
        else:
            model, facts = train_model(
                spec, train_data, ps, run_dir, progress=not args.no_progress,
                probe_every=opts["probe_every"], on_probe=record,
            )  # fmt: skip
            if state["stop"] is None:
                record(model, facts["steps"])
            train_s = facts["train_s"]
    curve = sorted((p for p in tables.curve.rows if _same_cell(p, cell)),
                   key=lambda p: int(p["step"]))  # fmt: skip
    if state["stop"] is not None:
        curve = [p for p in curve if int(p["step"]) <= state["stop"]]
    last = curve[-1]
    return {
        **cell, "context": ps.context, "budget": ps.steps, "last_step": last["step"],
        "stopped": state["why"] if state["stop"] is not None else "budget",
        "onset": onset(curve) or "", "first": last["first"], "second": last["second"],
        "gain": last["gain"], "ablated_gain": last["ablated_gain"],
        "state_size": init.decode_state_size(ps.context), "params": init.num_parameters(),
        "train_s": train_s, "cpu_s": sum(float(p["cpu_s"]) for p in curve),
    }  # fmt: skip
