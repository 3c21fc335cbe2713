"""How a pass of a kernel covers the sequence: one sequential scan, or the split layout.

Every kernel pass carries a state over the blocks of a sequence (PolySketchFormer
Theorem 3.1: P_n = Σ_{m<n} Φ(B_m)ᵀ C_m and z_n in the forward and the dA pass; the suffix
sums of Φ(A)ᵀ dnum and Φ(A)ᵀ drow in the reverse dB/dC pass).

* ``"sequential"``: one program per (batch·head, value tile[, slice group]) scans all T/BT
  blocks in order (grid BH × E/BE × NS), its state starting at zero.
* ``"split"``: T is cut into S = ceil(T/L) segments of L tokens (L a multiple of BT).
  Phase 1: the same kernel with ``STATE_ONLY`` computes each segment's own state (plain
  Σ Bᵀ C (F, E) and Σ Bᵀ1; square the F slices Σ_t B_ta B_t⊗C_t (F, F, E) and Z = Σ BᵀB),
  in parallel over (BH·(S-1), E/BE, NS); the last segment's (first, in reverse) is never
  needed. Phase 2: an exclusive prefix sum over segments (``torch.cumsum``, in place, fixed
  order: deterministic). Phase 3: the sequential pass per (BH·S, E/BE, NS), each program
  over its own segment, starting from its segment's prefix (``INIT``) instead of zero.

The states live in fp32 slots (BH, S, F[, F], E) and (BH, S, F[, F]): slot 0 is zero and
phase 1 writes segment j's state to slot j + 1 (reverse pass: segment j to slot S - j), so
the in-place cumsum leaves in slot j the state of the j segments before (after). Phase 3's
programs update their slot in place (it is their square scratch state, as the (BH, F, F, E)
buffer of the sequential pass), so the autotuner restores ``STATE`` between its timed runs.
Memory: S·BH·(F^q·(E + 1))·4 bytes, q = 2 if square (``_config.segment_length`` keeps it
within ``SEGMENT_BYTES``).

``choose_segment`` ("auto") picks split when the sequential grid BH·(E/BE)·NS leaves SMs idle
and T >= 2·L; ``benchmarks/triton_layouts.py`` times both on CUDA (split measured faster at 8k
and 32k on an H100 with B·H = 12: ``docs/gpu.md``).
"""

from __future__ import annotations

import torch
import triton

from ._config import segment_length

__all__ = ["LAYOUTS", "choose_segment", "run_pass"]

LAYOUTS = ("sequential", "split", "auto")


def choose_segment(
    layout: str, *, bh: int, t: int, f: int, e: int, bt: int, grid: int, square: bool,
    sms: int | None, requested: int | None = None,
) -> int | None:  # fmt: skip
    """The segment length L of the split layout, or None for the sequential pass.

    ``grid``: programs of the sequential pass, BH·(E/BE)·NS. ``"split"`` gives L
    (``_config.segment_length``, or ``requested`` rounded up to a multiple of BT) unless
    T <= L (one segment: the sequential pass); ``"auto"`` splits when ``grid`` is below the
    GPU's ``sms`` multiprocessors and T >= 2·L, and never when ``sms`` is None (no GPU: the
    interpreter) unless forced.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "sequential":
        return None
    seg = segment_length(bh, t, f, e, bt, square=square, requested=requested)
    if t <= seg:
        return None
    if layout == "auto":
        if sms is None or grid >= sms or t < 2 * seg:
            return None
    return seg


def run_pass(
    kernel, args, *, bh: int, t: int, grid: tuple[int, int], segment: int | None, consts: dict,
    phase1=None,
) -> None:  # fmt: skip
    """Launch one pass of ``kernel`` over every sequence: ``kernel[...](*args, STATE, ZST,
    T, L, NSEG, NSLOT, INIT=, STATE_ONLY=, **consts)``; ``grid`` is the (value tile, slice
    group) part of the grid. ``segment`` None: the sequential pass; else the split layout
    with segments of that length, phase 1 by ``phase1`` ((kernel, args), default this
    kernel and args; the dA pass takes the forward kernel's states)."""
    a = args[0]
    kw = {"dtype": torch.float32, "device": a.device}
    square, f, e = consts["SQUARE"], consts["F"], consts["E"]
    fs = (f, f) if square else (f,)
    if segment is None or segment >= t:
        state = torch.empty(bh, *fs, e, **kw) if square else torch.empty(1, **kw)
        flags = dict(INIT=False, STATE_ONLY=False)
        kernel[(bh, *grid)](*args, state, state, t, t, 1, 1, **flags, **consts)
        return
    nseg = triton.cdiv(t, segment)
    state = torch.empty(bh, nseg, *fs, e, **kw)
    zst = torch.empty(bh, nseg, *fs, **kw)
    state[:, 0].zero_()
    zst[:, 0].zero_()
    kernel1, args1 = phase1 or (kernel, args)
    flags = dict(INIT=False, STATE_ONLY=True)
    kernel1[(bh * (nseg - 1), *grid)](
        *args1, state, zst, t, segment, nseg - 1, nseg, **flags, **consts
    )
    state.cumsum_(1)
    zst.cumsum_(1)
    flags = dict(INIT=True, STATE_ONLY=False)
    kernel[(bh * nseg, *grid)](*args, state, zst, t, segment, nseg, nseg, **flags, **consts)
