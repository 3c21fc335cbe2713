"""The grid's markdown tables and plot, from its three CSVs (``grid_cli``).

``summaries(cells, curve)`` pairs every candidate cell with softmax's of the same distance,
schedule, batch size and seed (``grid.cell_summary``); ``markdown`` writes the table one
scans (one line per candidate cell), the pass rate per candidate and setting, and the
diagnostics at init, just before the onset and at it; ``plot_grid`` draws the candidates'
onsets against softmax's and the recurrence loss of every run; ``plot_diag`` the global
branch's weight on the copy's source and the query's cosine to the source's keys against
training steps, per layer and run.
"""

from __future__ import annotations

from polysketch.eval.plots import save_png, subplots

from .grid import CELL_KEY, LN26, ONSET_LOSS, cell_summary
from .report import fmt, markdown_table

__all__ = ["summaries", "markdown", "plot_grid", "settings_text"]

REFERENCE = "softmax"
GROUP = ("distance", "schedule", "batch_size", "seed")


def _curve_of(curve, cell) -> list[dict]:
    rows = [p for p in curve if all(str(p[k]) == str(cell[k]) for k in CELL_KEY)]
    return sorted(rows, key=lambda p: int(p["step"]))


def summaries(cells, curve) -> list[dict]:
    """One dict per candidate cell whose softmax cell is measured: the cell's keys, its row's
    ``stopped``, and ``grid.cell_summary``'s numbers."""
    out = []
    done = {tuple(str(r[k]) for k in CELL_KEY): r for r in cells}
    for r in cells:
        if r["attention"] == REFERENCE:
            continue
        ref_key = tuple(str(r[k]) for k in GROUP) + (REFERENCE,)
        if ref_key not in done:
            continue
        ref = done[ref_key]
        s = cell_summary(_curve_of(curve, ref), _curve_of(curve, r))
        out.append({**{k: r[k] for k in CELL_KEY}, "stopped": r["stopped"],
                    "ref_stopped": ref["stopped"], "ref_last": ref["last_step"], **s})  # fmt: skip
    return sorted(out, key=lambda s: (s["attention"], *(s[k] for k in GROUP)))


def _num(value, spec=".3f") -> str:
    return "-" if value is None or value == "" else format(float(value), spec)


def _main_table(rows) -> str:
    head = ("d", "schedule", "B", "seed", "softmax onset", "softmax gain (step)", "attention",
            "gain @ 1.5× onset (step)", "× softmax", "ablated", "own onset",
            "gain at end (step)", "ablated at end", "target")  # fmt: skip
    body = []
    for s in rows:
        stop = "" if s["stopped"] == "budget" else f", stopped: {s['stopped']}"
        ref_stop = "" if s["ref_stopped"] == "budget" else ", stopped"
        verdict = {True: "**yes**", False: "no", None: "-"}[s["passes"]]
        body.append((
            s["distance"], s["schedule"], s["batch_size"], s["seed"],
            s["ref_onset"] if s["ref_onset"] is not None else "none",
            f"{_num(s['ref_gain'])} ({s['ref_last']}{ref_stop})",
            f"`{s['attention']}`",
            "-" if s["gain_at"] is None else f"{_num(s['gain_at'])} ({s['at_step']})",
            _num(s["ratio_at"], ".2f"), _num(s["ablated_at"]),
            s["onset"] if s["onset"] is not None else "none",
            f"{_num(s['gain_last'])} ({s['last_step']}{stop})", _num(s["ablated_last"]),
            verdict,
        ))  # fmt: skip
    return markdown_table(head, body) + "\n"


def _pass_table(rows) -> str:
    groups: dict[tuple, list] = {}
    for s in rows:
        groups.setdefault((s["attention"], s["distance"], s["schedule"], s["batch_size"]),
                          []).append(s)  # fmt: skip
    head = ("attention", "d", "schedule", "B", "seeds", "softmax onsets", "own onsets",
            "target met")  # fmt: skip
    body = []
    for (att, d, sched, b), group in groups.items():
        counted = [s for s in group if s["passes"] is not None]
        met = sum(bool(s["passes"]) for s in counted)
        body.append((f"`{att}`", d, sched, b, ",".join(str(s["seed"]) for s in group),
                     " / ".join(str(s["ref_onset"] or "none") for s in group),
                     " / ".join(str(s["onset"] or "none") for s in group),
                     f"{met} of {len(counted)}"))  # fmt: skip
    total: dict[str, list] = {}
    for s in rows:
        if s["passes"] is not None:
            total.setdefault(s["attention"], []).append(bool(s["passes"]))
    lines = [markdown_table(head, body), ""]
    for att, flags in total.items():
        lines.append(
            f"`{att}` meets the target in **{sum(flags)} of {len(flags)}** measured "
            f"cells ({100 * sum(flags) / len(flags):.0f} %; issue 44 asks ≥ 90 %)."
        )
    return "\n".join(lines) + "\n"


