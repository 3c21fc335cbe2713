"""Performer-style causal linear attention by prefix sums (PolySketchFormer §3, first algorithm).

For i = 1..T, D_i = initial + Σ_{j<=i} B_jᵀ C_j and row i of lt(A Bᵀ) C is A_i D_i
(Choromanski et al. 2020, as recalled before Theorem 3.1). This is the second causal
algorithm of ``linear_attention`` (``algorithm="cumsum"``) and a cross-check of the chunked
one. It materializes one state per position: (..., T, F, E) floats, or (..., T, F, F, E) with
``square=True``; the square case is refused beyond ``MAX_SQUARE_CUMSUM_ELEMENTS`` elements
(use ``algorithm="chunked"``, which never stores per-position states).

As the cross-check of the other backends it forms the dense F×F square states (not the pair
features ψ of the others): ``lt_multiply``, the backend contract, converts its states from and
to the pair layout of ``polysketch.ops.state`` at the boundary (``pairs.expand``/``compress``).
"""

from __future__ import annotations

import math

import torch

from .pairs import compress, expand

__all__ = ["MAX_SQUARE_CUMSUM_ELEMENTS", "cumsum_lt_multiply", "lt_multiply"]

MAX_SQUARE_CUMSUM_ELEMENTS = 2**27
"""Largest (..., T, F, F, E) per-position state the square cumsum path will build (512 MiB fp32)."""


def cumsum_lt_multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    square: bool = False,
    initial: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal lt((A Bᵀ)^{∘q}) C by a cumulative sum of per-token states (q = 2 if ``square``).

    Plain: D_i = initial + Σ_{j<=i} B_j⊗C_j (..., T, F, E), out_i = A_i D_i.
    Square: D_i = initial + Σ_{j<=i} B_j⊗B_j⊗C_j (..., T, F, F, E),
    out_i = Σ_ab A_ia A_ib (D_i)_abe. Shapes: A, B (..., T, F), C (..., T, E), ``initial``
    (..., F[, F], E) -> out (..., T, E) and the final state D_T (T >= 1).
    """
    f, e = b.shape[-1], c.shape[-1]
    if square:
        numel = math.prod(b.shape[:-1]) * f * f * e
        if numel > MAX_SQUARE_CUMSUM_ELEMENTS:
            raise ValueError(
                f"algorithm='cumsum' with square=True would store {numel} floats of per-position "
                f"states (..., T, F, F, E) > MAX_SQUARE_CUMSUM_ELEMENTS="
                f"{MAX_SQUARE_CUMSUM_ELEMENTS}; use algorithm='chunked'"
            )
        bc = (b.unsqueeze(-1) * c.unsqueeze(-2)).unsqueeze(-3)  # (..., T, 1, F, E)
        d = (b.unsqueeze(-1).unsqueeze(-1) * bc).cumsum(-4)  # (..., T, F, F, E)
        if initial is not None:
            d = d + initial.unsqueeze(-4)
        y = (a.unsqueeze(-2) @ d.flatten(-2)).squeeze(-2).unflatten(-1, (f, e))  # (..., T, F, E)
        out = torch.einsum("...tg,...tge->...te", a, y)
        return out, d.select(-4, -1)
    d = (b.unsqueeze(-1) * c.unsqueeze(-2)).cumsum(-3)  # (..., T, F, E)
    if initial is not None:
        d = d + initial.unsqueeze(-3)
    out = (a.unsqueeze(-2) @ d).squeeze(-2)
    return out, d.select(-3, -1)


def lt_multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    square: bool,
    chunk_size: int,
    initial: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_state: bool = False,
    group_bytes: int | None = None,
):
    """The backend contract (``polysketch.ops.dispatch``): (num, den, state) by prefix sums.

    The normalizer is the last column of the product with [C 1] (§4). Shapes as
    ``polysketch.ops.chunked.lt_multiply``; ``chunk_size`` and ``group_bytes`` are unused.
    """
    f, e = a.shape[-1], c.shape[-1]
    c = torch.cat([c, c.new_ones(c.shape[:-1] + (1,))], dim=-1)
    init = None
    if initial is not None:
        init = torch.cat([initial[0], initial[1].unsqueeze(-1)], dim=-1)
        if square:
            init = expand(init, f)
    out, state = cumsum_lt_multiply(a, b, c, square=square, initial=init)
    final = None
    if return_state:
        if square:
            state = compress(state)
        final = (state[..., :e], state[..., e])
    return out[..., :e], out[..., e], final
