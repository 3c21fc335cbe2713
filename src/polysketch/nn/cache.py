"""Decode caches of ``KernelAttention``: what a layer keeps per sequence between steps.

* ``RecurrentCache`` (feature-map attention): the constant-size state of causal linear
  attention, N = Σ_j φk_j ⊗ v_j and Z = Σ_j φk_j (F² instead of F with ``square``), a
  ``polysketch.ops.LinearAttentionState`` (PolySketchFormer §3: linear attention is an RNN).
  H·F'·(E + 1) floats per sequence, F' = F or F², whatever the length.
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

from ..ops import LinearAttentionState, square_state
from ..ops.chunked import apply_state
from ..ops.naive import stabilize_denominator

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
    """Mixed local/global decode state (see the module docstring and ``step``)."""

    def __init__(self, chunk_size: int, square: bool) -> None:
        self.chunk_size = chunk_size
        self.square = square
        self.state: torch.Tensor | None = None  # [N Z] of completed blocks, (B, H, F[, F], E+1)
        self.k: torch.Tensor | None = None  # current block: (B, H, n, D)
        self.phi_k: torch.Tensor | None = None  # (B, H, n, F)
        self.v: torch.Tensor | None = None  # (B, H, n, E)
        self.length = 0
        self.conv_tail: torch.Tensor | None = None  # short convolution: (B, K-1, C)

    def num_floats(self) -> int:
        tensors = (self.state, self.k, self.phi_k, self.v, self.conv_tail)
        return sum(_numel(t) for t in tensors)

    def _fold(self, phi_k: torch.Tensor, v: torch.Tensor) -> None:
        """Add Σ_j φk_j(⊗φk_j) ⊗ [v_j 1] of a completed stretch of blocks to the state."""
        vt = torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)
        s = square_state(phi_k, vt) if self.square else phi_k.transpose(-1, -2) @ vt
        self.state = s if self.state is None else self.state + s

    def prefill(self, k: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a prefix of T tokens (empty cache): fold the complete blocks, keep the rest."""
        t = k.shape[-2]
        full = (t // self.chunk_size) * self.chunk_size
        if full:
            self._fold(phi_k[..., :full, :], v[..., :full, :])
        rest = slice(full, t)
        self.k, self.phi_k, self.v = k[..., rest, :], phi_k[..., rest, :], v[..., rest, :]
        self.length = t

    def steps(self, q, k, v, phi_q, phi_k, *, degree: int, offset: float, eps: float):
        """``step`` for each of n new tokens in order: (B, H, n, ·) inputs -> (B, H, n, E).

        Decoding feeds one or a few tokens per call, so a loop over them is not a hot path.
        """
        outs = [
            self.step(
                q[..., i : i + 1, :],
                k[..., i : i + 1, :],
                v[..., i : i + 1, :],
                phi_q[..., i : i + 1, :],
                phi_k[..., i : i + 1, :],
                degree=degree,
                offset=offset,
                eps=eps,
            )  # fmt: skip
            for i in range(q.shape[-2])
        ]
        return torch.cat(outs, dim=-2)

    def step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        phi_q: torch.Tensor,
        phi_k: torch.Tensor,
        *,
        degree: int,
        offset: float,
        eps: float,
    ) -> torch.Tensor:
        """One new token (q, k (B, H, 1, D), v (B, H, 1, E), φq, φk (B, H, 1, F)) -> (B, H, 1, E).

        out = (Σ_{j in block, j<=t} (q·k_j)^p v_j + φq N) / stab(offset + Σ (q·k_j)^p + φq Z),
        N, Z over the completed blocks (``polysketch.ops.mixed``, one row of it); when the
        token completes its block, the block's features are folded into N, Z.
        """
        self.k = k if self.k is None else torch.cat([self.k, k], dim=-2)
        self.phi_k = phi_k if self.phi_k is None else torch.cat([self.phi_k, phi_k], dim=-2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=-2)
        kappa = (q @ self.k.transpose(-1, -2)).pow(degree)  # (B, H, 1, n)
        vt = torch.cat([self.v, self.v.new_ones(self.v.shape[:-1] + (1,))], dim=-1)
        num = kappa @ vt  # (B, H, 1, E+1)
        if self.state is not None:
            num = num + apply_state(phi_q, self.state, square=self.square)
        out = num[..., :-1] / stabilize_denominator(num[..., -1:] + offset, eps)
        self.length += 1
        if self.k.shape[-2] == self.chunk_size:
            self._fold(self.phi_k, self.v)
            self.k = self.phi_k = self.v = None
        return out


def _numel(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel()


LayerCache = RecurrentCache | KVCache | MixedCache