def _diag_steps(diag_rows, onset_step) -> list[int]:
    """Step 0, the last diagnosed step before the onset (the last one if none), the first at
    or after it."""
    steps = sorted({int(r["step"]) for r in diag_rows})
    if not steps:
        return []
    before = [s for s in steps if onset_step is None or s < onset_step]
    after = [] if onset_step is None else [s for s in steps if s >= onset_step][:1]
    return sorted({steps[0], *(before[-1:]), *after})


def _next(r) -> str:
    return "" if r.get("next_weight", "") == "" else f" ({float(r['next_weight']):.2g})"


def _cosines(r) -> str:
    if r.get("next_cos", "") == "":  # a row written before the columns existed
        return "-"
    own = 2 * float(r["source_cos"]) - float(r["next_cos"])  # cos(q_i, k_{i−d})
    return f"{own:.2f} / {float(r['next_cos']):.2f} / {float(r['far_cos']):.2f}"


def _values(r) -> str:
    if r.get("next_value", "") == "":  # a row written before the columns existed
        return "-"
    own = 2 * float(r["source_value"]) - float(r["next_value"])  # z at j = i − d
    return f"{own:+.2f} / {float(r['next_value']):+.2f}"


def _diag_table(rows, diag) -> str:
    head = ("d", "schedule", "B", "seed", "attention", "onset", "step", "layer", "τ",
            "q buckets", "k buckets", "k usage", "source weight (next)", "source lift",
            "surrogate ‖G_sur‖/‖G_map‖ (cos)", "global / window rms",
            "weight, every feature", "cos(q, k): i − d / i + 1 − d / far",
            "value z: i − d / i + 1 − d")  # fmt: skip
    body = []
    for s in rows:
        mine = [r for r in diag if all(str(r[k]) == str(s[k]) for k in CELL_KEY)]
        for step in _diag_steps(mine, s["onset"]):
            for r in sorted((r for r in mine if int(r["step"]) == step),
                            key=lambda r: int(r["layer"])):  # fmt: skip
                cos = "" if r["surrogate_cos"] == "" else f" ({float(r['surrogate_cos']):.2f})"
                body.append((
                    s["distance"], s["schedule"], s["batch_size"], s["seed"],
                    f"`{s['attention']}`", s["onset"] or "none", step, r["layer"],
                    _num(r["tau"], ".2f"), _num(r["q_buckets"], ".1f"),
                    _num(r["k_buckets"], ".1f"), _num(r["k_usage"], ".0f"),
                    fmt(float(r["source_weight"]), ".2g") + _next(r),
                    _num(r["source_lift"], ".2f"),
                    _num(r["surrogate_ratio"], ".2f") + cos,
                    f"{float(r['global_rms']):.3g} / {float(r['window_rms']):.3g}",
                    _num(r.get("source_weight_all", ""), ".2g"),
                    _cosines(r),
                    _values(r),
                ))  # fmt: skip
    return markdown_table(head, body) + "\n" if body else "(no diagnostics yet)\n"


def _schedule_text(name: str, o: dict) -> str:
    """One schedule of a grid's settings, as measured (a grid before 2026-12-07 records its
    `cli` cells' 100 warm-up steps: they are what ``warmup100`` names now)."""
    if o["schedule"] == "cosine":
        return (f"`{name}` = lr {o['lr']}, warmup {o['warmup_steps']}, cosine to {o['min_lr']} "
                "over the budget")  # fmt: skip
    return f"`{name}` = lr {o['lr']} after {o['warmup_steps']} warm-up steps"


def settings_text(settings: dict) -> str:
    """The paragraph of model, budget, evaluations and schedules of a grid's settings (the
    ``grid.settings.json`` every table of one grid shares)."""
    m, stop = settings["model"], settings["stop_fraction"]
    screening = ""
    if settings.get("stop_at_target"):
        screening = (". Screening (`--stop-at-target`): candidates stop at their first "
                     "evaluation past 1.5× softmax's onset (`stopped: target`)")  # fmt: skip
    schedules = "; ".join(_schedule_text(k, v) for k, v in settings["schedules"].items())
    return (
        f"Model: {m['n_layer']} layer(s) × {m['n_embd']}, {m['n_head']} heads, chunk "
        f"{m['chunk_size']}; random-letter passages of d bytes recurring d tokens later in "
        f"windows of 2d. Budget {settings['steps']} steps; evaluations at step 0 and every "
        f"{settings['probe_every']} steps on {settings['val_windows']} held-out windows per "
        f"seed (diagnostics every {settings['diagnose_every']} steps on "
        f"{settings['diagnose_windows']}). Schedules: {schedules}. "
        + (f"Early stop at gain ≥ {stop} × ln 26 with recurrence loss ≤ {1 - stop:.2f} × ln 26 "
           "(others: also past 1.5× softmax's onset)" if stop < 1 else
           "No early stop: every run trains to the budget")
        + screening + ". CPU time: process time of training, probing and diagnostics (one "
        "thread)."
    )


