"""Tile loads, stores and state set-up shared by the forward and backward kernels.

The kernels see A, B (BH, T, F), C, dnum (BH, T, E) row-major: a block is BT consecutive
rows (``rows``, with ``valid`` False past T: those read as zeros, so padded rows add nothing
to the scores or states, and are never stored). The square state's F slices (F, BE) live in
an fp32 buffer (.., F, F, E) of which each program owns the columns ``offs_e`` of its slices.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "row_tile",
    "store_row_tile",
    "column",
    "slice_ptrs",
    "program_segment",
    "initial_state",
    "store_state",
]


@triton.jit
def row_tile(base, rows, valid, cols, WIDTH: tl.constexpr):
    """(BT, len(cols)) tile of the rows ``rows`` of a row-major (T, WIDTH) matrix."""
    return tl.load(base + rows[:, None] * WIDTH + cols[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def store_row_tile(base, rows, valid, cols, x, WIDTH: tl.constexpr):
    """Store ``x`` (BT, len(cols)) to those rows and columns (valid rows only)."""
    tl.store(base + rows[:, None] * WIDTH + cols[None, :], x, mask=valid[:, None])


@triton.jit
def column(base, rows, valid, i, WIDTH: tl.constexpr):
    """Column ``i`` of those rows of a (T, WIDTH) matrix, as fp32 (BT,)."""
    return tl.load(base + rows * WIDTH + i, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def slice_ptrs(st_base, i, offs_f, offs_e, F: tl.constexpr, E: tl.constexpr):
    """Pointers (F, BE) to this program's columns of slice ``i`` of a (F, F, E) state."""
    return st_base + i * F * E + offs_f[:, None] * E + offs_e[None, :]


@triton.jit
def program_segment(
    STATE, ZST, T, L, NSEG, NSLOT,
    F: tl.constexpr, E: tl.constexpr, SQUARE: tl.constexpr, SHIFT: tl.constexpr,
    REVERSE: tl.constexpr,
):  # fmt: skip
    """(bh, start, end, st_base, z_ptr) of this program's sequence and token range.

    Grid axis 0 is bh·NSEG + p (NSEG programs per sequence, NSLOT state slots per sequence,
    segments of L tokens). In block order (``REVERSE`` False) program p runs segment p and
    owns slot p + SHIFT; in reverse order segment p + SHIFT and slot NSLOT - 1 - p. The
    sequential pass is NSEG = NSLOT = 1, L >= T, SHIFT = 0: slot bh, tokens [0, T).
    ``st_base``: the slot's square slices (F, F, E) or plain state (F, E); ``z_ptr``: its z,
    (F, F) or (F,), in ZST.
    """
    pid = tl.program_id(0)
    bh = (pid // NSEG).to(tl.int64)
    p = pid % NSEG
    if REVERSE:
        seg = p + SHIFT
        slot = bh * NSLOT + NSLOT - 1 - p
    else:
        seg = p
        slot = bh * NSLOT + p + SHIFT
    start = seg * L
    end = tl.minimum(start + L, T)
    if SQUARE:
        st_base = STATE + slot * F * F * E
        z_ptr = ZST + slot * F * F
    else:
        st_base = STATE + slot * F * E
        z_ptr = ZST + slot * F
    return bh, start, end, st_base, z_ptr


@triton.jit
def initial_state(
    st_base, z_ptr, first, offs_f, offs_e, own,
    F: tl.constexpr, E: tl.constexpr, BE: tl.constexpr, SQUARE: tl.constexpr, NS: tl.constexpr,
    INIT: tl.constexpr,
):  # fmt: skip
    """The carried state at the start of a pass, (z, s): zero, or with ``INIT`` the state
    stored in the program's slot (a prefix over the earlier segments).

    Plain: z (F,) and s (F, BE) in registers. Square: z (F, F) in registers, s an unused
    (1, 1) placeholder, and this program's slices ``first`` .. ``first + F/NS - 1`` in the
    slot at ``st_base`` (zeroed unless ``INIT``; visible to every thread when this returns).
    z is read where ``own`` (F,) is true (tile 0 of group 0: the program that carries the row
    sum terms), zero elsewhere.
    """
    if SQUARE:
        s = tl.zeros([1, 1], dtype=tl.float32)
        if INIT:
            zp = z_ptr + offs_f[:, None] * F + offs_f[None, :]
            z = tl.load(zp, mask=own[:, None], other=0.0)
        else:
            z = tl.zeros([F, F], dtype=tl.float32)
            s_zero = tl.zeros([F, BE], dtype=tl.float32)
            for i in range(first, first + F // NS):
                tl.store(slice_ptrs(st_base, i, offs_f, offs_e, F, E), s_zero)
            tl.debug_barrier()
    else:
        if INIT:
            z = tl.load(z_ptr + offs_f, mask=own, other=0.0)
            s = tl.load(st_base + offs_f[:, None] * E + offs_e[None, :])
        else:
            z = tl.zeros([F], dtype=tl.float32)
            s = tl.zeros([F, BE], dtype=tl.float32)
    return z, s


@triton.jit
def store_state(
    z, s, st_base, z_ptr, offs_f, offs_e, own,
    F: tl.constexpr, E: tl.constexpr, SQUARE: tl.constexpr,
):  # fmt: skip
    """Store the state at the end of a segment into the slot (phase 1 of the split layout):
    plain s (F, BE) to the program's columns, z where ``own`` is true (tile 0 of group 0);
    the square slices are already in the slot."""
    if SQUARE:
        tl.store(z_ptr + offs_f[:, None] * F + offs_f[None, :], z, mask=own[:, None])
    else:
        tl.store(st_base + offs_f[:, None] * E + offs_e[None, :], s)
        tl.store(z_ptr + offs_f, z, mask=own)
