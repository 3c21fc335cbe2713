"""Backward kernels of lt((A Bᵀ)^{∘q}) C and its row sums, by recomputation.

Given dnum (T, E) and drow (T,), with G = A Bᵀ, s = G^{∘q} and the causal mask lt:

    dM = lt(dnum Cᵀ + drow 1ᵀ),   dG = dM (q = 1) or 2 G ∘ dM (q = 2),
    dA = dG B,   dB = dGᵀ A,   dC = lt(s)ᵀ dnum,

split by PolySketchFormer Theorem 3.1 into the local block terms (above, per block) and the
terms across blocks, with P_n = Σ_{m<n} Φ(B_m)ᵀ C_m, z_n = Σ_{m<n} Φ(B_m)ᵀ 1 (as forward) and
the reverse exclusive prefixes dS_m = Σ_{n>m} Φ(A_n)ᵀ dnum_n, du_m = Σ_{n>m} Φ(A_n)ᵀ drow_n:

    dΦ(A_n) = dnum_n P_nᵀ + drow_n z_nᵀ,   dΦ(B_m) = C_m dS_mᵀ + 1 du_mᵀ,   dC_m += Φ(B_m) dS_m.

Through Φ(x) = x⊗x (states symmetric in their two feature indices):
    dA_ic += 2 A_i·(P_c dnum_i) + 2 drow_i (A_i Z)_c,     Z = Σ B_tᵀ B_t,
    dB_jc += 2 B_j·(dS_c C_j) + 2 (B_j dU)_c,            dU = Σ drow_i A_iᵀ A_i,
    dC_j  += Σ_a B_ja (B_j dS_a).

Two sequential passes per (batch·head, value tile): ``_bwd_a_kernel`` in block order
(carrying P, z: gives dA), ``_bwd_bc_kernel`` in reverse block order (carrying dS, du: gives
dB and dC). In the split layout (``_layout``) each pass runs per segment from a stored
start state: the dA pass from the forward's prefix states (recomputed by the forward kernel's
phase 1), the dB/dC pass from the suffix sums over the later segments of Σ Φ(A)ᵀ dnum and
Σ Φ(A)ᵀ drow (its own phase 1, ``STATE_ONLY``, in reverse slot order). dA and dB sum over the
value columns, so each value tile writes its own fp32 partial (E/BE of them, at most 4; summed
afterwards in a fixed order: deterministic); the drow terms enter tile 0 only. Square states are
F slices (F, BE) in an fp32 scratch buffer of this program, as in the forward; nothing of size
T×F² is stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._config import block_e, mma, tuned
from ._forward import _forward_kernel, precision
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

__all__ = ["backward"]


@triton.jit
def _local_terms(a, b, c, dn, drow, causal, SQUARE: tl.constexpr, PRECISION: tl.constexpr):
    """Block-local scores s = lt(G^{∘q}) and dG for one block (fp32, (BT, BT))."""
    dt = a.dtype
    g = mma(a, tl.trans(b), PRECISION)
    dm = mma(dn.to(dt), tl.trans(c), PRECISION) + drow[:, None]
    dm = tl.where(causal, dm, 0.0)
    if SQUARE:
        s = tl.where(causal, g * g, 0.0)
        dg = 2.0 * g * dm
    else:
        s = tl.where(causal, g, 0.0)
        dg = dm
    return s, dg


@tuned()
@triton.jit
def _bwd_a_kernel(
    A, B, C, DNUM, DROW, DA, STATE, ZST, T, L, NSEG, NSLOT,
    F: tl.constexpr, E: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
    SQUARE: tl.constexpr, NS: tl.constexpr, PRECISION: tl.constexpr,
    INIT: tl.constexpr, STATE_ONLY: tl.constexpr,
):  # fmt: skip
    tl.static_assert(not STATE_ONLY, "phase 1 of the dA pass is the forward kernel's")
    bh, start, end, st_base, z_ptr = program_segment(
        STATE, ZST, T, L, NSEG, NSLOT, F, E, SQUARE, 0, False
    )
    pe = tl.program_id(1)
    grp = tl.program_id(2)  # square: slices grp·F/NS .. (grp+1)·F/NS - 1
    nbh = (tl.num_programs(0) // NSEG).to(tl.int64)
    part = grp * tl.num_programs(1) + pe  # index of this program's dA / dB partial
    first = grp * F // NS
    offs_t = tl.arange(0, BT)
    offs_f = tl.arange(0, F)
    offs_e = pe * BE + tl.arange(0, BE)
    a_base = A + bh * T * F
    b_base = B + bh * T * F
    c_base = C + bh * T * E
    dn_base = DNUM + bh * T * E
    da_base = DA + (part * nbh + bh) * T * F
    causal = offs_t[:, None] >= offs_t[None, :]
    own = (offs_f * 0 + pe + grp) == 0  # tile 0 of group 0 carries the row-sum terms
    z, s = initial_state(st_base, z_ptr, first, offs_f, offs_e, own, F, E, BE, SQUARE, NS, INIT)
    for n in range(0, tl.cdiv(end - start, BT)):
        rows = start + n * BT + offs_t
        valid = rows < end
        a = row_tile(a_base, rows, valid, offs_f, F)
        b = row_tile(b_base, rows, valid, offs_f, F)
        c = row_tile(c_base, rows, valid, offs_e, E)
        dn = row_tile(dn_base, rows, valid, offs_e, E)
        drow = tl.load(DROW + bh * T + rows, mask=valid & (rows * 0 + pe + grp == 0), other=0.0)
        dt = a.dtype
        da = tl.zeros([BT, F], dtype=tl.float32)
        if grp == 0:
            _, dg = _local_terms(a, b, c, dn, drow, causal, SQUARE, PRECISION)
            da = mma(dg.to(dt), b, PRECISION)
        if SQUARE:
            af = a.to(tl.float32)
            for i in range(first, first + F // NS):
                p_ptr = slice_ptrs(st_base, i, offs_f, offs_e, F, E)
                p = tl.load(p_ptr)
                b_i = column(b_base, rows, valid, i, F)
                col = 2.0 * tl.sum(af * mma(dn.to(dt), tl.trans(p.to(dt)), PRECISION), axis=1)
                da += tl.where(offs_f[None, :] == i, col[:, None], 0.0)
                bw = (b.to(tl.float32) * b_i[:, None]).to(dt)
                p += mma(tl.trans(bw), c, PRECISION)
                tl.store(p_ptr, p)
            tl.debug_barrier()  # slice stores visible to every thread before the next block
            if grp == 0:
                da += 2.0 * drow[:, None] * mma(a, z.to(dt), PRECISION)
                z += mma(tl.trans(b), b, PRECISION)
        else:
            da += mma(dn.to(dt), tl.trans(s.to(dt)), PRECISION) + drow[:, None] * z[None, :]
            s += mma(tl.trans(b), c, PRECISION)
            z += tl.sum(b.to(tl.float32), axis=0)
        store_row_tile(da_base, rows, valid, offs_f, da, F)


@tuned()
@triton.jit
def _bwd_bc_kernel(
    A, B, C, DNUM, DROW, DB, DC, STATE, ZST, T, L, NSEG, NSLOT,
    F: tl.constexpr, E: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
    SQUARE: tl.constexpr, NS: tl.constexpr, PRECISION: tl.constexpr,
    INIT: tl.constexpr, STATE_ONLY: tl.constexpr,
):  # fmt: skip
    bh, start, end, st_base, z_ptr = program_segment(
        STATE, ZST, T, L, NSEG, NSLOT, F, E, SQUARE, STATE_ONLY, True
    )
    pe = tl.program_id(1)
    grp = tl.program_id(2)  # square: slices grp·F/NS .. (grp+1)·F/NS - 1
    nbh = (tl.num_programs(0) // NSEG).to(tl.int64)
    part = grp * tl.num_programs(1) + pe  # index of this program's dA / dB partial
    first = grp * F // NS
    offs_t = tl.arange(0, BT)
    offs_f = tl.arange(0, F)
    offs_e = pe * BE + tl.arange(0, BE)
    a_base = A + bh * T * F
    b_base = B + bh * T * F
    c_base = C + bh * T * E
    dn_base = DNUM + bh * T * E
    db_base = DB + (part * nbh + bh) * T * F
    dc_base = DC + (grp * nbh + bh) * T * E
    causal = offs_t[:, None] >= offs_t[None, :]
    own = (offs_f * 0 + pe + grp) == 0  # tile 0 of group 0 carries the row-sum terms
    du, ds = initial_state(st_base, z_ptr, first, offs_f, offs_e, own, F, E, BE, SQUARE, NS, INIT)
    nblocks = tl.cdiv(end - start, BT)
    for k in range(0, nblocks):
        rows = start + (nblocks - 1 - k) * BT + offs_t
        valid = rows < end
        a = row_tile(a_base, rows, valid, offs_f, F)
        dn = row_tile(dn_base, rows, valid, offs_e, E)
        drow = tl.load(DROW + bh * T + rows, mask=valid & (rows * 0 + pe + grp == 0), other=0.0)
        dt = a.dtype
        dnh = dn.to(dt)
        if not STATE_ONLY:
            b = row_tile(b_base, rows, valid, offs_f, F)
            c = row_tile(c_base, rows, valid, offs_e, E)
            dc = tl.zeros([BT, BE], dtype=tl.float32)
            db = tl.zeros([BT, F], dtype=tl.float32)
            if grp == 0:
                s, dg = _local_terms(a, b, c, dn, drow, causal, SQUARE, PRECISION)
                dc = mma(tl.trans(s.to(dt)), dnh, PRECISION)
                db = mma(tl.trans(dg.to(dt)), a, PRECISION)
        if SQUARE:
            if not STATE_ONLY:
                bf = b.to(tl.float32)
            for i in range(first, first + F // NS):
                q_ptr = slice_ptrs(st_base, i, offs_f, offs_e, F, E)
                q = tl.load(q_ptr)
                a_i = column(a_base, rows, valid, i, F)
                if not STATE_ONLY:
                    qh = q.to(dt)
                    b_i = column(b_base, rows, valid, i, F)
                    dc += b_i[:, None] * mma(b, qh, PRECISION)
                    col = 2.0 * tl.sum(bf * mma(c, tl.trans(qh), PRECISION), axis=1)
                    db += tl.where(offs_f[None, :] == i, col[:, None], 0.0)
                aw = (a.to(tl.float32) * a_i[:, None]).to(dt)
                q += mma(tl.trans(aw), dnh, PRECISION)
                tl.store(q_ptr, q)
            tl.debug_barrier()  # slice stores visible to every thread before the next block
            if grp == 0:
                if not STATE_ONLY:
                    db += 2.0 * mma(b, du.to(dt), PRECISION)
                ad = (a.to(tl.float32) * drow[:, None]).to(dt)
                du += mma(tl.trans(ad), a, PRECISION)
        else:
            if not STATE_ONLY:
                dsh = ds.to(dt)
                dc += mma(b, dsh, PRECISION)
                db += mma(c, tl.trans(dsh), PRECISION) + du[None, :]
            ds += mma(tl.trans(a), dnh, PRECISION)
            du += tl.sum(a.to(tl.float32) * drow[:, None], axis=0)
        if not STATE_ONLY:
            store_row_tile(db_base, rows, valid, offs_f, db, F)
            store_row_tile(dc_base, rows, valid, offs_e, dc, E)
    if STATE_ONLY:
        store_state(du, ds, st_base, z_ptr, offs_f, offs_e, own, F, E, SQUARE)


def backward(a, b, c, dnum, drow, *, square: bool, bt: int, ns: int, segment: int | None = None):
    """dA, dB (BH, T, F) and dC (BH, T, E), fp32, for contiguous A, B, C (as ``forward``),
    dnum (BH, T, E) and drow (BH, T) (cast to fp32); ``ns`` slice groups and ``segment``
    (None: sequential, else the split layout's L) as in ``forward``. In the split layout the
    dA pass recomputes the forward's prefix states (phase 1 by the forward kernel) and the
    dB/dC pass the suffix sums of Φ(A)ᵀ dnum and Φ(A)ᵀ drow (its own phase 1)."""
    bh, t, f = a.shape
    e = c.shape[-1]
    be = block_e(f, e, square=square, element_size=a.element_size())
    ne = triton.cdiv(e, be)
    dnum = dnum.to(torch.float32).contiguous()
    drow = drow.to(torch.float32).contiguous()
    kw = {"dtype": torch.float32, "device": a.device}
    consts = dict(F=f, E=e, BT=bt, BE=be, SQUARE=square, NS=ns, PRECISION=precision(a.dtype))
    layout = dict(bh=bh, t=t, grid=(ne, ns), segment=segment, consts=consts)
    da = torch.empty(ns * ne, bh, t, f, **kw)
    fwd = (_forward_kernel, (a, b, c, da, da))  # state only: its outputs are not written
    run_pass(_bwd_a_kernel, (a, b, c, dnum, drow, da), phase1=fwd, **layout)
    da = _reduce(da)  # partials freed before the second pass allocates its own
    db = torch.empty(ns * ne, bh, t, f, **kw)
    dc = torch.empty(ns, bh, t, e, **kw)
    run_pass(_bwd_bc_kernel, (a, b, c, dnum, drow, db, dc), **layout)
    return da, _reduce(db), _reduce(dc)


def _reduce(partials: torch.Tensor) -> torch.Tensor:
    """Σ over the leading (partial) dim in a fixed order; a view when there is one."""
    return partials[0] if partials.shape[0] == 1 else partials.sum(0)
