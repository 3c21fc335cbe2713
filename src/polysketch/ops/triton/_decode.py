"""Fused decode step: state update and read for one new token per sequence.

    N' = N + Ψ(k)⊗v,   Z' = Z + Ψ(k),   num = Ψq(q)·N',   den = Ψq(q)·Z'

(the new token sees itself). Plain: Ψ = Ψq = identity, N (F, E), Z (F,). Square: the pair
layout of ``polysketch.ops.state``, N (F', E), Z (F') with F' = F·W, W = ⌊F/2⌋+1, row
a·W + d holding the pair (a, (a+d) mod F): Ψ(k)_(a,d) = k_a k_(a+d), Ψq(q)_(a,d) =
ω_d q_a q_(a+d) (``polysketch.ops.pairs``); the W offsets are unrolled, each a (F, BE) tile
of rows a·W + d, so ψ is never formed in memory. One program per (batch·head, tile of BE value
columns) streams its columns of N once (read and write: the step is bound by the state's
memory traffic); tile 0 also updates Z. All arithmetic in fp32 (no ``tl.dot``: these are
matrix-vector products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["decode"]


@triton.jit
def _decode_kernel(
    Q, K, V, N, Z, NOUT, ZOUT, NUM, DEN,
    F: tl.constexpr, E: tl.constexpr, BE: tl.constexpr, SQUARE: tl.constexpr,
    W: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    pe = tl.program_id(1)
    offs_f = tl.arange(0, F)
    offs_e = pe * BE + tl.arange(0, BE)
    q = tl.load(Q + bh * F + offs_f).to(tl.float32)
    k = tl.load(K + bh * F + offs_f).to(tl.float32)
    v = tl.load(V + bh * E + offs_e).to(tl.float32)
    first = offs_f * 0 + pe == 0  # tile 0 owns Z
    if SQUARE:
        acc = tl.zeros([BE], dtype=tl.float32)
        den = tl.sum(tl.zeros([F], dtype=tl.float32), axis=0)
        for d in tl.static_range(W):
            shift = (offs_f + d) % F
            qq = q * tl.load(Q + bh * F + shift).to(tl.float32)
            kk = k * tl.load(K + bh * F + shift).to(tl.float32)
            if d == 0 or 2 * d == F:
                w = 1.0
            else:
                w = 2.0
            rows = offs_f * W + d
            off = bh * F * W * E + rows[:, None] * E + offs_e[None, :]
            n = tl.load(N + off) + kk[:, None] * v[None, :]
            tl.store(NOUT + off, n)
            acc += w * tl.sum(qq[:, None] * n, axis=0)
            zoff = bh * F * W + rows
            z = tl.load(Z + zoff) + kk
            tl.store(ZOUT + zoff, z, mask=first)
            den += w * tl.sum(qq * z, axis=0)
    else:
        off = bh * F * E + offs_f[:, None] * E + offs_e[None, :]
        n = tl.load(N + off) + k[:, None] * v[None, :]
        tl.store(NOUT + off, n)
        acc = tl.sum(q[:, None] * n, axis=0)
        z = tl.load(Z + bh * F + offs_f) + k
        tl.store(ZOUT + bh * F + offs_f, z, mask=first)
        den = tl.sum(q * z, axis=0)
    tl.store(NUM + bh * E + offs_e, acc)
    tl.store(DEN + bh + offs_f * 0, den + offs_f * 0.0, mask=first & (offs_f == 0))


def decode(q, k, v, n, z, *, square: bool):
    """num (BH, E), den (BH,), N' and Z' (fp32) for contiguous q, k (BH, F), v (BH, E),
    N (BH, F', E), Z (BH, F') fp32 (F' = F, or F(⌊F/2⌋+1) with ``square``)."""
    bh, f = q.shape
    e = v.shape[-1]
    be = min(e, 64)
    kw = {"dtype": torch.float32, "device": q.device}
    num, den = torch.empty(bh, e, **kw), torch.empty(bh, **kw)
    n2, z2 = torch.empty_like(n), torch.empty_like(z)
    _decode_kernel[(bh, triton.cdiv(e, be))](
        q, k, v, n, z, n2, z2, num, den, F=f, E=e, BE=be, SQUARE=square, W=f // 2 + 1,
        num_warps=4,
    )  # fmt: skip
    return num, den, n2, z2
