"""Block lower-triangular multiplication (PolySketchFormer §3, Theorem 3.1, Figure 4).

These are the tensor cores of ``linear_attention``: they take features and (augmented) values
already validated, cast and masked, and return ``(out, state)``. They are also the stable
internals that ``polysketch.ops.mixed`` and the benchmark build on.

Notation: A = φq (..., T, F), B = φk (..., T, F), C = values (..., T, E) (in
``linear_attention`` C is [V 1], PolySketchFormer §4, so the normalizer comes out of the same
pass as the last column). lt(M) keeps the lower triangle including the diagonal.

Plain scores (``square=False``), s_ij = A_i·B_j, the state is S = Σ_j B_jᵀ C_j: (..., F, E).
Squared scores (``square=True``), s_ij = (A_i·B_j)² = (A_i⊗A_i)·(B_j⊗B_j), the state is
S = Σ_j B_j⊗B_j⊗C_j: (..., F, F, E) and a query reads it as Σ_ab A_ia A_ib S_abe
(google-research polysketchformer ``tensor_lt_multiply``). The F² features A⊗A, B⊗B are never
built: ``square_state`` and ``square_apply`` contract one factor at a time, so the largest
temporary per token is F·E (not F²), and within a block the (C, C) score matrix is squared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as nnf

__all__ = [
    "square_state",
    "square_apply",
    "apply_state",
    "noncausal_multiply",
    "chunked_lt_multiply",
]


def square_state(b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """S_fge = Σ_t B_tf B_tg C_te for B (..., T, F), C (..., T, E) -> (..., F, F, E)."""
    f, e = b.shape[-1], c.shape[-1]
    bc = (b.unsqueeze(-1) * c.unsqueeze(-2)).flatten(-2)  # (..., T, F·E), never F²
    return (b.transpose(-1, -2) @ bc).unflatten(-1, (f, e))


def square_apply(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """out_te = Σ_fg A_tf A_tg S_fge for A (..., T, F), S (..., F, F, E) -> (..., T, E)."""
    f, e = s.shape[-2], s.shape[-1]
    y = (a @ s.flatten(-2)).unflatten(-1, (f, e))  # (..., T, F, E): Σ_f A_tf S_fge
    return torch.einsum("...tg,...tge->...te", a, y)


def apply_state(a: torch.Tensor, s: torch.Tensor, *, square: bool) -> torch.Tensor:
    """A S (plain, S: (..., F, E)) or Σ_fg A_f A_g S_fge (square, S: (..., F, F, E))."""
    return square_apply(a, s) if square else a @ s


def noncausal_multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    square: bool = False,
    initial: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal (A Bᵀ)^{∘q} C by associativity: A (Bᵀ C), q = 2 if ``square`` else 1.

    A (..., Tq, F), B (..., Tk, F), C (..., Tk, E); ``initial`` (the state of earlier keys,
    (..., F[, F], E)) is added to S. Returns out (..., Tq, E) and S (..., F[, F], E).
    O((Tq + Tk)·F·E) time (F²·E when square), no Tq×Tk matrix.
    """
    s = square_state(b, c) if square else b.transpose(-1, -2) @ c
    if initial is not None:
        s = s + initial
    return apply_state(a, s, square=square), s


def chunked_lt_multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    chunk_size: int = 256,
    square: bool = False,
    initial: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal lt((A Bᵀ)^{∘q}) C by blocks of ``chunk_size`` rows (Theorem 3.1, Figure 4).

    With blocks A_n, B_n, C_n of b rows (T padded with zero rows up to a multiple of b;
    zero keys add nothing, padded query rows are sliced off):

        out_n = lt((A_n B_nᵀ)^{∘q}) C_n  +  A_n · P_n,     P_n = initial + Σ_{m<n} S_m,

    with S_m = B_mᵀ C_m (plain) or Σ_{t∈m} B_t⊗B_t⊗C_t (square). All block products are one
    batched matmul over (..., num_blocks); the exclusive prefix P is one ``cumsum`` over
    blocks (computed as cumsum of S_0..S_{n-2} shifted by one block, never as cumsum - S, so a
    row never sees a later token even through rounding). O(T·b·F + T·F·E) time
    (T·F²·E when square). Shapes: A, B (..., T, F), C (..., T, E), ``initial`` (..., F[, F],
    E) -> out (..., T, E) and the final state initial + Σ_all S_m.
    """
    t = a.shape[-2]
    blk = max(1, min(chunk_size, t))
    n = -(-t // blk)
    pad = n * blk - t
    if pad:
        a, b, c = (nnf.pad(x, (0, 0, 0, pad)) for x in (a, b, c))
    a, b, c = (x.unflatten(-2, (n, blk)) for x in (a, b, c))  # (..., n, blk, ·)

    # Within blocks: exact masked products lt((A_n B_nᵀ)^{∘q}) C_n.
    scores = a @ b.transpose(-1, -2)  # (..., n, blk, blk)
    if square:
        scores = scores * scores
    tril = torch.ones(blk, blk, dtype=torch.bool, device=a.device).tril()
    out = torch.where(tril, scores, scores.new_zeros(())) @ c

    # Across blocks: per-block states and their exclusive prefix sums over blocks.
    states = square_state(b, c) if square else b.transpose(-1, -2) @ c  # (..., n, F[,F], E)
    bdim = states.dim() - (4 if square else 3)
    zero = torch.zeros_like(states.narrow(bdim, 0, 1))
    prefix = torch.cat([zero, states.narrow(bdim, 0, n - 1).cumsum(bdim)], dim=bdim)
    if initial is not None:
        prefix = prefix + initial.unsqueeze(bdim)
    out = out + apply_state(a, prefix, square=square)
    final = prefix.select(bdim, n - 1) + states.select(bdim, n - 1)
    return out.flatten(-3, -2)[..., :t, :], final
