"""Rotary position embeddings (RoPE, Su et al. 2021), as PolySketchFormer §5 uses per head.

For a head vector x ∈ R^D at position t, pairs (x_i, x_{i+D'/2}) (rotate-half layout,
D' = 2⌊D/2⌋) are rotated by the angle t·θ_i, θ_i = base^{-2i/D'}:

    RoPE(x, t)_i        = x_i cos tθ_i − x_{i+D'/2} sin tθ_i
    RoPE(x, t)_{i+D'/2} = x_{i+D'/2} cos tθ_i + x_i sin tθ_i ,   i < D'/2,

and the last coordinate of an odd D is left unchanged. Then RoPE(q, s)·RoPE(k, t) depends on
s − t only. Positions are token indices; while decoding, ``offset`` is the number of tokens
already consumed, so positions continue where the prefix stopped. ``positions=`` gives each
row its own (B, T) positions instead (padded batches: real tokens counted only, as
transformers' position ids; ``polysketch.nn.padding``).
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_float, check_int, check_positive_int, check_tensor

__all__ = ["RotaryEmbedding", "apply_rotary"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (..., T, D) with cos, sin (T, D'/2) (see module docstring)."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    return torch.cat(rotated + ([rest] if rest.shape[-1] else []), dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE for head dim D: ``forward(x, offset)`` with x (..., T, D) -> (..., T, D).

    Args:
        head_dim: D (odd D leaves the last coordinate unrotated).
        base: θ_i = base^{-2i/D'} (default 10000).

    The angles t·θ_i are formed in fp64 for positions offset..offset+T−1 at each call (no
    length limit, no table, nothing that ``.to(dtype)`` of the model could degrade); cos/sin
    are taken in fp32 (fp64 for fp64 inputs) and cast to x's dtype.
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0):
        super().__init__()
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.base = check_float(base, "base", minimum=1.0, strict_minimum=True)
        self._inv_freq: dict = {}  # θ_i per device, in fp64 (fp32 on MPS); not model state

    def inv_freq(self, device) -> torch.Tensor:
        """θ_i = base^{-2i/D'} (D'/2,) in fp64 (fp32 on MPS, which has no fp64), made once per
        device (decoding calls RoPE at every token)."""
        device = torch.device(device)
        half = self.head_dim // 2
        exact = torch.float32 if device.type == "mps" else torch.float64

        def make():
            steps = torch.arange(half, device=device, dtype=exact) * (2.0 / max(2 * half, 1))
            return self.base**-steps

        if torch.compiler.is_compiling():  # traced once into the graph: nothing to keep
            return make()
        found = self._inv_freq.get(device)
        if found is None:
            with torch.inference_mode(False):  # a plain tensor, usable in every mode
                found = self._inv_freq[device] = make()
        return found

    def angles(self, length: int, offset: int, *, dtype: torch.dtype, device) -> tuple:
        """cos, sin of t·θ_i for t = offset..offset+length−1: two (length, D'/2) tensors."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        inv_freq = self.inv_freq(device)
        pos = torch.arange(offset, offset + length, device=inv_freq.device, dtype=inv_freq.dtype)
        ang = (pos[:, None] * inv_freq).to(work)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def angles_at(self, positions: torch.Tensor, *, dtype: torch.dtype) -> tuple:
        """cos, sin of t·θ_i for the integer ``positions`` (..., T): two (..., T, D'/2) tensors."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        inv_freq = self.inv_freq(positions.device)
        ang = (positions.to(inv_freq.dtype).unsqueeze(-1) * inv_freq).to(work)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def forward(
        self, x: torch.Tensor, offset: int = 0, *, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x (..., T, D) rotated at positions offset..offset+T−1, or at ``positions``: an
        integer (B, T) tensor for x of shape (B, H, T, D) (one position per row and token)."""
        return self.rotate(x, offset=offset, positions=positions)[0]

    def rotate(
        self, *xs: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Several tensors of one shape (e.g. q and k) rotated at the same positions, the
        angles computed once (``forward``'s arguments)."""
        xs = tuple(check_tensor(x, "x", min_dim=2, last_dim=self.head_dim) for x in xs)
        x = xs[0]
        if any(y.shape != x.shape or y.dtype != x.dtype for y in xs):
            raise ValueError("rotate: every tensor must have the shape and dtype of the first")
        offset = check_int(offset, "offset", minimum=0)
        if self.head_dim < 2:
            return xs
        if positions is not None:
            if (
                not isinstance(positions, torch.Tensor)
                or positions.dtype not in (torch.int64, torch.int32)
                or x.dim() != 4
                or tuple(positions.shape) != (x.shape[0], x.shape[-2])
            ):
                raise ValueError(
                    f"positions must be an integer (B, T) = {(x.shape[0], x.shape[-2])} tensor "
                    f"for x of shape (B, H, T, D), got {getattr(positions, 'shape', positions)}"
                )
            cos, sin = self.angles_at(positions, dtype=x.dtype)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        else:
            cos, sin = self.angles(x.shape[-2], offset, dtype=x.dtype, device=x.device)
        if len(xs) == 1:
            return (apply_rotary(x, cos, sin),)
        return apply_rotary(torch.stack(xs), cos, sin).unbind(0)  # one pass for all

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}"
