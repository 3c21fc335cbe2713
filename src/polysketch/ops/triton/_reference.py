"""Dense PyTorch references of the three kernel ops (``custom_ops``), for CPU tensors inside
``cpu_reference()``: the same contract and dtypes as the kernels, in fp32, O(T²) memory (tests
and tracing at small T; never a fast path). No triton import.

With M = lt((A Bᵀ)^{∘q}) (q = 2 if ``square`` else 1, lt the causal lower triangle with the
diagonal) and G = A Bᵀ:

    forward    num = M C,  row_sums = M 1
    backward   dM = lt(dnum Cᵀ + drow 1ᵀ),  dC = Mᵀ dnum,  dG = q G^{q-1} ∘ dM,
               dA = dG B,  dB = dGᵀ A
    decode     N' = N + Ψ(k) vᵀ,  Z' = Z + Ψ(k),  num = Ψq(q)ᵀ N',  den = Ψq(q)·Z'

(Ψ, Ψq: identity, or the pair features ψ and ω ⊙ ψ of ``ops.pairs`` when ``square``.)
"""

from __future__ import annotations

import torch

from .._constants import lower_triangle
from ..pairs import PairFeatures

__all__ = ["lt_multiply_with_sums", "lt_multiply_with_sums_backward", "decode_step"]


def _scores(a: torch.Tensor, b: torch.Tensor, square: bool):
    g = a.float() @ b.float().transpose(-1, -2)
    keep = lower_triangle(a.shape[-2], a.device)
    m = torch.where(keep, g * g if square else g, g.new_zeros(()))
    return g, m, keep


def lt_multiply_with_sums(a, b, c, *, square: bool):
    """num (BH, T, E), row_sums (BH, T), fp32, for A, B (BH, T, F), C (BH, T, E)."""
    _, m, _ = _scores(a, b, square)
    return m @ c.float(), m.sum(-1)


def lt_multiply_with_sums_backward(a, b, c, dnum, drow, *, square: bool):
    """dA, dB (BH, T, F), dC (BH, T, E), fp32 (module docstring)."""
    g, m, keep = _scores(a, b, square)
    dnum = dnum.float()
    dm = dnum @ c.float().transpose(-1, -2) + drow.float().unsqueeze(-1)
    dm = torch.where(keep, dm, dm.new_zeros(()))
    dg = dm * (2 * g) if square else dm
    return dg @ b.float(), dg.transpose(-1, -2) @ a.float(), m.transpose(-1, -2) @ dnum


def decode_step(q, k, v, n, z, *, square: bool):
    """num (BH, E), den (BH,), N' (BH, F', E), Z' (BH, F') fp32 for q, k (BH, F), v (BH, E),
    N, Z fp32 (module docstring)."""
    q, k, v = q.float(), k.float(), v.float()
    if square:
        pairs = PairFeatures(q.shape[-1], q)
        kf, qf = pairs.features(k), pairs.queries(q)
    else:
        kf, qf = k, q
    n2 = n + kf.unsqueeze(-1) * v.unsqueeze(-2)
    z2 = z + kf
    num = (qf.unsqueeze(-2) @ n2).squeeze(-2)
    return num, (qf * z2).sum(-1), n2, z2
