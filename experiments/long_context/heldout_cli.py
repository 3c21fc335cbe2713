"""``long_context.py heldout``: the held-out table of a grid run to its budget (issue 70).

Reads a grid folder measured with no early stop (``grid --stop-fraction 1``, every run to the
budget) and writes, beside it, ``heldout.csv`` (one row per cell), ``heldout.md`` (the table
with the target per cell and the count) and ``heldout.png`` (gain against step of softmax and
the candidate per cell, with the ablated gain, and the read steps marked). The reading rule is
``heldout``'s: means of the evaluation at the read step and the two before it.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from polysketch.eval.plots import save_png, subplots

from .cli import guarded, header
from .grid import CELL_KEY
from .grid_cli import REFERENCE
from .grid_report import settings_text
from .heldout import BUDGET_BAR, EARLY_BAR, READ_EVALUATIONS, heldout_summary
from .report import fmt, markdown_table

__all__ = ["register", "COLUMNS", "heldout_rows"]

COLUMNS = ("distance", "schedule", "batch_size", "seed", "attention", "ref_onset",
           "softmax_copies", "ref_gain", "at_step", "gain_at", "early", "gain_end", "end",
           "ablated_at", "ablated_end", "own_onset", "meets")  # fmt: skip


def register(sub) -> None:
    p = sub.add_parser("heldout", help="the held-out table of a grid run to its budget "
                       "(issue 70): gains as means of three evaluations")  # fmt: skip
    p.add_argument("--grid", required=True, help="the grid folder (grid.csv, grid_curve.csv)")
    p.add_argument("--attention", required=True, help="the candidate (softmax is the reference)")
    p.add_argument("--out", default=None, help="folder for heldout.* (default: --grid)")
    p.set_defaults(table="heldout", threads=1, run=lambda args, argv: guarded(_run, args, argv))


def _read(path: Path) -> list[dict]:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: --grid names a grid folder")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _key(row) -> tuple:
    return tuple(str(row[k]) for k in CELL_KEY)


def heldout_rows(cells: list[dict], curve: list[dict], attention: str) -> list[dict]:
    """One row per (d, schedule, B, seed) where both softmax and ``attention`` finished."""
    done = {_key(r) for r in cells}
    out = []
    for c in cells:
        if c["attention"] != attention:
            continue
        ref = {**c, "attention": REFERENCE}
        if _key(ref) not in done:
            continue
        budget = int(c["budget"])
        pts = [p for p in curve if _key(p) == _key(c)]
        ref_pts = [p for p in curve if _key(p) == _key(ref)]
        s = heldout_summary(ref_pts, pts, budget)
        out.append({**{k: c[k] for k in CELL_KEY}, **{k: s[k] for k in COLUMNS if k in s}})
    return sorted(out, key=lambda r: (int(r["distance"]), r["schedule"], int(r["batch_size"]),
                                      int(r["seed"])))  # fmt: skip


def _markdown(rows: list[dict]) -> str:
    head = ["d", "schedule", "B", "seed", "softmax onset", "softmax gain @ end",
            "gain @ 1.5× onset (read at)", "× softmax", "gain @ end", "× softmax",
            "ablated @ 1.5× / end", "own onset", "target"]  # fmt: skip
    body = []
    for r in rows:
        if not r["softmax_copies"]:
            verdict = "softmax does not copy: not counted"
        else:
            verdict = "-" if r["meets"] is None else ("**yes**" if r["meets"] else "no")
        body.append([r["distance"], r["schedule"], r["batch_size"], r["seed"],
                     fmt(r["ref_onset"]), fmt(r["ref_gain"], ".3f"),
                     f"{fmt(r['gain_at'], '.3f')} ({fmt(r['at_step'])})", fmt(r["early"], ".2f"),
                     fmt(r["gain_end"], ".3f"), fmt(r["end"], ".2f"),
                     f"{fmt(r['ablated_at'], '.3f')} / {fmt(r['ablated_end'], '.3f')}",
                     fmt(r["own_onset"]), verdict])  # fmt: skip
    counted = [r for r in rows if r["softmax_copies"] and r["meets"] is not None]
    met = sum(bool(r["meets"]) for r in counted)
    return (markdown_table(head, body) + f"\nTarget met in **{met} of {len(counted)}** counted "
            f"cells ({len(rows) - len(counted)} not counted).\n")  # fmt: skip


def _plot(rows, curve, attention, path):
    fig, axes = subplots(max(1, len(rows)), ncols=min(4, max(1, len(rows))))
    for ax, r in zip(axes, rows, strict=False):
        for name, style in ((REFERENCE, "--"), (attention, "-")):
            key = _key({**r, "attention": name})
            pts = sorted((p for p in curve if _key(p) == key), key=lambda p: int(p["step"]))
            steps = [int(p["step"]) for p in pts]
            ax.plot(steps, [float(p["gain"]) for p in pts], style, lw=1, label=f"{name} gain")
            if name != REFERENCE:
                abl = [(int(p["step"]), float(p["ablated_gain"])) for p in pts
                       if p["ablated_gain"] != ""]  # fmt: skip
                ax.plot(*zip(*abl, strict=True), ":", lw=1, label="far branch off")
        if r["at_step"] is not None:
            ax.axvline(r["at_step"], color="grey", lw=0.5)
        ax.set_title(f"d = {r['distance']}, seed {r['seed']}", fontsize=8)
        ax.set_xlabel("step")
        ax.set_ylabel("copy gain (nats/byte)")
    axes[0].legend(fontsize=6)
    return save_png(fig, path)


def _run(args, argv) -> int:
    grid = Path(args.grid)
    out = Path(args.out) if args.out else grid
    out.mkdir(parents=True, exist_ok=True)
    cells, curve = _read(grid / "grid.csv"), _read(grid / "grid_curve.csv")
    settings = json.loads((grid / "grid.settings.json").read_text())
    if settings.get("stop_fraction", 0) < 1 or settings.get("stop_at_target"):
        raise ValueError(f"{grid} was measured with an early stop: a held-out cell trains to "
                         "its budget (grid --stop-fraction 1, no --stop-at-target)")  # fmt: skip
    rows = heldout_rows(cells, curve, args.attention)
    with open(out / "heldout.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    cpu = sum(float(c["cpu_s"]) for c in cells)
    rule = (f"Each value is the mean of the evaluation at the read step and the "
            f"{READ_EVALUATIONS - 1} before it. Target per cell: gain at 1.5× softmax's onset ≥ "
            f"{EARLY_BAR}× softmax's gain at the budget, gain at the budget ≥ {BUDGET_BAR}× "
            "softmax's, ablated gain (far branch off) ≤ 0.05 at both.")  # fmt: skip
    md = header(f"Held-out copy probe: {args.attention} (issue 70)", argv, cpu_s=cpu,
                extra=[settings_text(settings), rule], resumable=False, rows_cpu=True)  # fmt: skip
    (out / "heldout.md").write_text(md + "\n" + _markdown(rows))
    png = _plot(rows, curve, args.attention, out / "heldout.png")
    print(f"wrote {out / 'heldout.csv'}, {out / 'heldout.md'}, {png}")
    return 0
