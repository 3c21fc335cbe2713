"""Forward kernel: causal lt((A Bᵀ)^{∘q}) C and lt((A Bᵀ)^{∘q}) 1 in one pass.

PolySketchFormer Theorem 3.1 with blocks of BT rows: for block n,

    num_n = lt((A_n B_nᵀ)^{∘q}) C_n + Φ(A_n) P_n,      P_n = Σ_{m<n} Φ(B_m)ᵀ C_m,
    rs_n  = lt((A_n B_nᵀ)^{∘q}) 1   + Φ(A_n) z_n,      z_n = Σ_{m<n} Φ(B_m)ᵀ 1,

Φ(x) = x (q = 1) or x⊗x (q = 2, (x·y)² = (x⊗x)·(y⊗y)). One program per (batch·head, tile of
BE value columns) scans the blocks in order, carrying the state (the sequential pass: per-block
square states are F²·E floats per block, 1 MiB at F = E = 64, and storing them would cost more
memory traffic than the whole computation). The split layout (``_layout``) stores states only
per segment of L >= 1024 tokens: the same kernel computes them (``STATE_ONLY``: phase 1),
and after a prefix sum over segments runs the pass over one segment from its prefix
(``INIT``: phase 3); ``program_segment`` (``_tiles``) maps programs to segments and slots.

Plain: P (F, BE) and z (F,) stay in registers. Square: Φ is never formed; the state splits
into F slices P_a = Σ_t B_ta B_t⊗C_t (F, BE) (a = first index of x⊗x), read as
Σ_a A_a ∘ (A P_a) and updated as P_a += (B ∘ B_a)ᵀ C, each slice a tensor-core GEMM with
inner dimension F or BT. The slices live in an fp32 scratch buffer (BH, F, F, E) whose
columns only this program touches (L2-resident: F·F·BE·4 bytes; zeroed by the program, a
``tl.debug_barrier`` after each block's stores); z is Z = Σ BᵀB (F, F) in registers and read
as the quadratic form rows A Z Aᵀ. With few batch·heads the slices are split into NS groups
over a third grid axis (``_config.slice_groups``): group g scans slices g·F/NS .. and writes
its own fp32 partial numerator; group 0 also does the block-local part and the row sums.

Precision: scores, states and sums accumulate in fp32; ``tl.dot`` takes operands in the
input dtype (fp32 with ``input_precision="ieee"``, so no TF32 rounding on fp32 inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._config import block_e, mma, tuned
from ._layout import run_pass
from ._tiles import (
    column,
    initial_state,
    program_segment,
    row_tile,
    slice_ptrs,
    store_row_tile,
    store_state,
)

__all__ = ["forward"]


@tuned()
@triton.jit
def _forward_kernel(
    A, B, C, NUM, RS, STATE, ZST, T, L, NSEG, NSLOT,
    F: tl.constexpr, E: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
    SQUARE: tl.constexpr, NS: tl.constexpr, PRECISION: tl.constexpr,
    INIT: tl.constexpr, STATE_ONLY: tl.constexpr,
):  # fmt: skip
    bh, start, end, st_base, z_ptr = program_segment(
        STATE, ZST, T, L, NSEG, NSLOT, F, E, SQUARE, STATE_ONLY, False
    )
    pe = tl.program_id(1)
    grp = tl.program_id(2)  # square: slices grp·F/NS .. (grp+1)·F/NS - 1
    nbh = (tl.num_programs(0) // NSEG).to(tl.int64)
    offs_t = tl.arange(0, BT)
    offs_f = tl.arange(0, F)
    offs_e = pe * BE + tl.arange(0, BE)
    a_base = A + bh * T * F
    b_base = B + bh * T * F
    c_base = C + bh * T * E
    num_base = NUM + (grp * nbh + bh) * T * E  # this group's partial numerator
    causal = offs_t[:, None] >= offs_t[None, :]
    first = grp * F // NS
    own = (offs_f * 0 + pe + grp) == 0  # tile 0 of group 0 carries the row sums
    z, s = initial_state(st_base, z_ptr, first, offs_f, offs_e, own, F, E, BE, SQUARE, NS, INIT)
    for n in range(0, tl.cdiv(end - start, BT)):
        rows = start + n * BT + offs_t
        valid = rows < end
        b = row_tile(b_base, rows, valid, offs_f, F)
        c = row_tile(c_base, rows, valid, offs_e, E)
        dt = b.dtype
        acc = tl.zeros([BT, BE], dtype=tl.float32)
        rs = tl.zeros([BT], dtype=tl.float32)
        if not STATE_ONLY:
            a = row_tile(a_base, rows, valid, offs_f, F)
            if grp == 0:  # within the block: exact masked scores (padded rows are zero rows)
                g = mma(a, tl.trans(b), PRECISION)
                if SQUARE:
                    g = g * g
                m = tl.where(causal, g, 0.0)
                acc = mma(m.to(dt), c, PRECISION)
                rs = tl.sum(m, axis=1)
        # across blocks: read the state of the earlier blocks, then add this block's
        if SQUARE:
            for i in range(first, first + F // NS):
                p_ptr = slice_ptrs(st_base, i, offs_f, offs_e, F, E)
                p = tl.load(p_ptr)
                if not STATE_ONLY:
                    a_i = column(a_base, rows, valid, i, F)
                    y = mma(a, p.to(dt), PRECISION)
                    acc += a_i[:, None] * y
                b_i = column(b_base, rows, valid, i, F)
                bw = (b.to(tl.float32) * b_i[:, None]).to(dt)
                p += mma(tl.trans(bw), c, PRECISION)
                tl.store(p_ptr, p)
            tl.debug_barrier()  # slice stores visible to every thread before the next block
            if grp == 0:
                if not STATE_ONLY:
                    az = mma(a, z.to(dt), PRECISION)
                    rs += tl.sum(az * a.to(tl.float32), axis=1)
                z += mma(tl.trans(b), b, PRECISION)
        else:
            if not STATE_ONLY:
                acc += mma(a, s.to(dt), PRECISION)
                rs += tl.sum(a.to(tl.float32) * z[None, :], axis=1)
            s += mma(tl.trans(b), c, PRECISION)
            z += tl.sum(b.to(tl.float32), axis=0)
        if not STATE_ONLY:
            store_row_tile(num_base, rows, valid, offs_e, acc, E)
            tl.store(RS + bh * T + rows, rs, mask=valid & (rows * 0 + pe + grp == 0))  # one writer
    if STATE_ONLY:
        store_state(z, s, st_base, z_ptr, offs_f, offs_e, own, F, E, SQUARE)


def precision(dtype: torch.dtype) -> str:
    """``input_precision`` of ``tl.dot``: exact fp32 products for fp32 inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def forward(
    a, b, c, *, square: bool, bt: int, ns: int, segment: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """num (BH, T, E) fp32 and row sums (BH, T) fp32 for contiguous A, B (BH, T, F),
    C (BH, T, E) of one dtype; ``bt`` is the block length BT (a power of two >= 16), ``ns``
    the number of slice groups (square; 1 when plain), whose partial numerators are summed;
    ``segment``: None for the sequential pass, else the segment length L of the split
    layout (``_layout``)."""
    bh, t, f = a.shape
    e = c.shape[-1]
    be = block_e(f, e, square=square, element_size=a.element_size())
    num = torch.empty(ns, bh, t, e, dtype=torch.float32, device=a.device)
    rs = torch.empty(bh, t, dtype=torch.float32, device=a.device)
    consts = dict(F=f, E=e, BT=bt, BE=be, SQUARE=square, NS=ns, PRECISION=precision(a.dtype))
    run_pass(
        _forward_kernel, (a, b, c, num, rs), bh=bh, t=t, grid=(triton.cdiv(e, be), ns),
        segment=segment, consts=consts,
    )  # fmt: skip
    return (num[0] if ns == 1 else num.sum(0)), rs
