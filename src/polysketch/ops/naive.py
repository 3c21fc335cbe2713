"""Exact quadratic attention: the references every fast path is tested against.

These functions materialize the masked (..., Tq, Tk) score matrix, so they cost O(Tq·Tk)
time and memory; use them for tests and short sequences only.

Causal alignment (all ops of ``polysketch.ops``): with ``causal=True`` the ``Tq`` queries are
aligned with the *last* ``Tq`` keys, as in decoding: query ``i`` (0-based) sits at absolute
position ``Tk - Tq + i`` and attends keys ``j <= Tk - Tq + i``. ``Tq > Tk`` is refused. For
``Tq == Tk`` this is the usual lower-triangular mask lt_Δ of PolySketchFormer Eq. (1).

Normalization guard (all ops): the denominator ``den = denominator_offset + Σ_j s_ij`` is
replaced by ``sign(den) · max(|den|, eps)`` with ``sign(0) = +1``, i.e. ``den`` is clamped
away from zero keeping its sign. For non-negative scores and ``den >= eps`` this changes
nothing; a query whose keys are all masked gets output 0 (numerator 0 over ``eps``). Signed
feature maps (e.g. trigonometric random features) can have denominators that cross zero:
the guard keeps the output finite but it is then meaningless, prefer non-negative maps or
``square=True``. ``eps=0`` disables the guard (0/0 then gives NaN).
"""

from __future__ import annotations

import math

import torch

from .._checks import check_float, check_positive_int, compute_dtype, refuse_unless
from ._validate import check_bool, check_key_padding_mask, check_offset_eps, check_qkv

__all__ = [
    "DEFAULT_EPS",
    "stabilize_denominator",
    "refuse_zero_normalizers",
    "causal_mask",
    "softmax_attention",
    "polynomial_attention",
    "naive_linear_attention",
]

DEFAULT_EPS = 1e-6
"""Default ``eps`` of the denominator guard (see the module docstring)."""


