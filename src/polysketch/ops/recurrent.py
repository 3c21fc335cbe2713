"""Constant-size decoding state of linear attention and the one-step update.

For features φq, φk and values V, causal linear attention is an RNN (PolySketchFormer §3,
cumulative-sum view): after keys 1..t the state is

    plain:   N_t = Σ_{j<=t} φk_j⊗v_j        (..., F, E),    Z_t = Σ_{j<=t} φk_j       (..., F)
    square:  N_t = Σ_{j<=t} φk_j⊗φk_j⊗v_j   (..., F, F, E), Z_t = Σ_{j<=t} φk_j⊗φk_j  (..., F, F)

and a new query reads out_t = φq_t N_t / stab(offset + φq_t Z_t) (square: Σ_ab φq_a φq_b N_abe
over Σ_ab φq_a φq_b Z_ab). The state size is independent of t: this replaces a KV cache.
``linear_attention(..., return_state=True)`` returns it after a prefill;
``linear_attention_step`` consumes one or a few tokens and returns the updated state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .naive import DEFAULT_EPS

__all__ = ["LinearAttentionState", "linear_attention_step", "unpack_state"]


@dataclass
class LinearAttentionState:
    """Decoding state: ``numerator`` N, ``denominator`` Z and ``length`` (tokens consumed).

    Shapes (leading dims ... as the features'): N (..., F, E), Z (..., F) for plain scores;
    N (..., F, F, E), Z (..., F, F) with ``square=True``. The ops return states in the compute
    dtype (fp32 for bf16/fp16 inputs, else the input dtype). ``length`` counts time steps
    consumed, padded ones included (key padding removes their content, not the count).
    """

    numerator: torch.Tensor
    denominator: torch.Tensor
    length: int = 0

    @classmethod
    def zeros(
        cls,
        leading: tuple[int, ...],
        feature_dim: int,
        value_dim: int,
        *,
        square: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> LinearAttentionState:
        """The empty state (no token consumed) for features of size F and values of size E."""
        f = (feature_dim, feature_dim) if square else (feature_dim,)
        kw = {"dtype": dtype, "device": device}
        return cls(torch.zeros(*leading, *f, value_dim, **kw), torch.zeros(*leading, *f, **kw), 0)

    def detach(self) -> LinearAttentionState:
        """The same state cut from the autograd graph (e.g. between decoding steps)."""
        return LinearAttentionState(self.numerator.detach(), self.denominator.detach(), self.length)

    def to(self, *args, **kwargs) -> LinearAttentionState:
        """``Tensor.to`` applied to both tensors."""
        return LinearAttentionState(
            self.numerator.to(*args, **kwargs), self.denominator.to(*args, **kwargs), self.length
        )


def unpack_state(
    state,
    *,
    leading: tuple[int, ...],
    feature_dim: int,
    value_dim: int,
    square: bool,
    with_denominator: bool,
    dtype: torch.dtype,
    device: torch.device,
    name: str = "initial_state",
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Validate ``state`` and return (N, Z) in ``dtype`` (no copy when the dtype matches).

    N (..., F[, F], E), Z (..., F[, F]), or Z = ``None`` without ``with_denominator``;
    ``None`` gives (None, None).
    """
    if state is None:
        return None, None
    if not isinstance(state, LinearAttentionState):
        raise TypeError(
            f"{name} must be a LinearAttentionState or None, got {type(state).__name__}"
        )
    f = (feature_dim, feature_dim) if square else (feature_dim,)
    want_n, want_z = (*leading, *f, value_dim), (*leading, *f)
    for t, want, part in (
        (state.numerator, want_n, "numerator"),
        (state.denominator, want_z, "denominator"),
    ):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}.{part} must be a floating-point torch.Tensor")
        if tuple(t.shape) != want:
            raise ValueError(
                f"{name}.{part} must have shape {want} (square={square}), got {tuple(t.shape)}"
            )
        if t.device != device:
            raise ValueError(f"{name}.{part} must be on device {device}, got {t.device}")
    num = state.numerator.to(dtype)
    return num, state.denominator.to(dtype) if with_denominator else None


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

    out_i = (φq_i N_{t+i} ) / stab(offset + φq_i Z_{t+i}) for the new tokens i = 1..n, causal
    among themselves (one exact lt block, Theorem 3.1 with b = n), N and Z as in the module
    docstring. Shapes: phi_q, phi_k (..., n, F), v (..., n, E), ``state`` a
    ``LinearAttentionState`` of leading dims ... or ``None`` (empty). Prefill with
    ``linear_attention(..., causal=True, return_state=True)`` then steps equals the full causal
    forward. The new state is in the compute dtype (fp32 for bf16/fp16).
    """
    from .kernel import linear_attention  # kernel.py imports this module for the state class

    fused = _fused_step(phi_q, phi_k, v, state, square, normalize, denominator_offset,
                        key_padding_mask, eps)  # fmt: skip
    if fused is not None:
        return fused
    chunk = phi_q.shape[-2] if isinstance(phi_q, torch.Tensor) and phi_q.dim() >= 2 else 1
    return linear_attention(
        phi_q,
        phi_k,
        v,
        causal=True,
        square=square,
        chunk_size=max(1, chunk),
        normalize=normalize,
        denominator_offset=denominator_offset,
        initial_state=state,
        return_state=True,
        key_padding_mask=key_padding_mask,
        eps=eps,
    )


def _fused_step(phi_q, phi_k, v, state, square, normalize, offset, key_padding_mask, eps):
    """The fused Triton step (``polysketch.ops.triton``) for one token on CUDA, or ``None``.

    Taken only where it computes exactly what ``linear_attention`` would: one new token,
    fp32/bf16/fp16 inputs with fp32 states, no key padding, no gradient, a supported shape.
    """
    from .._checks import check_float
    from ._validate import check_bool, check_qkv
    from .dispatch import triton_backend
    from .naive import stabilize_denominator

    if not (
        isinstance(phi_q, torch.Tensor) and phi_q.is_cuda and phi_q.dim() >= 2
        and phi_q.shape[-2] == 1 and isinstance(state, LinearAttentionState)
        and key_padding_mask is None and phi_q.dtype != torch.float64
        and state.numerator.dtype == torch.float32 and state.denominator.dtype == torch.float32
        and not (torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in (phi_q, phi_k, v, state.numerator, state.denominator)))
        and isinstance(square, bool) and isinstance(normalize, bool)
    ):  # fmt: skip
        return None
    backend = triton_backend()
    if backend is None:
        return None
    if backend.decode_unsupported_reason(
        phi_q, phi_k, v, state.numerator, state.denominator, square=square
    ):
        return None
    check_qkv(phi_q, phi_k, v, causal=True)
    offset, eps = check_float(offset, "denominator_offset"), check_float(eps, "eps", minimum=0.0)
    check_bool(normalize, "normalize")
    num0, den0 = unpack_state(
        state, leading=tuple(phi_q.shape[:-2]), feature_dim=phi_q.shape[-1],
        value_dim=v.shape[-1], square=square, with_denominator=True, dtype=torch.float32,
        device=phi_q.device,
    )  # fmt: skip
    num, den, n1, z1 = backend.triton_decode_step(phi_q, phi_k, v, num0, den0, square=square)
    out = num / stabilize_denominator(den.unsqueeze(-1) + offset, eps) if normalize else num
    return out.to(phi_q.dtype), LinearAttentionState(n1, z1, state.length + 1)
