"""Kernelized (linear-time) attention: ``linear_attention`` on features, ``kernel_attention``.

    out_i = Σ_{j visible to i} s_ij v_j / stab(denominator_offset + Σ_{j visible to i} s_ij),
    s_ij = φq_i·φk_j, or (φq_i·φk_j)² when ``square``            (PolySketchFormer Eq. (1), (2))

computed without the T×T matrix: non-causal by associativity φq (φkᵀ V), causal by the block
lower-triangular algorithm (Theorem 3.1) or by prefix sums. ``linear_attention`` validates,
asks ``polysketch.ops.dispatch`` for a plan (which backend, operand dtype, memory budget),
runs the backend contract (numerator, normalizer, state) and normalizes; nothing here knows
which backend ran. Visibility: causal (queries aligned with the last keys, see
``polysketch.ops.naive``; keys before the first query are folded into the initial state by
the non-causal backend) and a boolean ``key_padding_mask`` (..., Tk), True = keep (torch SDPA's
boolean convention); masked keys never enter any state. ``stab`` is the sign-keeping clamp of
``naive.stabilize_denominator``.

Precision (``dispatch.operand_dtype``): on accelerators (``chunked_blocks``, ``triton``)
bf16/fp16 features and values stay half as GEMM operands (tensor cores, fp32 accumulation
inside each GEMM) while scores are squared, and states, prefix sums and denominators
accumulate, in fp32; on CPU and for ``cumsum`` half inputs are upcast to fp32 (faster in CPU
BLAS). The output is cast back to the input dtype; returned states are in fp32 (the input dtype
for fp32/fp64). fp16 operands multiply in fp32 in the block function and the Triton kernels
(``ops.blocks.gemm_dtype``): fp16's range (65504) cannot hold the squared scores and states.
"""

from __future__ import annotations

import torch

from .._auxiliary import checkpoint as _checkpoint
from .._checks import check_choice, compute_dtype
from ..features.base import FeatureMap
from ._validate import (
    check_attn_mask,
    check_bool,
    check_chunk_size,
    check_key_padding_mask,
    check_offset_eps,
    check_qkv,
)
from .dispatch import ALGORITHMS, NONCAUSAL, plan
from .naive import DEFAULT_EPS, refuse_zero_normalizers, stabilize_denominator
from .state import LinearAttentionState, unpack_state
from .varlen import varlen_linear_attention

__all__ = ["ALGORITHMS", "linear_attention", "kernel_attention"]


def linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    square: bool = False,
    chunk_size: int = 256,
    normalize: bool = True,
    denominator_offset: float = 0.0,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    algorithm: str = "chunked",
    eps: float = DEFAULT_EPS,
    attn_mask: None = None,
    cu_seqlens=None,
):
    """Linear attention on features (see the module docstring for the formula).

    Args:
        phi_q: query features (..., Tq, F). phi_k: key features (..., Tk, F). v: (..., Tk, E).
            Same leading dims (no broadcasting), dtype and device; any Tq >= 0, Tk >= 1 (causal
            needs Tq <= Tk: query i is at position Tk - Tq + i; Tq = 0 gives an empty output).
        causal: apply the causal mask.
        square: scores (φq·φk)² (the self-tensored features of PolySketchFormer §2.2), never
            materializing the F² features; the state is then in the pair layout (..., F', E),
            F' = F(⌊F/2⌋+1) (``polysketch.ops.state``).
        chunk_size: block size b of the chunked causal algorithm (any T; padded internally).
        normalize: divide by the normalizer; ``False`` returns the numerator Σ_j s_ij v_j
            (``denominator_offset`` and ``eps`` are then unused).
        denominator_offset: added to the normalizer (1.0 gives PolySketchFormer's 1 + Σ).
        initial_state: ``LinearAttentionState`` of earlier keys (prefix of the sequence);
            they are visible to every query. ``None``: no earlier keys.
        return_state: also return the ``LinearAttentionState`` after all keys.
        key_padding_mask: bool, phi_k.shape[:-1]'s rank, each dim 1 or the keys' (e.g. (B, 1, Tk)
            for (B, H, Tk, F) keys), True = keep; a lower rank is refused.
            Outputs of queries at padded positions are meaningless (ignore them).
        algorithm: causal backend: ``"chunked"`` (Theorem 3.1; ``"chunked_scan"`` on CPU,
            ``"chunked_blocks"`` on accelerators, ``"triton"`` only when switched on), one of
            those by name, or ``"cumsum"`` (Performer); see ``polysketch.ops.dispatch``.
        eps: the denominator guard (``polysketch.ops.naive``); 0 disables it.
        attn_mask: refused; an arbitrary (Tq, Tk) mask cannot be linearized.
        cu_seqlens: packed documents, the state reset at each boundary (causal only; Tq = Tk):
            ``polysketch.ops.varlen.varlen_linear_attention`` runs the call.

    Returns:
        out (..., Tq, E) in the input dtype, or ``(out, state)`` with ``return_state``.
    """
    check_attn_mask(attn_mask)
    check_bool(causal, "causal")
    if cu_seqlens is not None:
        if not causal:
            raise ValueError("cu_seqlens (packed documents) needs causal=True")
        return varlen_linear_attention(
            phi_q, phi_k, v, cu_seqlens, square=square, chunk_size=chunk_size,
            normalize=normalize, denominator_offset=denominator_offset,
            initial_state=initial_state, return_state=return_state,
            key_padding_mask=key_padding_mask, algorithm=algorithm, eps=eps,
        )  # fmt: skip
    check_bool(square, "square")
    check_bool(normalize, "normalize")
    check_bool(return_state, "return_state")
    check_qkv(phi_q, phi_k, v, causal=causal)
    chunk_size = check_chunk_size(chunk_size)
    check_choice(algorithm, "algorithm", ALGORITHMS)
    check_key_padding_mask(key_padding_mask, phi_k)
    offset, eps = check_offset_eps(denominator_offset, eps)

    dtype, e = phi_q.dtype, v.shape[-1]
    tq, tk = phi_q.shape[-2], phi_k.shape[-2]
    n0, z0 = unpack_state(
        initial_state, leading=tuple(phi_q.shape[:-2]), feature_dim=phi_q.shape[-1],
        value_dim=e, square=square, dtype=compute_dtype(dtype), device=phi_q.device,
    )  # fmt: skip
    init = None if initial_state is None else (n0, z0)
    if causal and tq > 0:
        tensors = (phi_q, phi_k, v, *(init or ()))
        how = plan(algorithm, phi_q, phi_k, v, square=square, needs_grad=_needs_grad(*tensors),
                   with_state=initial_state is not None or return_state or tq < tk)  # fmt: skip
    else:
        how = plan(None, phi_q, phi_k, v, square=square, with_state=True, needs_grad=False)
    q, k, c = (x.to(how.operand_dtype) for x in (phi_q, phi_k, v))
    if key_padding_mask is not None:  # masked keys (and their possibly non-finite v) drop out
        keep = key_padding_mask.unsqueeze(-1)
        k = torch.where(keep, k, k.new_zeros(()))
        c = torch.where(keep, c, c.new_zeros(()))
    kw = {"square": square, "chunk_size": chunk_size}
    if causal and tq < tk:  # keys before the first query: a prefix visible to every query
        pre = tk - tq
        acc = how.accumulate_dtype
        _, _, init = NONCAUSAL.run(q[..., :0, :].to(acc), k[..., :pre, :].to(acc),
                                   c[..., :pre, :].to(acc), initial=init, return_state=True,
                                   group_bytes=None, **kw)  # fmt: skip
        k, c = k[..., pre:, :], c[..., pre:, :]
    if causal and tq == 0:  # no query: an empty output (as SDPA); the keys only fill the state
        num, den, state = q.new_zeros(*q.shape[:-1], e), q.new_zeros(q.shape[:-1]), init
    else:
        num, den, state = how.run(q, k, c, initial=init, return_state=return_state, **kw)
    if normalize and offset == 0.0:
        earlier = initial_state is not None and initial_state.length > 0
        if key_padding_mask is None or earlier:
            sees = None if tk > 0 or earlier else den.new_zeros((), dtype=torch.bool)
        elif causal:  # query i sees keys j <= i + (Tk - Tq)
            sees = key_padding_mask.cumsum(-1)[..., tk - tq :] > 0
        else:
            sees = key_padding_mask.any(-1, keepdim=True)
        refuse_zero_normalizers(den, sees)
    out = num / stabilize_denominator(den.unsqueeze(-1) + offset, eps) if normalize else num
    out = out.to(dtype)
    if not return_state:
        return out
    if state is None:  # no key was consumed
        empty = LinearAttentionState.zeros(tuple(q.shape[:-2]), q.shape[-1], e, square=square,
                                           dtype=how.accumulate_dtype, device=q.device)  # fmt: skip
        state = (empty.numerator, empty.denominator)
    previous = 0 if initial_state is None else initial_state.length
    return out, LinearAttentionState(*state, previous + tk)


