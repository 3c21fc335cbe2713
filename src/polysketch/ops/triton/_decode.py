"""Fused decode step: state update and read for one new token per sequence.

    N' = N + Φ(k)⊗v,   Z' = Z + Φ(k),   num = Φ(q)·N',   den = Φ(q)·Z'

(the new token sees itself), Φ(x) = x (plain: N (F, E), Z (F,)) or x⊗x (square: N (F, F, E),
Z (F, F), never forming Φ: slice a of N' is N_a + k_a k⊗v and is read as q_a (q·N'_a)).
One program per (batch·head, tile of BE value columns) streams its columns of N once (read
and write: the step is bound by the state's memory traffic); tile 0 also updates Z. All
arithmetic in fp32 (no ``tl.dot``: these are matrix-vector products).
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
        for i in range(F):
            off = bh * F * F * E + i * F * E + offs_f[:, None] * E + offs_e[None, :]
            q_i = tl.load(Q + bh * F + i).to(tl.float32)
            k_i = tl.load(K + bh * F + i).to(tl.float32)
            n = tl.load(N + off) + (k_i * k)[:, None] * v[None, :]
            tl.store(NOUT + off, n)
            acc += q_i * tl.sum(q[:, None] * n, axis=0)
        zoff = bh * F * F + offs_f[:, None] * F + offs_f[None, :]
        z = tl.load(Z + zoff) + k[:, None] * k[None, :]
        tl.store(ZOUT + zoff, z, mask=first[:, None])
        den = tl.sum(tl.sum(z * q[None, :], axis=1) * q, axis=0)
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
    N (BH, F[, F], E), Z (BH, F[, F]) fp32."""
    bh, f = q.shape
    e = v.shape[-1]
    be = min(e, 64)
    kw = {"dtype": torch.float32, "device": q.device}
    num, den = torch.empty(bh, e, **kw), torch.empty(bh, **kw)
    n2, z2 = torch.empty_like(n), torch.empty_like(z)
    _decode_kernel[(bh, triton.cdiv(e, be))](
        q, k, v, n, z, n2, z2, num, den, F=f, E=e, BE=be, SQUARE=square, num_warps=4
    )
    return num, den, n2, z2
