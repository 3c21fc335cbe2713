"""Decode caches of ``KernelAttention``: what a layer keeps per sequence between steps.

* ``RecurrentCache`` (feature-map attention): the constant-size state of causal linear
  attention, N = Σ_j Ψ(φk_j) ⊗ v_j and Z = Σ_j Ψ(φk_j) (the pair features of ``ops.pairs``
  with ``square``), a ``polysketch.ops.LinearAttentionState`` (PolySketchFormer §3: linear
  attention is an RNN). H·F'·(E + 1) floats per sequence, F' = F or F(⌊F/2⌋+1), whatever
  the length.
* ``KVCache`` (``softmax`` and exact ``polynomial``): every key and value so far, 2·H·D·t
  floats at position t — the quadratic-attention baseline.
* ``MixedCache`` (``psf_mixed``): the state of the completed blocks plus the keys, key
  features and values of the current, incomplete block (< b tokens): bounded by
  H·(F'(E + 1) + b(D + F + E)) floats.

Every cache counts ``length``, the tokens consumed, which is also the RoPE position of the
next token, and holds ``conv_tail``: the last K - 1 projections of a layer with a short
convolution (``KernelAttention(short_conv=K)``, ``polysketch.nn.short_conv``), else None.
A cache is filled by ``KernelAttention.forward(x, cache=cache)`` (in place) and made by
``KernelAttention.new_cache()``; ``TransformerLM.generate`` keeps one per layer.
"""

from __future__ import annotations

import torch

from ..ops import LinearAttentionState
from ..ops.mixed_step import MixedAttentionState, mixed_attention_state, mixed_attention_step

__all__ = ["RecurrentCache", "KVCache", "MixedCache", "LayerCache"]


class RecurrentCache:
    """Linear-attention decode state: ``state`` (a ``LinearAttentionState`` or None), ``length``."""

    def __init__(self) -> None:
        self.state: LinearAttentionState | None = None
        self.length = 0
        self.conv_tail: torch.Tensor | None = None  # short convolution: (B, K-1, C)

    def num_floats(self) -> int:
        """Floats held per batch (all sequences of the batch together)."""
        tail = _numel(self.conv_tail)
        if self.state is None:
            return tail
        return self.state.numerator.numel() + self.state.denominator.numel() + tail


class KVCache:
    """Keys (B, H, t, D) and values (B, H, t, E) of every token so far, with ``keep`` (B, t)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None
        self.length = 0
        self.conv_tail: torch.Tensor | None = None  # short convolution: (B, K-1, C)

    def append(
        self, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Append n tokens (k (B, H, n, D), v (B, H, n, E), keep (B, n) or None); return all."""
        n = k.shape[-2]
        if keep is not None or self.keep is not None:
            old = self.keep
            if old is None and self.length:
                old = torch.ones(k.shape[0], self.length, dtype=torch.bool, device=k.device)
            new = keep if keep is not None else torch.ones_like(k[:, 0, :, 0], dtype=torch.bool)
            self.keep = new if old is None else torch.cat([old, new], dim=-1)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=-2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=-2)
        self.length += n
        return self.k, self.v, self.keep

    def num_floats(self) -> int:
        kv = 0 if self.k is None else self.k.numel() + self.v.numel()
        return kv + _numel(self.conv_tail)


class MixedCache:
    """Mixed local/global decode state: the ``polysketch.ops.MixedAttentionState`` of
    ``ops.mixed_step`` kept as plain attributes (``state`` = its ``summary`` [N Z] of the
    completed blocks (B, H, F', E+1), ``k`` (B, H, n, D), ``phi_k`` (B, H, n, F), ``v``
    (B, H, n, E) of the current block, ``length``), so batch maps reach every tensor."""

    def __init__(self, chunk_size: int, square: bool) -> None:
        self.chunk_size = chunk_size
        self.square = square
        self.state: torch.Tensor | None = None
        self.k: torch.Tensor | None = None
        self.phi_k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0
        self.conv_tail: torch.Tensor | None = None  # short convolution: (B, K-1, C)

    def num_floats(self) -> int:
        tensors = (self.state, self.k, self.phi_k, self.v, self.conv_tail)
        return sum(_numel(t) for t in tensors)

    def _load(self, st: MixedAttentionState) -> None:
        self.state, self.k, self.phi_k, self.v, self.length = (
            st.summary,
            st.k,
            st.phi_k,
            st.v,
            st.length,
        )

    def prefill(self, k: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a prefix of T tokens (empty cache): fold the complete blocks, keep the rest."""
        self._load(mixed_attention_state(k, phi_k, v, chunk_size=self.chunk_size,
                                         square=self.square))  # fmt: skip

    def steps(self, q, k, v, phi_q, phi_k, *, degree: int, offset: float, eps: float):
        """n new tokens after a prefill: (B, H, n, ·) inputs -> (B, H, n, E), by
        ``polysketch.ops.mixed_attention_step`` (exact local polynomial of ``degree``)."""
        st = MixedAttentionState(self.state, self.k, self.phi_k, self.v, self.length)
        out, st = mixed_attention_step(
            q, k, v, phi_q, phi_k, st, chunk_size=self.chunk_size, local="polynomial",
            degree=degree, square=self.square, denominator_offset=offset, eps=eps,
        )  # fmt: skip
        self._load(st)
        return out


def _numel(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel()


LayerCache = RecurrentCache | KVCache | MixedCache
