"""Non-causal linear attention through the backend contract: (Ψq(A) Ψ(B)ᵀ) C by associativity.

Every query sees every key (and the keys of an initial state), so the state is formed once and
read by all queries (PolySketchFormer §4, no Tq×Tk matrix):

    N = N_0 + Σ_t Ψ(B_t)⊗C_t,   Z = Z_0 + Σ_t Ψ(B_t),   num = Ψq(A) N,   den = Ψq(A) Z,

Ψ, Ψq as in ``polysketch.ops.state`` (identity, or the pair features ψ and ω ⊙ ψ when
``square``). With no query (A of length 0) it only folds keys into a state: this is also how
``linear_attention`` consumes causal keys before the first query (Tq < Tk). O((Tq + Tk)·F'·E).
"""

from __future__ import annotations

import torch

from .pairs import KEY_STATE_TOKENS, PairFeatures, key_state

__all__ = ["multiply"]


def multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    square: bool,
    chunk_size: int | None = None,
    initial: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_state: bool = False,
    group_bytes: int | None = None,
):
    """The backend contract for non-causal calls: (num, den, state).

    Shapes: a (..., Tq, F), b (..., Tk, F), c (..., Tk, E), any Tq, Tk >= 0; ``initial``
    (N_0 (..., F', E), Z_0 (..., F')) or ``None`` -> num (..., Tq, E), den (..., Tq) and
    (N, Z) with ``return_state``. ``chunk_size`` and ``group_bytes`` are unused.
    """
    n, z = key_state(b, c, square=square)
    if initial is not None:
        n, z = n + initial[0], z + initial[1]
    if not square:
        num, den = a @ n, (a * z.unsqueeze(-2)).sum(-1)
    else:  # queries in slices: the Tq×F' features stay bounded
        pairs = PairFeatures(a.shape[-1], a)
        nums, dens = [], []
        for start in range(0, max(1, a.shape[-2]), KEY_STATE_TOKENS):
            qf = pairs.queries(a[..., start : start + KEY_STATE_TOKENS, :])
            nums.append(qf @ n)
            dens.append((qf * z.unsqueeze(-2)).sum(-1))
        num = nums[0] if len(nums) == 1 else torch.cat(nums, dim=-2)
        den = dens[0] if len(dens) == 1 else torch.cat(dens, dim=-1)
    return num, den, (n, z) if return_state else None
