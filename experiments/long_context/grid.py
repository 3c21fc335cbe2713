"""The robustness grid of the copy probe (issue 44): its cells, onsets and gains.

A **cell** is (distance d, schedule, batch size B, seed, attention): the repeat probe's model
(``repeat_probe``, ``probe_training``) trained on windows of T = 2d bytes in which passages
of d random letters recur d tokens after they start, for a fixed budget of S steps, and
probed every n steps on held-out windows. Its **curve** is, at each evaluation t, the loss
on first occurrences ℓ₁(t) and on recurrences ℓ₂(t) (nats/byte), the **gain**
g(t) = ℓ₁(t) − ℓ₂(t) (the repeat probe's ``drop``: ln 26 ≈ 3.258 for a perfect copy, 0
without one) and, for attentions with a global branch, the gain with that branch switched off
g_abl(t) (``polysketch.nn.ablate_global``; the 64-token window alone cannot copy from d ≥ 512
back, so g_abl > 0 would mean the copy does not go through the global branch). From it:

    onset        t₀ = the first evaluation with ℓ₂(t) < ln 26 / 2;
    value at t   the value at the last evaluation ≤ t (evaluations every n steps, so a
                 step between two evaluations is read at the earlier one: never flattering).

Per (d, schedule, B, seed), with softmax's onset t₀ˢ and its gain gˢ at its last evaluation,
a candidate's row holds g(1.5 t₀ˢ), g at its last evaluation, its own onset and g_abl at
both; issue 44's target for a cell is g(1.5 t₀ˢ) ≥ ½ gˢ with g_abl(1.5 t₀ˢ) ≤ 0.05
(``passes``). A cell where softmax has no onset within the budget says nothing of the
candidate and is not counted.

**Schedules** (``SCHEDULES``): ``"cli"`` is what ``polysketch train --steps S`` gives a user
who sets only ``--steps``: ``TrainConfig``'s lr and min_lr, the CLI's own warmup
(``polysketch.train.default_warmup(S)``: 50 steps at S = 500; called, not copied, so the two
cannot drift apart) and cosine decay over the budget; ``"warmup100"`` is the same with
``TrainConfig().warmup_steps`` = 100 warm-up steps, which is what the grid's cells labelled
``cli`` ran before 2026-12-07 (their ``grid.settings.json`` records it; issue 70 item 1);
``"constant"`` is the copy probe's of ``docs/results/long_context/`` (lr 1e-3, constant after
50 warm-up steps).

**Early stop** (``copied``): a run may stop at the first evaluation where g ≥ f · ln 26 and
ℓ₂ ≤ (1 − f) · ln 26 (default f = 0.95; softmax's gains level off at 0.98–1.0 · ln 26; the
second condition keeps a run whose first occurrences got worse, g inflated by ℓ₁ > ln 26,
from counting as copied) and, for a candidate,
the step is ≥ 1.5 t₀ˢ (so g(1.5 t₀ˢ) is measured). Its value "at the budget" is then the one at
that step, flagged in the table; a run that never copies trains to the budget.

**Screening stop** (``past_target``, opt-in): a candidate may also stop at its first
evaluation at or past 1.5 t₀ˢ, where the target is read. g(1.5 t₀ˢ), the ablated gain there and
``passes`` are then exactly what the full run gives (evaluations are the same up to that step);
the value "at the budget" and any onset after that step are not measured (the table says
``stopped: target``). It halves the cost of a cell whose candidate does not copy early.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from polysketch.train import TrainConfig, default_warmup

__all__ = [
    "LN26",
    "ONSET_LOSS",
    "SCHEDULES",
    "CELL_KEY",
    "schedule_options",
    "onset",
    "value_at",
    "copied",
    "past_target",
    "cell_summary",
]

LN26 = math.log(26)
"""The loss of a uniformly drawn letter (nats): a first occurrence's floor, a copy's gain."""
ONSET_LOSS = LN26 / 2
"""Second-copy loss below which the copy has started (the onset)."""
SCHEDULES = ("cli", "warmup100", "constant")
CELL_KEY = ("distance", "schedule", "batch_size", "seed", "attention")
ABLATED_BAR = 0.05
"""Largest gain with the global branch switched off for the copy to count as the branch's."""


