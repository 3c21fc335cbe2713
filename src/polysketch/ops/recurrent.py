"""Decoding: ``linear_attention_step`` consumes new tokens given the state of all earlier ones.

Causal linear attention is an RNN (PolySketchFormer §3, cumulative-sum view). For one new
token the step is one fused state update and read, in the layout of ``polysketch.ops.state``:

    N' = N + Ψ(φk)⊗v,   Z' = Z + Ψ(φk),   out = Ψq(φq)·N' / stab(offset + Ψq(φq)·Z')

(Ψ = Ψq = identity, or the pair features ψ and ω ⊙ ψ of ``polysketch.ops.pairs`` for squared
scores: F' = F(⌊F/2⌋+1) products per token, never φ⊗φ); the new token sees itself. Several
new tokens at once are one exact lt block of ``linear_attention`` (Theorem 3.1 with b = n)
from the state. On CUDA, with Triton switched on, ``polysketch.ops.dispatch.decode_backend``
picks the fused Triton kernel for the one-token step instead.
"""

from __future__ import annotations

import torch

from .._checks import as_dtype, compute_dtype
from ._validate import check_bool, check_key_padding_mask, check_offset_eps, check_qkv
from .dispatch import decode_backend
from .kernel import linear_attention
from .naive import DEFAULT_EPS, refuse_zero_normalizers, stabilize_denominator
from .pairs import PairFeatures
from .state import LinearAttentionState, unpack_state

__all__ = ["linear_attention_step", "linear_attention_token"]


def linear_attention_step(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    state: LinearAttentionState | None,
    *,
    square: bool = False,
    normalize: bool = True,
    denominator_offset: float = 0.0,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Consume n >= 1 new tokens given the state of all earlier ones; return (out, new state).

    out_i = Ψq(φq_i)·N_{t+i} / stab(offset + Ψq(φq_i)·Z_{t+i}) for the new tokens i = 1..n,
    causal among themselves, N and Z as in ``polysketch.ops.state``. Shapes: phi_q, phi_k
    (..., n, F), v (..., n, E), ``state`` a ``LinearAttentionState`` of leading dims ... or
    ``None`` (empty), ``key_padding_mask`` bool (..., n) (True = keep). Prefill with
    ``linear_attention(..., causal=True, return_state=True)`` then steps equals the full causal
    forward. The new state is in the compute dtype (fp32 for bf16/fp16); differentiable.
    """
    if not (isinstance(phi_q, torch.Tensor) and phi_q.dim() >= 2 and phi_q.shape[-2] == 1):
        chunk = phi_q.shape[-2] if isinstance(phi_q, torch.Tensor) and phi_q.dim() >= 2 else 1
        return linear_attention(
            phi_q, phi_k, v, causal=True, square=square, chunk_size=max(1, chunk),
            normalize=normalize, denominator_offset=denominator_offset, initial_state=state,
            return_state=True, key_padding_mask=key_padding_mask, eps=eps,
        )  # fmt: skip
    check_bool(square, "square")
    check_bool(normalize, "normalize")
    check_qkv(phi_q, phi_k, v, causal=True)
    check_key_padding_mask(key_padding_mask, phi_k)
    offset, eps = check_offset_eps(denominator_offset, eps)
    f, e = phi_q.shape[-1], v.shape[-1]
    acc = compute_dtype(phi_q.dtype)
    init = unpack_state(state, leading=tuple(phi_q.shape[:-2]), feature_dim=f, value_dim=e,
                        square=square, dtype=acc, device=phi_q.device)  # fmt: skip
    if state is None:
        state = LinearAttentionState.zeros(tuple(phi_q.shape[:-2]), f, e, square=square,
                                           dtype=acc, device=phi_q.device)  # fmt: skip
    else:  # in the compute dtype (a bf16 state is updated in fp32, as the chunked op does)
        state = LinearAttentionState(*init, state.length)
    return linear_attention_token(
        phi_q, phi_k, v, state, square=square, normalize=normalize, denominator_offset=offset,
        key_padding_mask=key_padding_mask, eps=eps,
    )  # fmt: skip


def linear_attention_token(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    state: LinearAttentionState,
    *,
    square: bool,
    normalize: bool = True,
    denominator_offset: float = 0.0,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """``linear_attention_step`` for exactly one new token, without its argument checks.

    The step of the module docstring for phi_q, phi_k (..., 1, F), v (..., 1, E), a
    ``LinearAttentionState`` of leading dims ... (pair layout when ``square``; fp32 states
    for half inputs), ``key_padding_mask`` bool (..., 1) or None, and plain floats for the
    offset and eps. For callers that built every argument themselves and decode token by
    token (``polysketch.nn.core``): the checks of the public op cost about as much as the
    step's arithmetic on a CPU. ``linear_attention_step``
    validates its arguments and then calls this, so both compute the same thing.
    """
    acc = state.numerator.dtype
    init = (state.numerator, state.denominator)
    fused = decode_backend(phi_q, phi_k, v, *init, square=square, key_padding_mask=key_padding_mask)
    if fused is not None:
        num, den, n1, z1 = fused.triton_decode_step(phi_q, phi_k, v, *init, square=square)
        den = den.unsqueeze(-1)
    else:
        q, k, v1 = (as_dtype(x, acc) for x in (phi_q, phi_k, v))
        num, den, n1, z1 = _step(q, k, v1, *init, square=square, keep=key_padding_mask)
    out = num
    if normalize:
        if not denominator_offset:  # the new key itself, or the earlier ones, are seen
            sees = None if key_padding_mask is None or state.length > 0 else key_padding_mask
            refuse_zero_normalizers(den[..., 0], sees)
        out = num / stabilize_denominator(den + denominator_offset if denominator_offset else den,
                                          eps)  # fmt: skip
    return as_dtype(out, phi_q.dtype), LinearAttentionState(n1, z1, state.length + 1)


def _step(q, k, v, n, z, *, square, keep):
    """num (..., 1, E), den (..., 1, 1), N', Z' of the module docstring for one token."""
    if square:
        pairs = PairFeatures.cached(q.shape[-1], q)
        psi = pairs.features(torch.cat([q, k], dim=-2))  # ψ(q), ψ(k): (..., 2, F')
        qf, kf = psi[..., :1, :] * pairs.omega, psi[..., 1:, :]  # (..., 1, F')
    else:
        qf, kf = q, k
    if keep is not None:  # a padded key adds nothing (and its possibly non-finite v neither)
        m = keep.unsqueeze(-1)
        kf, v = torch.where(m, kf, kf.new_zeros(())), torch.where(m, v, v.new_zeros(()))
    n1 = torch.addcmul(n, kf.mT, v)  # N + Ψ(k)ᵀ v: (..., F', E)
    z1 = z + kf.squeeze(-2)
    return qf @ n1, qf @ z1.unsqueeze(-1), n1, z1