def _needs_grad(*tensors) -> bool:
    """Whether autograd will record an op on any of ``tensors``."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    causal: bool,
    chunk_size: int = 256,
    normalize: bool = True,
    denominator_offset: float = 0.0,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    checkpoint: bool = False,
    algorithm: str = "chunked",
    eps: float = DEFAULT_EPS,
    attn_mask: None = None,
):
    """Attention with scores s(q_i, k_j) = φq(q_i)·φk(k_j) (squared if ``feature_map.square``).

    Applies the feature map through ``features.stability.attention_features`` and then
    ``linear_attention`` (see there for every argument). Shapes: q (..., Tq, D),
    k (..., Tk, D), v (..., Tk, E) -> (..., Tq, E). With ``normalize=True`` and
    ``denominator_offset=0`` the queries are ``feature_map.query_stabilized`` (a positive
    factor per row, which cancels: exact, and finite where exp(scale·q·k) is not); features
    that overflow, and normalizers the eps guard would alter, raise ValueError naming the
    cause and the fix (``features.stability``).
    ``checkpoint=True`` recomputes the features and the attention in the backward pass
    instead of storing them (PolySketchFormer §4, rematerialization), through
    ``torch.utils.checkpoint`` with ``use_reentrant=False``; the values and gradients are
    unchanged, the activation memory of the layer drops to its inputs and outputs.
    """
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a FeatureMap, got {type(feature_map).__name__}")
    check_attn_mask(attn_mask)
    check_bool(checkpoint, "checkpoint")
    check_bool(causal, "causal")
    check_qkv(q, k, v, names=("q", "k", "v"), causal=causal)
    if q.shape[-1] != feature_map.dim:
        raise ValueError(
            f"q and k must have last dimension feature_map.dim={feature_map.dim}, "
            f"got {tuple(q.shape)}"
        )

    # stabilized queries and range checks (the FeatureMap contract; imported here so that this
    # change stays inside kernel_attention while ops/ is being restructured)
    from ..features.stability import attention_features

    initial_sums = getattr(initial_state, "denominator", None)

    def run(q, k, v):
        phi_q, phi_k = attention_features(
            feature_map, q, k, causal=causal, eps=eps, normalize=normalize,
            denominator_offset=denominator_offset, key_padding_mask=key_padding_mask,
            initial_sums=initial_sums,
        )  # fmt: skip
        return linear_attention(
            phi_q,
            phi_k,
            v,
            causal=causal,
            square=feature_map.square,
            chunk_size=chunk_size,
            normalize=normalize,
            denominator_offset=denominator_offset,
            initial_state=initial_state,
            return_state=return_state,
            key_padding_mask=key_padding_mask,
            algorithm=algorithm,
            eps=eps,
        )

    if checkpoint and torch.is_grad_enabled():
        return _checkpoint(run, q, k, v)
    return run(q, k, v)
