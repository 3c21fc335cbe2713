"""A state and the tokens: reading it, Ψq(A) P, and summing keys into it, Ψ(B)ᵀ C.

For the state layout of ``polysketch.ops.state`` (Ψ = Ψq = identity, F' = F; squared scores:
Ψ = ψ, Ψq = ω ⊙ ψ, the pair features of ``polysketch.ops.pairs``, F' = F(⌊F/2⌋+1)):

    read_state:  out_i = Ψq(A_i)·P                  A (..., T, F), P (..., F', X) -> (..., T, X)
    sum_state:   N = Σ_t Ψ(B_t)ᵀ C_t, Z = Σ_t Ψ(B_t)  B (..., T, F), C (..., T, E)
                                                    -> (..., F', E), (..., F')

(the inter-block terms of PolySketchFormer Theorem 3.1; with P = [N Z] the normalizer rides
in the last column of the read, §4). A state carried from elsewhere (the keys before a
packed row's first document, another rank's shard) is read by ``read_state``; a shard's own
contribution to later ranks is ``sum_state`` (``polysketch.distributed``).

For squared scores Ψ(·) is T×F' (F' ≈ F²/2): both build it in slices of ``STATE_IO_TOKENS``
rows and recompute it in the backward instead of storing it, so they add O(STATE_IO_TOKENS·F')
temporaries whatever T is:

    read:  dA = Ψq'(A)ᵀ (dO Pᵀ),  dP = Ψq(A)ᵀ dO;   sum:  dB = Ψ'(B)ᵀ (C dNᵀ + dZ),  dC = Ψ(B) dN

(``PairFeatures.backward`` for Ψ'). Plain scores are one matmul each (autograd stores only
the inputs).
"""

from __future__ import annotations

import torch

from .pairs import PairFeatures

__all__ = ["STATE_IO_TOKENS", "read_state", "sum_state"]

STATE_IO_TOKENS = 2048
"""Rows per slice of the squared read and sum (bounds the T×F' pair-feature temporary)."""


def _slices(t: int):
    return [slice(s, s + STATE_IO_TOKENS) for s in range(0, t, STATE_IO_TOKENS)]


class _PairRead(torch.autograd.Function):
    """Ψq(A) P for squared scores, in slices, recomputing backward."""

    @staticmethod
    def forward(ctx, a, p):
        pairs = PairFeatures(a.shape[-1], a)
        pa = p.to(a.dtype)
        out = a.new_empty(*a.shape[:-1], p.shape[-1], dtype=p.dtype)
        for s in _slices(a.shape[-2]):
            out[..., s, :] = pairs.queries(a[..., s, :]) @ pa
        ctx.save_for_backward(a, p)
        return out

    @staticmethod
    def backward(ctx, d_out):
        a, p = ctx.saved_tensors
        pairs = PairFeatures(a.shape[-1], a)
        pa, dp, da = p.to(a.dtype), torch.zeros_like(p), torch.empty_like(a)
        omega = pairs.omega.to(a.dtype)
        for s in _slices(a.shape[-2]):
            ag, dg = a[..., s, :], d_out[..., s, :].to(a.dtype)
            dp = dp + (pairs.queries(ag).transpose(-1, -2) @ dg).to(p.dtype)
            da[..., s, :] = pairs.backward(ag, (dg @ pa.transpose(-1, -2)) * omega)
        return da, dp


class _PairSum(torch.autograd.Function):
    """(Σ ψ(B)ᵀ C, Σ ψ(B)) for squared scores, in slices, recomputing backward."""

    @staticmethod
    def forward(ctx, b, c):
        pairs = PairFeatures(b.shape[-1], b)
        n = b.new_zeros(*b.shape[:-2], pairs.dim, c.shape[-1])
        z = b.new_zeros(*b.shape[:-2], pairs.dim)
        for s in _slices(b.shape[-2]):
            kf = pairs.features(b[..., s, :])
            n, z = n + kf.transpose(-1, -2) @ c[..., s, :], z + kf.sum(-2)
        ctx.save_for_backward(b, c)
        return n, z

    @staticmethod
    def backward(ctx, d_n, d_z):
        b, c = ctx.saved_tensors
        pairs = PairFeatures(b.shape[-1], b)
        db, dc = torch.empty_like(b), torch.empty_like(c)
        for s in _slices(b.shape[-2]):
            bg, cg = b[..., s, :], c[..., s, :]
            dkf = cg @ d_n.transpose(-1, -2) + d_z.unsqueeze(-2)
            db[..., s, :] = pairs.backward(bg, dkf)
            dc[..., s, :] = pairs.features(bg) @ d_n
        return db, dc


def read_state(a: torch.Tensor, p: torch.Tensor, *, square: bool) -> torch.Tensor:
    """Ψq(A) P (module docstring): a (..., T, F), p (..., F', X) -> (..., T, X) in p's dtype.

    The product runs with operands in a's dtype (the caller's operand dtype) and is returned
    in p's (the accumulation dtype of the state). Any T >= 0; differentiable in a and p.
    """
    if not square:
        return (a @ p.to(a.dtype)).to(p.dtype)
    return _PairRead.apply(a, p)


def sum_state(
    b: torch.Tensor, c: torch.Tensor, *, square: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, Z) = (Σ_t Ψ(B_t)ᵀ C_t, Σ_t Ψ(B_t)) (module docstring; ``ops.state``'s layout):
    b (..., T, F), c (..., T, E) -> N (..., F', E), Z (..., F').

    Same dtype for b and c (the accumulation dtype: the caller casts). Any T >= 0 (T = 0 gives
    zeros, still differentiable in b and c); differentiable in both.
    """
    if not square:
        return b.transpose(-1, -2) @ c, b.sum(-2)
    return _PairSum.apply(b, c)
