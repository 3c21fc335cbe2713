"""Kernelized (linear-time) attention: ``linear_attention`` on features, ``kernel_attention``.

    out_i = Σ_{j visible to i} s_ij v_j / stab(denominator_offset + Σ_{j visible to i} s_ij),
    s_ij = φq_i·φk_j, or (φq_i·φk_j)² when ``square``            (PolySketchFormer Eq. (1), (2))

computed without the T×T matrix: non-causal by associativity φq (φkᵀ [V 1]); causal by the
block lower-triangular algorithm (``chunked``, Theorem 3.1) or by prefix sums (``cumsum``).
The normalizer comes from the same pass: the last column of the product with [V 1] (§4), or,
on the chunked path, the row sums of the masked block scores plus the queries' read of the
running key sums (``chunked_lt_multiply_with_sums``: the same numbers without a 65th GEMM
column). Visibility: causal
(queries aligned with the last keys, see ``polysketch.ops.naive``) and a boolean
``key_padding_mask`` (..., Tk), True = keep (torch SDPA's boolean convention); masked keys
never enter any state. ``stab`` is the sign-keeping clamp of ``naive.stabilize_denominator``.

Precision (``_checks.operand_dtype``): on accelerators (``chunked_blocks``, ``triton``) bf16/fp16
features and values stay half as GEMM operands (tensor cores, fp32 accumulation inside each
GEMM) while scores are squared, and states, prefix sums and denominators accumulate, in fp32;
on CPU and for ``cumsum`` half inputs are upcast to fp32 (faster in CPU BLAS). The output is
cast back to the input dtype; returned states are in fp32 (the input dtype for fp32/fp64).
fp16 has a small range: squared scores or states beyond 65504 overflow (prefer bf16).

Gradients: ``chunked_blocks`` and the training path of ``chunked_scan`` are one
``autograd.Function`` (``ops.blocks``) whose backward recomputes per-block scores and
features; it stores the inputs and the per-block prefix states only.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

from .._checks import check_choice, compute_dtype, operand_dtype
from ..features.base import FeatureMap
from ._validate import (
    check_attn_mask,
    check_bool,
    check_chunk_size,
    check_key_padding_mask,
    check_offset_eps,
    check_qkv,
)
from .blocks import ACCELERATOR_GROUP_BYTES, CPU_GROUP_BYTES, blocks_lt_multiply
from .chunked import (
    _PairFeatures,
    chunked_lt_multiply,
    chunked_lt_multiply_with_sums,
    key_sums,
    noncausal_multiply,
    square_state,
)
from .cumsum import cumsum_lt_multiply
from .dispatch import ALGORITHMS, resolve_algorithm, triton_backend
from .naive import DEFAULT_EPS, stabilize_denominator
from .recurrent import LinearAttentionState, unpack_state

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
):
    """Linear attention on features (see the module docstring for the formula).

    Args:
        phi_q: query features (..., Tq, F). phi_k: key features (..., Tk, F). v: (..., Tk, E).
            Same leading dims (no broadcasting), dtype and device; any Tq >= 0, Tk >= 1 (causal
            needs Tq <= Tk: query i is at position Tk - Tq + i; Tq = 0 gives an empty output).
        causal: apply the causal mask.
        square: scores (φq·φk)² (the self-tensored features of PolySketchFormer §2.2), never
            materializing the F² features; the state is then (..., F, F, E).
        chunk_size: block size b of the chunked causal algorithm (any T; padded internally).
        normalize: divide by the normalizer; ``False`` returns the numerator Σ_j s_ij v_j
            (``denominator_offset`` and ``eps`` are then unused).
        denominator_offset: added to the normalizer (1.0 gives PolySketchFormer's 1 + Σ).
        initial_state: ``LinearAttentionState`` of earlier keys (prefix of the sequence);
            they are visible to every query. ``None``: no earlier keys.
        return_state: also return the ``LinearAttentionState`` after all keys.
        key_padding_mask: bool (..., Tk) broadcastable to phi_k.shape[:-1], True = keep.
            Outputs of queries at padded positions are meaningless (ignore them).
        algorithm: causal algorithm: ``"chunked"`` (Theorem 3.1; picks ``"chunked_scan"`` on
            CPU, ``"triton"`` or ``"chunked_blocks"`` on accelerators), one of those three by
            name, or ``"cumsum"`` (Performer); see ``polysketch.ops.dispatch``.
        eps: the denominator guard (``polysketch.ops.naive``); 0 disables it.
        attn_mask: refused; an arbitrary (Tq, Tk) mask cannot be linearized.

    Returns:
        out (..., Tq, E) in the input dtype, or ``(out, state)`` with ``return_state``.
    """
    check_attn_mask(attn_mask)
    check_bool(causal, "causal")
    check_bool(square, "square")
    check_bool(normalize, "normalize")
    check_bool(return_state, "return_state")
    check_qkv(phi_q, phi_k, v, causal=causal)
    chunk_size = check_chunk_size(chunk_size)
    check_choice(algorithm, "algorithm", ALGORITHMS)
    check_key_padding_mask(key_padding_mask, phi_k)
    offset, eps = check_offset_eps(denominator_offset, eps)

    dtype = phi_q.dtype
    acc = compute_dtype(dtype)  # states, prefix sums and normalizers
    tq, tk = phi_q.shape[-2], phi_k.shape[-2]
    backend = None
    if causal and tq > 0:
        with_state = initial_state is not None or return_state or tq < tk
        backend = resolve_algorithm(
            algorithm, phi_q, phi_k, v, square=square, with_state=with_state
        )
    od = operand_dtype(dtype, phi_q.device) if backend in ("chunked_blocks", "triton") else acc
    q, k, c = phi_q.to(od), phi_k.to(od), v.to(od)
    if key_padding_mask is not None:  # masked keys (and their possibly non-finite v) drop out
        keep = key_padding_mask.unsqueeze(-1)
        k = torch.where(keep, k, k.new_zeros(()))
        c = torch.where(keep, c, c.new_zeros(()))
    e = v.shape[-1]
    track_den = normalize or return_state
    num0, den0 = unpack_state(
        initial_state,
        leading=tuple(q.shape[:-2]),
        feature_dim=q.shape[-1],
        value_dim=e,
        square=square,
        with_denominator=track_den,
        dtype=acc,
        device=q.device,
    )
    if causal and tq < tk:  # keys before the first query are a prefix, visible to all queries
        pre = tk - tq
        kp, cp = k[..., :pre, :].to(acc), c[..., :pre, :].to(acc)
        n0 = square_state(kp, cp) if square else kp.transpose(-1, -2) @ cp
        num0 = n0 if num0 is None else num0 + n0
        if track_den:  # Σ φk (plain) or Σ φk⊗φk = φkᵀφk (square)
            z0 = key_sums(kp, square)
            den0 = z0 if den0 is None else den0 + z0
        k, c = k[..., pre:, :], c[..., pre:, :]

    if tq == 0:  # no query: an empty output (as SDPA); the keys only update the state
        out, den = q.new_zeros(*q.shape[:-1], e, dtype=acc), q.new_zeros(q.shape[:-1], dtype=acc)
        if not causal and tk > 0:
            _, num = noncausal_multiply(
                q.to(acc), k.to(acc), c.to(acc), square=square, initial=num0
            )
            num0 = num
            if track_den:
                z0 = key_sums(k.to(acc), square)
                den0 = z0 if den0 is None else den0 + z0
        num, z = _zero_state_if_none(num0, den0, q, e, square=square, dtype=acc)
    elif backend == "triton":
        out, den = triton_backend().triton_lt_multiply_with_sums(
            q, k, c, square=square, chunk_size=chunk_size
        )
        num = z = None
    elif backend == "chunked_blocks" or (
        backend == "chunked_scan" and _needs_grad(q, k, c, num0, den0)
    ):
        group = ACCELERATOR_GROUP_BYTES if backend == "chunked_blocks" else CPU_GROUP_BYTES
        out, den, num, z = _blocks(q, k, c, num0, den0, square, chunk_size, track_den, group)
    elif backend == "chunked_scan":
        kw = dict(chunk_size=chunk_size, square=square, final_state=return_state)
        if track_den:  # the normalizer as row sums beside the product (no ones column)
            out, den, num, z = chunked_lt_multiply_with_sums(
                q, k, c, initial=num0, initial_sums=den0, **kw
            )
        else:
            out, num = chunked_lt_multiply(q, k, c, initial=num0, **kw)
    else:  # the normalizer as the last column of the product with [V 1] (§4)
        init = num0
        if track_den:
            c = torch.cat([c, c.new_ones(c.shape[:-1] + (1,))], dim=-1)
            if num0 is not None:
                init = torch.cat([num0, den0.unsqueeze(-1)], dim=-1)
        if causal:
            out, num = cumsum_lt_multiply(q, k, c, square=square, initial=init)
        else:
            out, num = noncausal_multiply(q, k, c, square=square, initial=init)
        if track_den:
            out, den, num, z = out[..., :e], out[..., e], num[..., :e], num[..., e]

    if normalize:
        out = out / stabilize_denominator(den.unsqueeze(-1) + offset, eps)
    out = out.to(dtype)
    if not return_state:
        return out
    previous = 0 if initial_state is None else initial_state.length
    return out, LinearAttentionState(num, z, previous + tk)


def _needs_grad(*tensors) -> bool:
    """Whether autograd will record an op on any of ``tensors`` (None entries ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _zero_state_if_none(num, den, like, e, *, square, dtype):
    """(N, Z) as given, or zero states of the right shapes (no key has been consumed)."""
    if num is not None:
        return num, den
    lead, f = tuple(like.shape[:-2]), like.shape[-1]
    empty = LinearAttentionState.zeros(lead, f, e, square=square, dtype=dtype, device=like.device)
    return empty.numerator, empty.denominator


def _blocks(q, k, c, num0, den0, square, chunk_size, track_den, group_bytes):
    """``ops.blocks`` with the normalizer as a ones column; states in and out converted between
    the ``LinearAttentionState`` layout and the pair-feature space of the blocks."""
    f, e = q.shape[-1], c.shape[-1]
    pairs = _PairFeatures(f, q) if square else None
    if track_den:
        c = torch.cat([c, c.new_ones(c.shape[:-1] + (1,))], dim=-1)
    p0 = None
    if num0 is not None:
        n0 = pairs.compress(num0.flatten(-3, -2)) if square else num0
        p0 = n0
        if track_den:
            z0 = pairs.compress(den0.flatten(-2).unsqueeze(-1)) if square else den0.unsqueeze(-1)
            p0 = torch.cat([n0, z0], dim=-1)
    out, state = blocks_lt_multiply(
        q, k, c, square=square, chunk_size=chunk_size, initial=p0, group_bytes=group_bytes
    )
    den = out[..., e] if track_den else None
    num, z = (state[..., :e], state[..., e]) if track_den else (state, None)
    if square:
        num = pairs.expand(num)
        if num0 is not None:  # the pair space dropped the antisymmetric part of num0: restore
            num = num + (num0 - num0.transpose(-2, -3)).flatten(-3, -2) / 2
        num = num.unflatten(-2, (f, f))
        if z is not None:
            z = pairs.expand(z.unsqueeze(-1)).squeeze(-1).unflatten(-1, (f, f))
            if den0 is not None:
                z = z + (den0 - den0.transpose(-1, -2)) / 2
    return out[..., :e], den, num, z


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
        return _checkpoint(run, q, k, v, use_reentrant=False)
    return run(q, k, v)
