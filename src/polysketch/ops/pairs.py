"""Symmetric pair features ψ: the layout of every squared-score state (PolySketchFormer §2.2).

For squared scores s = (x·y)² = (x⊗x)·(y⊗y), the self-tensored features x⊗x (F² entries) are
symmetric, so half of them suffice. Grouping Σ_ab x_a x_b y_a y_b by the cyclic offset
d = b - a mod F (offsets d and F - d give the same sum):

    (x·y)² = Σ_(a,d) ω_d ψ(x)_(a,d) ψ(y)_(a,d),   ψ(x)_(a,d) = x_a x_((a+d) mod F),

a = 0..F-1, d = 0..⌊F/2⌋, ω_d = 2 for 0 < d < F/2, else 1 (d = 0, and d = F/2 for even F),
exactly (ω is a power of two). F' = F(⌊F/2⌋+1) products: F²/2 + F for even F, about half of
F² (F = 32: 544 instead of 1024). ψ is built from a strided view (no gather) and laid out
(a, d), so its product with a state is contiguous.

A dense state S (..., F, F, ·) (e.g. Σ_t x_t⊗x_t⊗v_t) is read only through its symmetric part:
Σ_fg A_f A_g S_fg· = Σ_(a,d) ω_d ψ(A)_(a,d) Ŝ_(a,d)· with Ŝ_(a,d) = (S_(a,a+d) + S_(a+d,a))/2
(``compress``); for a symmetric S, ``expand`` maps Ŝ back exactly. ``LinearAttentionState``
stores Ŝ for squared maps (``polysketch.ops.state``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as nnf

from ._constants import constant

__all__ = ["PairFeatures", "pair_dim", "state_dim", "compress", "expand", "key_state"]


def pair_dim(f: int) -> int:
    """F' = F(⌊F/2⌋+1), the number of pair features ψ of F features."""
    return f * (f // 2 + 1)


def state_dim(f: int, square: bool) -> int:
    """Features per value column of the state: F' = F(⌊F/2⌋+1) when ``square``, else F."""
    return pair_dim(f) if square else f


_CACHED: dict = {}  # (F, dtype, device) -> PairFeatures, for ``PairFeatures.cached``


def _omega(f: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(F',): ω_d at (a, d), 2 for 0 < d < F/2, else 1."""
    d = torch.arange(f // 2 + 1, device=device)
    two = torch.full(d.shape, 2.0, dtype=dtype, device=device)
    return torch.where((d == 0) | (2 * d == f), 1.0, two).repeat(f)


class PairFeatures:
    """ψ (keys) and ω ⊙ ψ (queries) for F features; see the module docstring.

    ``like`` gives the device of the index tensors and the dtype of ω (built once per F,
    dtype and device: ``ops._constants``).
    """

    def __init__(self, f: int, like: torch.Tensor):
        self.f, self.half = f, f // 2
        self.device = like.device
        self.omega = constant(("pair_omega", f, like.dtype, like.device),
                              lambda: _omega(f, like.dtype, like.device))  # fmt: skip

    def _indices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat F² indices of (a, a+d) and (a+d, a) per pair, and the pair of each (f, g)."""
        f, width, kw = self.f, self.half + 1, {"device": self.device}
        a = torch.arange(f, **kw).repeat_interleave(width)
        g = (a + torch.arange(width, **kw).repeat(f)) % f
        rows = torch.arange(f, **kw).repeat_interleave(f)
        cols = torch.arange(f, **kw).repeat(f)
        fwd, back = (cols - rows) % f, (rows - cols) % f
        inverse = torch.where(fwd <= self.half, rows * width + fwd, cols * width + back)
        return a * f + g, g * f + a, inverse

    @classmethod
    def cached(cls, f: int, like: torch.Tensor) -> PairFeatures:
        """The ``PairFeatures(f, like)`` kept for (F, dtype, device): decoding makes none per
        token (under ``torch.compile`` tracing a new one, as ``ops._constants``)."""
        if torch.compiler.is_compiling():
            return cls(f, like)
        key = (f, like.dtype, like.device)
        pairs = _CACHED.get(key)
        if pairs is None:
            pairs = _CACHED.setdefault(key, cls(f, like))
        return pairs

    @property
    def dim(self) -> int:
        """F' = F(⌊F/2⌋+1)."""
        return self.omega.numel()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """ψ(x): (..., T, F) -> (..., T, F')."""
        ext = torch.cat([x, x[..., : self.half]], dim=-1)  # x_(a+d mod F) = ext_(a+d)
        windows = ext.unfold(-1, self.half + 1, 1)  # (..., T, F, ⌊F/2⌋+1), a view
        return (x.unsqueeze(-1) * windows).flatten(-2)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """ω ⊙ ψ(x): (..., T, F) -> (..., T, F'), so (x·y)² = queries(x)·features(y)."""
        return self.features(x) * self.omega.to(x.dtype)

    def backward(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The vector-Jacobian product of ``features`` at x: grad (..., T, F') -> (..., T, F).

        ψ_(a,d) = x_a ext_(a+d) with ext = [x, x_(0..⌊F/2⌋-1)], so dx_a gets Σ_d g_(a,d)
        ext_(a+d) (the same windows as ``features``) and d ext_i = Σ_(a+d=i) g_(a,d) x_a (the
        transpose of the window view: ``unfold_backward``), whose tail folds back onto
        x_(0..⌊F/2⌋-1). No autograd inside a backward, no gather: ``torch.compile`` traces it.
        """
        width = self.half + 1
        g = grad.unflatten(-1, (self.f, width))  # (..., T, F, W)
        ext = torch.cat([x, x[..., : self.half]], dim=-1)
        first = (g * ext.unfold(-1, width, 1)).sum(-1)
        dext = torch.ops.aten.unfold_backward(
            g * x.unsqueeze(-1), list(ext.shape), ext.dim() - 1, width, 1
        )
        second = dext[..., : self.f] + nnf.pad(dext[..., self.f :], (0, self.f - self.half))
        return first + second

    def compress(self, s: torch.Tensor) -> torch.Tensor:
        """Ŝ from a flattened dense state (..., F², ·) -> (..., F', ·)."""
        flat, flat_t, _ = self._indices()
        return (s[..., flat, :] + s[..., flat_t, :]) / 2

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """The symmetric flattened dense state (..., F², ·) whose Ŝ is s (..., F', ·)."""
        return s[..., self._indices()[2], :]


def compress(dense: torch.Tensor, *, values: bool = True) -> torch.Tensor:
    """Dense square state -> pair layout: N (..., F, F, E) -> (..., F', E) (``values=True``),
    or Z (..., F, F) -> (..., F') (``values=False``). Only the symmetric part is kept (the
    only part a query reads)."""
    x = dense if values else dense.unsqueeze(-1)
    f = x.shape[-2]
    if x.dim() < 3 or x.shape[-3] != f:
        want = "(..., F, F, E)" if values else "(..., F, F)"
        raise ValueError(f"a dense square state must have shape {want}, got {tuple(dense.shape)}")
    out = PairFeatures(f, x).compress(x.flatten(-3, -2))
    return out if values else out.squeeze(-1)


def expand(pairs: torch.Tensor, feature_dim: int, *, values: bool = True) -> torch.Tensor:
    """Pair layout -> symmetric dense state: (..., F', E) -> (..., F, F, E) (``values=True``),
    or (..., F') -> (..., F, F)."""
    x = pairs if values else pairs.unsqueeze(-1)
    f = feature_dim
    if x.dim() < 2 or x.shape[-2] != pair_dim(f):
        raise ValueError(
            f"a pair-layout state for F={f} must have F'={pair_dim(f)} rows (dim "
            f"{-2 if values else -1}), got shape {tuple(pairs.shape)}"
        )
    out = PairFeatures(f, x).expand(x).unflatten(-2, (f, f))
    return out if values else out.squeeze(-1)


KEY_STATE_TOKENS = 2048
"""Tokens per slice in ``key_state`` (bounds the T×F' pair-feature temporary)."""


def key_state(
    b: torch.Tensor, c: torch.Tensor, *, square: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, Z) = (Σ_t Ψ(b_t)⊗c_t, Σ_t Ψ(b_t)) with Ψ = ψ when ``square``, else the identity.

    Shapes: b (..., T, F), c (..., T, E) -> N (..., F', E), Z (..., F'), in the state layout
    (``polysketch.ops.state``). Squared keys are summed in slices of ``KEY_STATE_TOKENS``.
    """
    if not square:
        return b.transpose(-1, -2) @ c, b.sum(-2)
    pairs = PairFeatures(b.shape[-1], b)
    num = den = None
    for start in range(0, max(1, b.shape[-2]), KEY_STATE_TOKENS):
        kf = pairs.features(b[..., start : start + KEY_STATE_TOKENS, :])
        n = kf.transpose(-1, -2) @ c[..., start : start + KEY_STATE_TOKENS, :]
        z = kf.sum(-2)
        num, den = (n, z) if num is None else (num + n, den + z)
    return num, den
