"""The held-out reading of a copy-probe grid (issue 70 item 2): gains as means of evaluations.

A held-out cell is a grid cell (``grid``) run to its budget S with no early stop, on a seed no
candidate was screened on, under the schedule ``polysketch train --steps S`` gives (``cli``).
A single evaluation is noisy (one cell read 3.058 at step 325 and 1.050 at 350), so every value
is the **mean of the evaluation at the read step and the two before it** (evaluations every n
steps; a read step between two evaluations is read at the earlier one, as ``grid.value_at``):

    ḡ(t) = mean{ g(tₖ) : tₖ the last three evaluations ≤ t },   and ḡ_abl(t) alike.

Per cell, with softmax's onset t₀ˢ (``grid.onset``) and its own mean gain at the budget ḡˢ(S):

    early   ḡ(1.5 t₀ˢ) / ḡˢ(S)           (target ≥ 0.5)
    budget  ḡ(S) / ḡˢ(S)                  (target ≥ 0.8)
    ablated max(ḡ_abl(1.5 t₀ˢ), ḡ_abl(S)) (target ≤ 0.05: the copy is the far branch's)

A cell **meets the target** when all three hold. A cell where softmax has no onset by S says
nothing of the candidate: it is reported as such (``softmax_copies`` False) and not counted.
"""

from __future__ import annotations

from collections.abc import Sequence

from .grid import ABLATED_BAR, onset

__all__ = ["READ_EVALUATIONS", "mean_at", "heldout_summary", "EARLY_BAR", "BUDGET_BAR"]

READ_EVALUATIONS = 3
"""Evaluations averaged per read: the one at the read step and the two before it."""
EARLY_BAR = 0.5
"""Least ḡ(1.5 t₀ˢ) / ḡˢ(S) for the target."""
BUDGET_BAR = 0.8
"""Least ḡ(S) / ḡˢ(S) for the target."""


def mean_at(curve: Sequence[dict], step: float, column: str, n: int = READ_EVALUATIONS):
    """(the read evaluation's step, the mean of ``column`` over the last ``n`` evaluations at
    or before ``step``), or None when fewer than ``n`` such evaluations hold the column."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    before = sorted((p for p in curve if int(p["step"]) <= step), key=lambda p: int(p["step"]))
    last = before[-n:]
    if len(last) < n or any(p[column] in ("", None) for p in last):
        return None
    return int(last[-1]["step"]), sum(float(p[column]) for p in last) / n


def heldout_summary(reference: Sequence[dict], candidate: Sequence[dict], budget: int) -> dict:
    """One held-out cell from softmax's curve and the candidate's (lists of {step, gain,
    ablated_gain, ...}): ``ref_onset``, ``softmax_copies``, ``ref_gain`` ḡˢ(S), ``at`` = 1.5 t₀ˢ,
    ``at_step``, ``gain_at`` ḡ(1.5 t₀ˢ), ``ablated_at``, ``gain_end`` ḡ(S), ``ablated_end``,
    ``early`` and ``end`` (the two ratios), ``own_onset`` and ``meets`` (None when softmax does
    not copy or a value is missing). Both runs must reach the budget (no early stop)."""
    for name, curve in (("reference", reference), ("candidate", candidate)):
        if not curve or max(int(p["step"]) for p in curve) < budget:
            raise ValueError(f"the {name} curve does not reach the budget {budget}: a held-out "
                             "cell trains to it (no early stop)")  # fmt: skip
    out = {"ref_onset": onset(reference), "own_onset": onset(candidate), "at": None,
           "at_step": None, "gain_at": None, "ablated_at": None, "early": None,
           "meets": None}  # fmt: skip
    ref_end = mean_at(reference, budget, "gain")
    end = mean_at(candidate, budget, "gain")
    abl_end = mean_at(candidate, budget, "ablated_gain")
    out["ref_gain"] = None if ref_end is None else ref_end[1]
    out["gain_end"] = None if end is None else end[1]
    out["ablated_end"] = None if abl_end is None else abl_end[1]
    out["softmax_copies"] = out["ref_onset"] is not None
    ok_ref = out["ref_gain"] is not None and out["ref_gain"] > 0
    out["end"] = out["gain_end"] / out["ref_gain"] if ok_ref and end else None
    if not out["softmax_copies"]:
        return out
    out["at"] = 1.5 * out["ref_onset"]
    hit = mean_at(candidate, out["at"], "gain")
    abl = mean_at(candidate, out["at"], "ablated_gain")
    if hit is None or abl is None or abl_end is None or not ok_ref:
        return out
    out["at_step"], out["gain_at"] = hit
    out["ablated_at"] = abl[1]
    out["early"] = out["gain_at"] / out["ref_gain"]
    out["meets"] = bool(out["early"] >= EARLY_BAR and out["end"] >= BUDGET_BAR
                        and max(out["ablated_at"], out["ablated_end"]) <= ABLATED_BAR)  # fmt: skip
    return out
