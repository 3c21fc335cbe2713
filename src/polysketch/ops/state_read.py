"""Reading a state: out = Ψq(A) P, the part of causal linear attention that comes from keys
stored in a state (PolySketchFormer §3, the inter-block term of Theorem 3.1).

For query features A (..., T, F) and a state P (..., F', X) in the layout of
``polysketch.ops.state`` (P = [N Z] side by side gives the numerator and the normalizer in
one product, §4),

    out_i = Ψq(A_i)·P   (..., T, X),   Ψq = identity (F' = F), or ω ⊙ ψ (squared scores,
                                        F' = F(⌊F/2⌋+1), ``polysketch.ops.pairs``).

A state carried from elsewhere (keys of an earlier document, another rank's shard of the
sequence) reaches every query of a row this way; ``polysketch.ops.varlen`` and
``polysketch.distributed`` add it to the local numerator and normalizer before dividing.

For squared scores the pair features Ψq(A) are T×F' (F' ≈ F²/2): they are built and used in
slices of ``READ_TOKENS`` rows and recomputed in the backward, never stored, so the read adds
O(READ_TOKENS·F') temporaries whatever T is:

    dA = Ψq'(A)ᵀ (dO Pᵀ),   dP = Ψq(A)ᵀ dO       (``PairFeatures.backward`` for Ψq').
"""

from __future__ import annotations

import torch

from .pairs import PairFeatures

__all__ = ["READ_TOKENS", "read_state"]

READ_TOKENS = 2048
"""Rows per slice of the squared read (bounds the T×F' pair-feature temporary)."""


class _PairRead(torch.autograd.Function):
    """Ψq(A) P for squared scores, in slices of ``READ_TOKENS`` rows, recomputing backward."""

    @staticmethod
    def forward(ctx, a, p):
        pairs = PairFeatures(a.shape[-1], a)
        pa = p.to(a.dtype)
        outs = [
            pairs.queries(a[..., s : s + READ_TOKENS, :]) @ pa
            for s in range(0, a.shape[-2], READ_TOKENS)
        ]
        ctx.save_for_backward(a, p)
        if not outs:
            return a.new_zeros(*a.shape[:-1], p.shape[-1]).to(p.dtype)
        return torch.cat(outs, dim=-2).to(p.dtype)

    @staticmethod
    def backward(ctx, d_out):
        a, p = ctx.saved_tensors
        pairs = PairFeatures(a.shape[-1], a)
        pa, dp, das = p.to(a.dtype), torch.zeros_like(p), []
        omega = pairs.omega.to(a.dtype)
        for s in range(0, a.shape[-2], READ_TOKENS):
            ag, dg = a[..., s : s + READ_TOKENS, :], d_out[..., s : s + READ_TOKENS, :].to(a.dtype)
            dp = dp + (pairs.queries(ag).transpose(-1, -2) @ dg).to(p.dtype)
            das.append(pairs.backward(ag, (dg @ pa.transpose(-1, -2)) * omega))
        da = torch.cat(das, dim=-2) if das else torch.zeros_like(a)
        return da.to(a.dtype), dp


def read_state(a: torch.Tensor, p: torch.Tensor, *, square: bool) -> torch.Tensor:
    """Ψq(A) P (module docstring): a (..., T, F), p (..., F', X) -> (..., T, X) in p's dtype.

    The product runs with operands in a's dtype (the caller's operand dtype) and is returned
    in p's (the accumulation dtype of the state). Any T >= 0; differentiable in a and p.
    """
    if not square:
        return (a @ p.to(a.dtype)).to(p.dtype)
    return _PairRead.apply(a, p)
