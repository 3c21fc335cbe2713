"""The constant-size decoding state of linear attention and its one layout.

For features φq, φk and values V, causal linear attention is an RNN (PolySketchFormer §3,
cumulative-sum view): after keys 1..t the state is

    N_t = Σ_{j<=t} Ψ(φk_j)⊗v_j   (..., F', E),        Z_t = Σ_{j<=t} Ψ(φk_j)   (..., F'),

and a query reads out = Ψq(φq)·N / stab(offset + Ψq(φq)·Z). Plain scores: Ψ = Ψq = identity,
F' = F. Squared scores (φq·φk)²: Ψ = ψ, the symmetric pair features of ``polysketch.ops.pairs``
(ψ(x)_(a,d) = x_a x_((a+d) mod F), a < F, d <= ⌊F/2⌋), Ψq = ω ⊙ ψ, and

    F' = F(⌊F/2⌋ + 1)     (F = 32: 544 per value column, instead of F² = 1024).

Entry (a, d) of a square state is the symmetric part of the dense Σ φk⊗φk⊗v at (a, a+d mod F)
(``polysketch.ops.pairs.compress``). The layout is the one every backend computes in (the
pair features are how the kernels form squared scores), so no backend converts states; it
about halves decode memory against the dense F×F layout of earlier releases
(``dense_to_pair_state`` converts old states). The triangular layout F(F+1)/2 would be
slightly smaller, but its features are a gather, which costs more than ψ's strided view
(measured: ``docs/results/implementation_choices.md``). The state size is independent of t:
this replaces a KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import as_dtype
from .pairs import compress, expand, state_dim

__all__ = ["LinearAttentionState", "unpack_state", "dense_to_pair_state", "pair_to_dense_state"]


@dataclass
class LinearAttentionState:
    """Decoding state: ``numerator`` N, ``denominator`` Z and ``length`` (tokens consumed).

    Shapes (leading dims ... as the features'): N (..., F', E), Z (..., F') with F' = F for
    plain scores and F' = F(⌊F/2⌋+1) for ``square=True`` (the pair layout of the module
    docstring; ``FeatureMap.state_dim`` is F'). The ops return states in the compute dtype
    (fp32 for bf16/fp16 inputs, else the input dtype). ``length`` counts time steps consumed,
    padded ones included (key padding removes their content, not the count).
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
        fs = state_dim(feature_dim, square)
        kw = {"dtype": dtype, "device": device}
        return cls(torch.zeros(*leading, fs, value_dim, **kw), torch.zeros(*leading, fs, **kw), 0)

    def detach(self) -> LinearAttentionState:
        """The same state cut from the autograd graph (e.g. between decoding steps)."""
        return LinearAttentionState(self.numerator.detach(), self.denominator.detach(), self.length)

    def to(self, *args, **kwargs) -> LinearAttentionState:
        """``Tensor.to`` applied to both tensors."""
        return LinearAttentionState(
            self.numerator.to(*args, **kwargs), self.denominator.to(*args, **kwargs), self.length
        )


def dense_to_pair_state(state: LinearAttentionState) -> LinearAttentionState:
    """A square state of the dense layout (N (..., F, F, E), Z (..., F, F), releases before
    the pair layout) in the pair layout (N (..., F', E), Z (..., F')); exact for what a query
    reads (the symmetric part)."""
    if not isinstance(state, LinearAttentionState):
        raise TypeError(f"state must be a LinearAttentionState, got {type(state).__name__}")
    num, den = compress(state.numerator), compress(state.denominator, values=False)
    return LinearAttentionState(num, den, state.length)


def pair_to_dense_state(state: LinearAttentionState, feature_dim: int) -> LinearAttentionState:
    """A square state of the pair layout as the symmetric dense N (..., F, F, E), Z (..., F, F)."""
    if not isinstance(state, LinearAttentionState):
        raise TypeError(f"state must be a LinearAttentionState, got {type(state).__name__}")
    num = expand(state.numerator, feature_dim)
    den = expand(state.denominator, feature_dim, values=False)
    return LinearAttentionState(num, den, state.length)


def unpack_state(
    state,
    *,
    leading: tuple[int, ...],
    feature_dim: int,
    value_dim: int,
    square: bool,
    dtype: torch.dtype,
    device: torch.device,
    with_denominator: bool = True,
    name: str = "initial_state",
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Validate ``state`` and return (N, Z) in ``dtype`` (no copy when the dtype matches).

    N (..., F', E), Z (..., F') (module docstring), or Z = ``None`` without
    ``with_denominator``; ``None`` gives (None, None). A square state in the dense layout of
    earlier releases is refused with the converter's name.
    """
    if state is None:
        return None, None
    if not isinstance(state, LinearAttentionState):
        raise TypeError(
            f"{name} must be a LinearAttentionState or None, got {type(state).__name__}"
        )
    fs = state_dim(feature_dim, square)
    want_n, want_z = (*leading, fs, value_dim), (*leading, fs)
    for t, want, part in (
        (state.numerator, want_n, "numerator"),
        (state.denominator, want_z, "denominator"),
    ):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}.{part} must be a floating-point torch.Tensor")
        if tuple(t.shape) != want:
            hint = ""
            dense = t.dim() >= 2 and t.shape[-1 if part == "denominator" else -2] == feature_dim
            if square and dense:
                hint = (
                    "; this looks like the dense F x F layout of earlier releases: convert it "
                    "with polysketch.ops.dense_to_pair_state"
                )
            raise ValueError(
                f"{name}.{part} must have shape {want} (square={square}, F'={fs}), got "
                f"{tuple(t.shape)}{hint}"
            )
        if t.device != device:
            raise ValueError(f"{name}.{part} must be on device {device}, got {t.device}")
    den = as_dtype(state.denominator, dtype) if with_denominator else None
    return as_dtype(state.numerator, dtype), den