def _guard(den: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.where(den < 0, den.clamp(max=-eps), den.clamp(min=eps))


class _Guard(torch.autograd.Function):
    """``_guard`` with the backward of its autograd graph in one op: the gradient passes where
    the guard returned ``den`` itself (|den| >= eps, ±inf) and is 0 elsewhere (NaN included),
    exactly as through ``where`` and the two ``clamp``s, whose backward is ~10 small ops."""

    @staticmethod
    def forward(ctx, den, eps):
        out = _guard(den, eps)
        ctx.save_for_backward(out == den)
        return out

    @staticmethod
    def backward(ctx, grad):
        (passed,) = ctx.saved_tensors
        return torch.where(passed, grad, grad.new_zeros(())), None


def stabilize_denominator(den: torch.Tensor, eps: float) -> torch.Tensor:
    """sign(den) · max(|den|, eps), with sign(0) = +1 (elementwise, differentiable a.e.: the
    gradient is 1 where |den| >= eps, else 0)."""
    if eps == 0.0:
        return den
    if torch.is_grad_enabled() and den.requires_grad:
        return _Guard.apply(den, eps)
    return _guard(den, eps)


def refuse_zero_normalizers(den: torch.Tensor, sees: torch.Tensor | None) -> None:
    """Refuse rows whose normalizer Σ_j s_ij is exactly 0 although the query sees a key, for
    ``denominator_offset=0``: features that underflowed (positive random features at large
    ‖q‖, ‖k‖) or are all zero, where the guard would return 0, or the division NaN, without a
    word. Signed normalizers cross zero but are never exactly 0 by chance; a query that sees
    no key (``sees`` False: all its keys masked) keeps its 0 output. ``den`` (..., Tq),
    ``sees`` bool broadcastable to it or None (every row sees a key). One reduction
    (``refuse_unless``: no host sync on accelerators)."""
    ok = den != 0 if sees is None else (den != 0) | ~sees
    refuse_unless(
        ok,
        "the attention normalizer Σ_j φq(q_i)·φk(k_j) is exactly 0 for query rows that see keys "
        "(the features underflow, or are zero), so their outputs would be 0 or NaN: with "
        "denominator_offset=0 use kernel_attention (it stabilizes the queries of softmax-kernel "
        "maps), normalize q and k, lower the maps' scale, or set denominator_offset > 0",
    )


def causal_mask(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """Boolean (Tq, Tk) mask, True where key j is visible to query i: j <= i + (Tk - Tq)."""
    i = torch.arange(tq, device=device).unsqueeze(-1)
    j = torch.arange(tk, device=device)
    return j <= i + (tk - tq)


def _visible(q, k, causal: bool, key_padding_mask) -> torch.Tensor | None:
    """Boolean mask broadcastable to (..., Tq, Tk), or None when every key is visible."""
    mask = causal_mask(q.shape[-2], k.shape[-2], q.device) if causal else None
    if key_padding_mask is not None:
        kpm = key_padding_mask.unsqueeze(-2)  # (..., 1, Tk)
        mask = kpm if mask is None else mask & kpm
    return mask


def _scores_times_v(s, v, mask, *, normalize: bool, offset: float, eps: float):
    """out = (mask ⊙ s) v / stab(offset + (mask ⊙ s) 1); s: (..., Tq, Tk), v: (..., Tk, E)."""
    if mask is not None:
        s = torch.where(mask, s, s.new_zeros(()))
        v = torch.where(mask.any(-2).unsqueeze(-1), v, v.new_zeros(()))  # padded v may be NaN
    num = s @ v
    if not normalize:
        return num
    den = s.sum(-1, keepdim=True) + offset
    return num / stabilize_denominator(den, eps)


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact softmax attention: out = softmax(mask(q kᵀ · scale)) v, scale = 1/√D by default.

    PolySketchFormer §1 (A = softmax(mask(QKᵀ)/√h)). Shapes: q (..., Tq, D), k (..., Tk, D),
    v (..., Tk, E) -> (..., Tq, E). ``key_padding_mask`` (..., Tk) bool, True = keep. Computed
    in fp32 for bf16/fp16 inputs; a query with no visible key gets output 0.
    """
    check_bool(causal, "causal")
    check_qkv(q, k, v, names=("q", "k", "v"), causal=causal)
    check_key_padding_mask(key_padding_mask, k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else check_float(scale, "scale")
    dtype = q.dtype
    cd = compute_dtype(dtype)
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    logits = (q @ k.transpose(-1, -2)) * scale
    mask = _visible(q, k, causal, key_padding_mask)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
        m = logits.amax(-1, keepdim=True)
        logits = logits - torch.where(torch.isfinite(m), m, m.new_zeros(())).detach()
        p = torch.where(mask, logits.exp(), logits.new_zeros(()))
        out = p @ v / p.sum(-1, keepdim=True).clamp_min(torch.finfo(cd).tiny)
    else:
        out = torch.softmax(logits, dim=-1) @ v
    return out.to(dtype)


def polynomial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    degree: int,
    causal: bool,
    denominator_offset: float = 0.0,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """Exact polynomial attention, PolySketchFormer Eq. (1):

    out_i = Σ_{j visible} (q_i·k_j)^p v_j / (denominator_offset + Σ_{j visible} (q_i·k_j)^p).

    The paper uses even ``degree`` p so the weights are non-negative (rows are probability
    distributions); odd p is allowed but its denominators can cross zero (see the guard in the
    module docstring). Shapes: q (..., Tq, D), k (..., Tk, D), v (..., Tk, E) -> (..., Tq, E).
    """
    check_bool(causal, "causal")
    degree = check_positive_int(degree, "degree")
    check_qkv(q, k, v, names=("q", "k", "v"), causal=causal)
    check_key_padding_mask(key_padding_mask, k)
    offset, eps = check_offset_eps(denominator_offset, eps)
    dtype = q.dtype
    cd = compute_dtype(dtype)
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    s = (q @ k.transpose(-1, -2)) ** degree
    mask = _visible(q, k, causal, key_padding_mask)
    return _scores_times_v(s, v, mask, normalize=True, offset=offset, eps=eps).to(dtype)


def naive_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    square: bool = False,
    normalize: bool = True,
    denominator_offset: float = 0.0,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """Quadratic reference of ``linear_attention``: materializes S = mask ⊙ s, s_ij = φq_i·φk_j.

    out_i = Σ_j S_ij v_j / stab(denominator_offset + Σ_j S_ij)   (PolySketchFormer Eq. (1)
    with the features of Eq. (2)), s squared elementwise when ``square`` (the self-tensored
    features (φ⊗φ)·(φ⊗φ) = (φ·φ)², §2.2). ``normalize=False`` returns the numerator
    Σ_j S_ij v_j. Shapes: phi_q (..., Tq, F), phi_k (..., Tk, F), v (..., Tk, E) ->
    (..., Tq, E). Computed in fp32 for bf16/fp16 inputs, cast back.
    """
    check_bool(causal, "causal")
    check_bool(square, "square")
    check_bool(normalize, "normalize")
    check_qkv(phi_q, phi_k, v, causal=causal)
    check_key_padding_mask(key_padding_mask, phi_k)
    offset, eps = check_offset_eps(denominator_offset, eps)
    dtype = phi_q.dtype
    cd = compute_dtype(dtype)
    q, k, v = phi_q.to(cd), phi_k.to(cd), v.to(cd)
    s = q @ k.transpose(-1, -2)
    if square:
        s = s * s
    mask = _visible(q, k, causal, key_padding_mask)
    return _scores_times_v(s, v, mask, normalize=normalize, offset=offset, eps=eps).to(dtype)