def markdown(cells, curve, diag) -> str:
    """The grid's tables (module docstring)."""
    rows = summaries(cells, curve)
    refs = [r for r in cells if r["attention"] == REFERENCE]
    parts = [
        "Gain = loss on first occurrences − loss on recurrences (nats/byte; ln 26 = "
        f"{LN26:.3f} is a perfect copy). Onset = the first evaluation with recurrence loss < "
        f"ln 26 / 2 = {ONSET_LOSS:.3f}. A value at a step is read at the last evaluation at or "
        "before it. Target (issue 44): gain at 1.5× softmax's onset ≥ 0.5× softmax's gain at "
        "its last evaluation, with the global branch switched off ('ablated') ≤ 0.05.",
        "",
        "## Every candidate cell",
        "",
        _main_table(rows) if rows else "(no candidate cell with its softmax cell yet)\n",
        "## Target met, per setting",
        "",
        _pass_table(rows) if rows else "(nothing measured yet)\n",
        "## Softmax cells",
        "",
        markdown_table(
            ("d", "schedule", "B", "seed", "onset", "gain (step)", "CPU s"),
            [
                (
                    r["distance"],
                    r["schedule"],
                    r["batch_size"],
                    r["seed"],
                    r["onset"] or "none",
                    f"{_num(r['gain'])} ({r['last_step']}, {r['stopped']})",
                    f"{float(r['cpu_s']):.0f}",
                )
                for r in refs
            ],
        )
        + "\n",  # fmt: skip
        "## What the global branch sees (grid_diag.csv; at init, the last diagnosis before "
        "the onset, the first at or after it)",
        "",
        _diag_table(rows, diag),
    ]
    return "\n".join(parts)


def plot_grid(cells, curve, path):
    """Panel 1: each candidate cell's onset against softmax's (no onset drawn at the top, open
    markers; × at the step where a screening run stopped without one), with y = x and
    y = 1.5x; one panel per distance: recurrence loss vs step of every run (softmax dashed)."""
    rows = summaries(cells, curve)
    distances = sorted({int(r["distance"]) for r in cells})
    fig, axes = subplots(1 + len(distances), ncols=min(3, 1 + len(distances)))
    ax = axes[0]
    budget = max((int(r["budget"]) for r in cells), default=1)
    colors = {"cli": "tab:red", "warmup100": "tab:orange", "constant": "tab:blue"}
    for s in rows:
        if s["ref_onset"] is None:
            continue
        color, size = colors.get(s["schedule"], "k"), 18 + int(s["distance"]) / 40
        if s["onset"] is not None:
            ax.scatter(s["ref_onset"], s["onset"], color=color, marker="o", s=size)
        elif s["stopped"] == "target":  # no onset up to its screening stop: not "none"
            ax.scatter(s["ref_onset"], s["last_step"], color=color, marker="x", s=size)
        else:
            ax.scatter(s["ref_onset"], 1.08 * budget, color=color, marker="^",
                       facecolors="none", s=size)  # fmt: skip
    top = 1.1 * budget
    ax.plot([0, top], [0, top], "k-", lw=0.8, label="y = x")
    ax.plot([0, top / 1.5], [0, top], "k--", lw=0.8, label="y = 1.5x")
    ax.axhline(budget, color="grey", lw=0.5)
    for name, c in colors.items():
        ax.scatter([], [], color=c, label=f"schedule {name}")
    ax.scatter([], [], color="grey", marker="^", facecolors="none", label="no onset (drawn on top)")
    ax.scatter([], [], color="grey", marker="x", label="no onset by its stop")
    ax.set_xlim(0, top)
    ax.set_ylim(0, 1.15 * budget)
    ax.set_title("onsets (marker size: distance)", fontsize=8)
    ax.set_xlabel("softmax onset (step)")
    ax.set_ylabel("candidate onset (step)")
    ax.legend(fontsize=6)
    for ax, d in zip(axes[1:], distances, strict=True):
        for r in (r for r in cells if int(r["distance"]) == d):
            pts = _curve_of(curve, r)
            style = "--" if r["attention"] == REFERENCE else "-"
            ax.plot([int(p["step"]) for p in pts], [float(p["second"]) for p in pts], style,
                    color=colors.get(r["schedule"], "k"), lw=0.8, alpha=0.7)  # fmt: skip
        ax.axhline(ONSET_LOSS, color="grey", lw=0.5)
        ax.set_title(f"d = {d} (softmax dashed; red cli, blue constant)", fontsize=8)
        ax.set_xlabel("step")
        ax.set_ylabel("recurrence loss (nats/byte)")
    return save_png(fig, path)


