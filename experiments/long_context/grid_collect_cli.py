"""``long_context.py grid-collect``: one grid's tables from cells measured in several folders.

A grid is often measured a seed or a schedule at a time, each run into its own ``--out`` (two
runs at a time on a small machine; ``grid_cli``). This gathers their rows into one folder and
writes the grid's report from them (``grid_report``: the table a reader scans, the pass rate
per setting, the plots), training nothing:

- every source folder holds ``grid.csv``, ``grid_curve.csv`` and ``grid_diag.csv`` measured
  under the same settings (``grid.settings.json``, compared as JSON); a folder measured under
  others (model, budget, evaluations, schedules, stopping rule) is refused, naming what differs;
- rows are kept for the attentions named (``--attentions``, softmax among them). A row
  measured under another name is kept as one of them only when both build the same model
  (``same_model``: the same resolved ``AttentionSpec`` and the same initial weights), as
  ``soft_hash_far_local:global_out_tied=True`` is ``soft_hash_far_local_tied``; names with
  training-only remedy tags (``SPEC@tag``) match only themselves. The report names every
  such alias;
- a cell in two folders (softmax's rows copied beside a candidate) must hold the same
  measurements in both (timings aside) or it is refused.
- evaluations and diagnostics of a run without its ``grid.csv`` row (still in progress) are
  left out, so the report and plots show finished cells only.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch

from polysketch.nn import TransformerLM

from .cli import guarded, header
from .grid import CELL_KEY
from .grid_cli import COLUMNS, CURVE_COLUMNS, DIAG_KEY, REFERENCE
from .grid_diagnostics import DIAG_COLUMNS
from .grid_report import markdown, plot_diag, plot_grid, settings_text
from .probe_training import ProbeSettings, model_config
from .report import ResultCSV, parse_value

__all__ = ["register", "collect", "same_model"]

TIMINGS = ("train_s", "cpu_s")
"""Columns that may differ between two copies of one measured cell (wall and CPU time)."""

_TABLES = (  # file, columns, key
    ("grid.csv", COLUMNS, CELL_KEY),
    ("grid_curve.csv", CURVE_COLUMNS, (*CELL_KEY, "step")),
    ("grid_diag.csv", (*CELL_KEY, "step", *DIAG_COLUMNS), DIAG_KEY),
)


def register(sub) -> None:
    p = sub.add_parser(
        "grid-collect",
        help="one grid's tables and report from cells measured into several grid folders",
    )
    p.add_argument("--from", dest="sources", nargs="+", required=True, metavar="FOLDER",
                   help="grid folders (each with grid.csv, grid_curve.csv, grid_diag.csv "
                   "and grid.settings.json), all measured under the same settings")  # fmt: skip
    p.add_argument("--attentions", nargs="+", required=True,
                   help="softmax and the candidates to keep (a row under another name that "
                   "builds the same model is kept under the name given here)")  # fmt: skip
    p.add_argument("--out", required=True, help="folder for the collected tables and report")
    p.add_argument("--overwrite", action="store_true", help="replace an existing collection")
    p.set_defaults(table="grid-collect", threads=1,
                   run=lambda args, argv: guarded(_run, args, argv))  # fmt: skip


def _model(name: str, settings: dict, context: int) -> TransformerLM:
    ps = ProbeSettings(**settings["model"], context=context)
    return TransformerLM(model_config(name, ps))


def same_model(a: str, b: str, settings: dict, context: int) -> bool:
    """Whether attentions ``a`` and ``b`` build the same probe model at the grid's size and
    ``context``: equal resolved specs and every initial weight equal (seed 0). Remedy tags
    (``@``) change training, not the model: a tagged name is the same only as itself."""
    if a == b:
        return True
    if "@" in a or "@" in b:
        return False
    ma, mb = _model(a, settings, context), _model(b, settings, context)
    if ma.spec != mb.spec:
        return False
    wa, wb = ma.state_dict(), mb.state_dict()
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _read(folder: Path) -> tuple[dict, dict[str, list[dict]]]:
    """A grid folder's settings and its three tables' rows (values parsed as ``ResultCSV``
    reads them back)."""
    settings_path = folder / "grid.settings.json"
    if not settings_path.is_file():
        raise FileNotFoundError(f"--from {folder}: no grid.settings.json (not a grid folder)")
    settings = json.loads(settings_path.read_text())
    tables = {}
    for file, columns, _ in _TABLES:
        with open(folder / file, newline="") as f:
            tables[file] = [{k: parse_value(row.get(k) or "") for k in columns}
                            for row in csv.DictReader(f)]  # fmt: skip
    return settings, tables


def _aliases(names, wanted, settings: dict, contexts: dict) -> dict:
    """Every measured attention name -> the name of ``wanted`` it is kept as (absent: dropped)."""
    keep = {}
    for name in names:
        if name in wanted:
            keep[name] = name
            continue
        for w in wanted:
            if w != REFERENCE and same_model(name, w, settings, contexts[name]):
                keep[name] = w
                break
    return keep


def collect(sources, attentions) -> tuple[dict, dict[str, list[dict]], dict]:
    """The sources' common settings, their merged tables (rows of ``attentions`` only, aliases
    renamed) and the aliases used ({measured name: kept name}); ValueError for settings that
    differ, a cell measured differently in two folders, or no softmax among ``attentions``."""
    wanted = list(dict.fromkeys(attentions))
    if REFERENCE not in wanted:
        raise ValueError(f"--attentions must include {REFERENCE} (every target reads its onset)")
    folders = [Path(s) for s in sources]
    read = [(folder, *_read(folder)) for folder in folders]
    settings = read[0][1]
    for folder, other, _ in read[1:]:
        if other != settings:
            diff = sorted(k for k in set(other) | set(settings) if other.get(k) != settings.get(k))
            raise ValueError(
                f"--from {folder} was measured under other settings than {folders[0]} "
                f"(differing: {diff}): its cells are not comparable"
            )
    contexts = {}
    for _, _, tables in read:
        for r in tables["grid.csv"]:
            contexts.setdefault(r["attention"], int(r["context"]))
    keep = _aliases(sorted(contexts), wanted, settings, contexts)
    merged = {}
    for file, columns, key in _TABLES:
        found, origin = {}, {}
        for folder, _, tables in read:
            for row in tables[file]:
                if row["attention"] not in keep:
                    continue
                row = {**row, "attention": keep[row["attention"]]}
                k = tuple(str(row[c]) for c in key)
                if k not in found:
                    found[k], origin[k] = row, folder
                    continue
                differ = [c for c in columns if c not in TIMINGS
                          and str(found[k][c]) != str(row[c])]  # fmt: skip
                if differ:
                    raise ValueError(
                        f"{file}: the row {dict(zip(key, k, strict=True))} is in {origin[k]} "
                        f"and {folder} with different {differ}: one cell measured twice"
                    )
        order = [REFERENCE, *[w for w in wanted if w != REFERENCE]]
        rows = found.values()
        if file != "grid.csv":  # a run still in progress has evaluations but no cell yet
            cells = {tuple(str(r[c]) for c in CELL_KEY) for r in merged["grid.csv"]}
            rows = [r for r in rows if tuple(str(r[c]) for c in CELL_KEY) in cells]
        merged[file] = sorted(
            rows,
            key=lambda r: (r["distance"], r["schedule"], r["batch_size"], r["seed"],
                           order.index(r["attention"]), *(r[c] for c in key[len(CELL_KEY):])),
        )  # fmt: skip
    aliases = {name: kept for name, kept in keep.items() if name != kept}
    return settings, merged, aliases


def _run(args, argv) -> int:
    out = Path(args.out)
    sources = [Path(s) for s in args.sources]
    if any(out.resolve() == s.resolve() for s in sources):
        raise ValueError(f"--out {out} is one of the --from folders: collect into a new one")
    if (out / "grid.csv").exists() and not args.overwrite:
        raise ValueError(f"{out / 'grid.csv'} exists: pass --overwrite to collect again")
    settings, merged, aliases = collect(sources, args.attentions)
    tables = {}
    for file, columns, key in _TABLES:
        tables[file] = ResultCSV(out / file, columns, key, settings=settings, overwrite=True)
        for row in merged[file]:
            tables[file].add(row)
    cells, curve, diag = (tables[file].rows for file, _, _ in _TABLES)
    if not any(r["attention"] != REFERENCE for r in cells):
        raise ValueError(f"no cell of {args.attentions} besides {REFERENCE} in the --from folders")
    cpu = sum(float(r["cpu_s"]) for r in cells)
    origin = (f"Collected (`grid-collect`, nothing trained) from {len(sources)} grid folders: "
              + ", ".join(f"`{s}`" for s in sources) + ".")  # fmt: skip
    if aliases:
        origin += " Rows measured under another name that builds the same model are listed as " + (
            ", ".join(f"`{kept}` (measured as `{name}`)" for name, kept in aliases.items())
        ) + "."  # fmt: skip
    md = header("Copy-probe robustness grid (issue 44)", argv, cpu_s=cpu, resumable=False,
                rows_cpu=True, extra=[origin, settings_text(settings)])  # fmt: skip
    md += "\n" + markdown(cells, curve, diag)
    (out / "grid.md").write_text(md)
    png = plot_grid(cells, curve, out / "grid.png")
    plot_diag(diag, out / "grid_diag.png")
    print(
        f"collected {len(cells)} cells from {len(sources)} folders: wrote {out / 'grid.md'}, {png}"
    )
    return 0
