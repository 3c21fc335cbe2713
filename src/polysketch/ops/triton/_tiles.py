"""Tile loads, stores and state set-up shared by the forward and backward kernels.

The kernels see A, B (BH, T, F), C, dnum (BH, T, E) row-major: a block is BT consecutive
rows (``rows``, with ``valid`` False past T: those read as zeros, so padded rows add nothing
to the scores or states, and are never stored). The square state's F slices (F, BE) live in
an fp32 buffer (.., F, F, E) of which each program owns the columns ``offs_e`` of its slices.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["row_tile", "store_row_tile", "column", "slice_ptrs", "initial_state"]


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
def initial_state(
    st_base, first, offs_f, offs_e,
    F: tl.constexpr, E: tl.constexpr, BE: tl.constexpr, SQUARE: tl.constexpr, NS: tl.constexpr,
):  # fmt: skip
    """The carried state at the start of a pass, (z, s), all zero.

    Plain: z (F,) and s (F, BE) in registers. Square: z (F, F) in registers, s an unused
    (1, 1) placeholder, and this program's slices ``first`` .. ``first + F/NS - 1`` of the
    scratch state at ``st_base`` zeroed (visible to every thread when this returns).
    """
    if SQUARE:
        z = tl.zeros([F, F], dtype=tl.float32)
        s = tl.zeros([1, 1], dtype=tl.float32)
        s_zero = tl.zeros([F, BE], dtype=tl.float32)
        for i in range(first, first + F // NS):
            tl.store(slice_ptrs(st_base, i, offs_f, offs_e, F, E), s_zero)
        tl.debug_barrier()
    else:
        z = tl.zeros([F], dtype=tl.float32)
        s = tl.zeros([F, BE], dtype=tl.float32)
    return z, s
