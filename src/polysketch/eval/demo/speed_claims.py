"""What the demo's speed section may claim: timings over several passes, their spread, and
the comparison with SDPA that the table supports.

The benchmark (``polysketch.eval.bench``) is run ``n`` times (passes, minutes apart on a
shared machine). For every point (section, method, T) ``aggregate`` keeps the row of the
median pass (``statistics.median_low`` of the per-pass medians) and adds

    low_ms = min over passes of the median,   high_ms = max over passes of the median,

so [low, high] is the spread a reader would see by running the demo again under the same
load. ``verdicts`` compares a method with SDPA at each T from these ranges:

    faster  if high(method) < low(sdpa),   slower  if low(method) > high(sdpa),
    tie     otherwise (the ranges overlap: no difference is claimed),

and ``claim`` turns them into the one sentence the report prints: "faster from T = x on"
only when every measured T ≥ x is ``faster``; otherwise the lengths of each verdict.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["aggregate", "verdicts", "claim", "VERDICTS"]

VERDICTS = ("faster", "slower", "tie")


def aggregate(passes: Sequence[Sequence[dict]]) -> list[dict]:
    """One row per (section, method, T) from the rows of every pass (module docstring).

    A point that is not ``ok`` in every pass keeps the status of its first non-ok pass and no
    time. Rows keep the order of the first pass.
    """
    if not passes:
        raise ValueError("passes must hold at least one pass of benchmark rows")
    groups: dict[tuple, list[dict]] = {}
    for rows in passes:
        for r in rows:
            groups.setdefault((r["section"], r["method"], r["T"]), []).append(r)
    out = []
    for group in groups.values():
        bad = [r for r in group if r["status"] != "ok"]
        if bad or len(group) < len(passes):
            row = dict(bad[0] if bad else group[0])
            row.update(status=bad[0]["status"] if bad else "missing in a pass", median_ms="",
                       min_ms="", low_ms="", high_ms="", passes=len(group))  # fmt: skip
            out.append(row)
            continue
        medians = [r["median_ms"] for r in group]
        middle = statistics.median_low(medians)
        row = dict(group[medians.index(middle)])
        row.update(
            low_ms=min(medians),
            high_ms=max(medians),
            min_ms=min(r["min_ms"] for r in group),
            repeats=sum(r["repeats"] for r in group),
            passes=len(group),
        )
        out.append(row)
    return out


def _ranges(rows, section: str, method: str) -> dict[int, tuple[float, float, float]]:
    return {
        r["T"]: (r["low_ms"], r["median_ms"], r["high_ms"])
        for r in rows
        if r["section"] == section and r["method"] == method and r["status"] == "ok"
    }


def verdicts(rows, method: str, *, section: str = "forward", ref: str = "sdpa") -> dict:
    """{T: (verdict, median ratio method / ref)} at every T both were measured."""
    mine, theirs = _ranges(rows, section, method), _ranges(rows, section, ref)
    out = {}
    for t in sorted(set(mine) & set(theirs)):
        (lo, mid, hi), (rlo, rmid, rhi) = mine[t], theirs[t]
        verdict = "faster" if hi < rlo else "slower" if lo > rhi else "tie"
        out[t] = (verdict, mid / rmid)
    return out


def _lengths(ts: list[int]) -> str:
    return ", ".join(str(t) for t in ts)


def claim(name: str, found: dict, *, ref: str = "SDPA") -> str:
    """The sentence the report may print about ``name`` from ``verdicts``' result."""
    if not found:
        return f"`{name}`: not compared with {ref} (no length measured for both)"
    ts = sorted(found)
    by = {v: [t for t in ts if found[t][0] == v] for v in VERDICTS}
    if by["faster"] and all(found[t][0] == "faster" for t in ts if t >= by["faster"][0]):
        first = by["faster"][0]
        where = (
            f"at every measured T from {first} to {ts[-1]}"
            if first < ts[-1]
            else (f"at the longest measured T = {first} only")
        )
        return f"`{name}`: faster than {ref} {where} (the ranges of the passes do not overlap)"
    parts = []
    if by["faster"]:
        parts.append(f"faster than {ref} at T = {_lengths(by['faster'])}")
    else:
        parts.append(f"not faster than {ref} at any measured T up to {ts[-1]}")
    if by["slower"]:
        slow = by["slower"][-1]
        parts.append(
            f"slower at T = {_lengths(by['slower'])} ({found[slow][1]:.2f}× {ref}'s time at "
            f"T = {slow})"
        )
    if by["tie"]:
        parts.append(f"within the spread of {ref} at T = {_lengths(by['tie'])}")
    return f"`{name}`: " + "; ".join(parts)