def schedule_options(name: str, steps: int) -> dict:
    """The ``ProbeSettings`` fields (lr, min_lr, warmup_steps, schedule) of schedule ``name``
    for a budget of ``steps`` (module docstring)."""
    if name in ("cli", "warmup100"):
        default = TrainConfig()
        warmup = default_warmup(steps) if name == "cli" else default.warmup_steps
        return {"lr": default.lr, "min_lr": default.min_lr,
                "warmup_steps": warmup, "schedule": "cosine"}  # fmt: skip
    if name == "constant":
        return {"lr": 1e-3, "min_lr": None, "warmup_steps": 50, "schedule": "constant"}
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")


def _sorted(curve: Sequence[dict]) -> list[dict]:
    return sorted(curve, key=lambda p: int(p["step"]))


def onset(curve: Sequence[dict]) -> int | None:
    """t₀: the first evaluation's step with ``second`` < ln 26 / 2, or None."""
    for point in _sorted(curve):
        if point["second"] != "" and float(point["second"]) < ONSET_LOSS:
            return int(point["step"])
    return None


def value_at(curve: Sequence[dict], step: float, column: str) -> tuple[int, float] | None:
    """(the step of the last evaluation ≤ ``step``, its ``column``), or None if there is no
    such evaluation or the column is empty there."""
    before = [p for p in _sorted(curve) if int(p["step"]) <= step]
    if not before or before[-1][column] == "":
        return None
    return int(before[-1]["step"]), float(before[-1][column])


def copied(gain: float, second: float, step: int, *, fraction: float,
           reference_onset: int | None, is_reference: bool) -> bool:  # fmt: skip
    """Whether a run may stop at this evaluation (module docstring): g ≥ fraction · ln 26,
    the recurrence loss ``second`` ℓ₂ ≤ (1 − fraction) · ln 26 and, unless it is the reference
    (softmax) itself, step ≥ 1.5 t₀ˢ with t₀ˢ known."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if gain < fraction * LN26 or second > (1 - fraction) * LN26:
        return False
    return is_reference or past_target(step, reference_onset=reference_onset)


def past_target(step: int, *, reference_onset: int | None) -> bool:
    """Whether a screening run may stop here (module docstring): step ≥ 1.5 t₀ˢ, t₀ˢ known."""
    return reference_onset is not None and step >= 1.5 * reference_onset


def cell_summary(reference: Sequence[dict], candidate: Sequence[dict]) -> dict:
    """A candidate's numbers against the reference (softmax) of the same cell, from their
    curves (lists of {step, first, second, gain, ablated_gain}):

    ``ref_onset`` t₀ˢ, ``ref_gain`` gˢ (last evaluation), ``at`` = 1.5 t₀ˢ and ``at_step`` the
    evaluation read there, ``gain_at`` g(1.5 t₀ˢ), ``ablated_at``, ``onset`` (the
    candidate's), ``last_step``, ``gain_last``, ``ablated_last``, ``ratio_at`` = g(1.5 t₀ˢ) /
    gˢ and ``passes`` (None when softmax has no onset or a value is missing)."""
    ref = _sorted(reference)
    cand = _sorted(candidate)
    if not ref or not cand:
        raise ValueError("reference and candidate curves must each hold an evaluation")
    out = {"ref_onset": onset(ref), "ref_gain": float(ref[-1]["gain"]), "onset": onset(cand),
           "last_step": int(cand[-1]["step"]), "gain_last": float(cand[-1]["gain"]),
           "ablated_last": _float(cand[-1].get("ablated_gain", ""))}  # fmt: skip
    out.update(at=None, at_step=None, gain_at=None, ablated_at=None, ratio_at=None, passes=None)
    if out["ref_onset"] is None:
        return out
    out["at"] = 1.5 * out["ref_onset"]
    hit = value_at(cand, out["at"], "gain")
    if hit is None:
        return out
    out["at_step"], out["gain_at"] = hit
    abl = value_at(cand, out["at"], "ablated_gain")
    out["ablated_at"] = None if abl is None else abl[1]
    out["ratio_at"] = out["gain_at"] / out["ref_gain"] if out["ref_gain"] > 0 else None
    ablated_ok = out["ablated_at"] is None or out["ablated_at"] <= ABLATED_BAR
    out["passes"] = bool(out["gain_at"] >= 0.5 * out["ref_gain"] and ablated_ok)
    return out


def _float(value):
    return None if value in ("", None) else float(value)