def plot_diag(diag, path):
    """Per layer with a soft-hash global branch, two panels against the step, one line per
    run (d, schedule, B, seed, attention) of ``grid_diag.csv``: the weight on the copy's two
    source keys with every feature (``source_weight_all``; the buckets' alone for rows written
    before that column), log scale; cos(q_i, k_{i−d}) − the far keys' mean cosine (solid)
    and cos(q_i, k_{i+1−d}) − the same (dotted), for rows that have the cosines; and the value
    z-scores at j = i − d (solid) and i + 1 − d (dotted), for rows that have them. Returns the
    path, or None without diagnostics."""
    if not diag:
        return None
    layers = sorted({int(r["layer"]) for r in diag})
    runs = sorted({tuple(str(r[k]) for k in CELL_KEY) for r in diag})
    fig, axes = subplots(3 * len(layers), ncols=3)
    for n, key in enumerate(runs):
        mine = [r for r in diag if tuple(str(r[k]) for k in CELL_KEY) == key]
        d, schedule, b, seed, attention = key
        short = attention.replace("soft_hash_far_local", "preset")
        label = f"{short} (d {d}, {schedule}, B {b}, s{seed})"
        color = f"C{n % 10}"
        for i, layer in enumerate(layers):
            rows = sorted(
                (r for r in mine if int(r["layer"]) == layer), key=lambda r: int(r["step"])
            )
            steps = [int(r["step"]) for r in rows]
            weight = [float(r.get("source_weight_all") or r["source_weight"]) for r in rows]
            axes[3 * i].semilogy(steps, weight, color=color, lw=0.9, label=label)
            cos = [r for r in rows if r.get("source_cos", "") != ""]
            if cos:
                far = [float(r["far_cos"]) for r in cos]
                x = [int(r["step"]) for r in cos]
                if all(r.get("next_cos", "") != "" for r in cos):
                    nxt = [float(r["next_cos"]) for r in cos]
                    own = [2 * float(r["source_cos"]) - v for r, v in zip(cos, nxt, strict=True)]
                    axes[3 * i + 1].plot(x, [a - f for a, f in zip(own, far, strict=True)],
                                         color=color, lw=0.9)  # fmt: skip
                    axes[3 * i + 1].plot(x, [a - f for a, f in zip(nxt, far, strict=True)],
                                         ":", color=color, lw=0.9)  # fmt: skip
                else:  # the two sources' mean only
                    src = [float(r["source_cos"]) for r in cos]
                    axes[3 * i + 1].plot(x, [a - f for a, f in zip(src, far, strict=True)],
                                         "--", color=color, lw=0.9)  # fmt: skip
            zs = [r for r in rows if r.get("next_value", "") != ""]
            if zs:
                x = [int(r["step"]) for r in zs]
                nxt = [float(r["next_value"]) for r in zs]
                own = [2 * float(r["source_value"]) - v for r, v in zip(zs, nxt, strict=True)]
                axes[3 * i + 2].plot(x, own, color=color, lw=0.9)
                axes[3 * i + 2].plot(x, nxt, ":", color=color, lw=0.9)
    for i, layer in enumerate(layers):
        axes[3 * i].set_title(f"layer {layer}: weight on the two source keys", fontsize=8)
        axes[3 * i].set_ylabel("weight (every feature)")
        axes[3 * i + 1].set_title(f"layer {layer}: cos(q, k_src) − mean cos(q, k_far)", fontsize=8)
        axes[3 * i + 1].axhline(0.0, color="grey", lw=0.5)
        for style, what in (("-", "src = i − d"), (":", "src = i + 1 − d"), ("--", "both")):
            axes[3 * i + 1].plot([], [], style, color="k", lw=0.9, label=what)
        axes[3 * i + 1].legend(fontsize=6)
        axes[3 * i + 2].set_title(f"layer {layer}: value z-score of the source (> 0: pulls q)",
                                  fontsize=8)  # fmt: skip
        axes[3 * i + 2].axhline(0.0, color="grey", lw=0.5)
        for ax in axes[3 * i : 3 * i + 3]:
            ax.set_xlabel("step")
    axes[0].legend(fontsize=5)
    return save_png(fig, path)
