"""PolySketchFormer's learned sketch: a small network in place of the random sketch.

PolySketchFormer (``polysketchformer.md``) approximates degree-4 polynomial attention by a
degree-2 sketch followed by self-tensoring (§2.1, Theorem 2.5: scores ``(φ(q)·φ(k))²`` are
non-negative and imitate ``(q·k)^4``). Its learned variant replaces the random degree-2 sketch
``(xS_1) ∘ (xS_2)`` (Definition 2.4, TensorSRHT) by the product of two learned branches:

    φ(x) = √r · tanh( b1(x) ∘ b2(x) / √r ),      scores (φ(q)·φ(k))²,

where each branch is ``levels`` feed-forward sketch blocks
``LayerNorm(D_in) → Linear(D_in → e·r) → GELU → Linear(e·r → r)`` (no biases), the first
taking D and the later ones r. The tanh bounds each feature by √r, so a score is at most
``(r·r)² = r⁴`` regardless of the input's scale.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._checks import check_positive_int, check_tensor
from ..random import make_generator
from .base import FeatureMap, register
from .llops import fit_kernel

__all__ = ["LearnedPolySketch", "SketchBlock"]


def _uniform(shape: tuple[int, ...], bound: float, generator: torch.Generator) -> torch.Tensor:
    """U(−bound, bound) entries, drawn in float64 on the CPU, stored float32."""
    u = torch.rand(*shape, generator=generator, dtype=torch.float64)
    return ((2.0 * u - 1.0) * bound).to(torch.float32)


class SketchBlock(nn.Module):
    """``LayerNorm(D_in) → Linear(D_in → e·r, no bias) → GELU → Linear(e·r → r, no bias)``.

    Shapes: (..., D_in) -> (..., r). Weights are cast to the input dtype at use, so fp64
    inputs give fp64 outputs without converting the module.
    """

    def __init__(self, d_in: int, hidden: int, d_out: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_in)
        self.up = nn.Parameter(torch.zeros(hidden, d_in))
        self.down = nn.Parameter(torch.zeros(d_out, hidden))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """LayerNorm to identity; Linear weights U(±1/√fan_in) (torch's default bound)."""
        self.norm.reset_parameters()
        self.up.copy_(_uniform(tuple(self.up.shape), self.up.shape[1] ** -0.5, generator))
        self.down.copy_(_uniform(tuple(self.down.shape), self.down.shape[1] ** -0.5, generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        h = nn.functional.layer_norm(
            x,
            self.norm.normalized_shape,
            self.norm.weight.to(dt),
            self.norm.bias.to(dt),
            self.norm.eps,
        )
        h = nn.functional.gelu(h @ self.up.to(dt).T)
        return h @ self.down.to(dt).T


@register("learned_polysketch")
class LearnedPolySketch(FeatureMap):
    """PolySketchFormer's learned sketch (see the module docstring): (..., D) -> (..., r).

    ``φ(x) = √r · tanh(b1(x) ∘ b2(x) / √r)``, one module for queries and keys, ``square``
    (scores ``(φ(q)·φ(k))² ≥ 0``, ``state_dim = r²``). ``target_kernel`` is the polynomial
    ``(x·y)^degree`` (degree 4 by default) that the network is trained to imitate — a learned
    approximation, not an estimator: before training (or with ``fit``) its scores need not
    resemble the target at all.

    Args:
        dim: D. num_features: r ≥ 1 (default 32). expansion: e ≥ 1 (default 8).
        levels: blocks per branch ≥ 1 (default 2). degree: even target degree (default 4).
        seed, generator: make the initial weights reproducible.
    """

    kind = "learned"
    is_random = False

    def __init__(
        self,
        dim: int,
        *,
        num_features: int = 32,
        expansion: int = 8,
        levels: int = 2,
        degree: int = 4,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__(dim, square=True, nonnegative=True)
        self.num_features = check_positive_int(num_features, "num_features")
        self.expansion = check_positive_int(expansion, "expansion")
        self.levels = check_positive_int(levels, "levels")
        self.degree = check_positive_int(degree, "degree")
        if self.degree % 2:
            raise ValueError(f"degree must be even (squared scores are >= 0), got {degree}")
        r, hidden = self.num_features, self.expansion * self.num_features

        def branch() -> nn.ModuleList:
            dims = [self.dim] + [r] * (self.levels - 1)
            return nn.ModuleList(SketchBlock(d, hidden, r) for d in dims)

        self.branch1 = branch()
        self.branch2 = branch()
        self.reset_parameters(seed=seed, generator=generator)

    @property
    def feature_dim(self) -> int:
        return self.num_features

    def reset_parameters(
        self, *, seed: int | None = None, generator: torch.Generator | None = None
    ) -> LearnedPolySketch:
        """Redraw every weight from ``seed``/``generator`` (reproducible); returns ``self``."""
        gen = make_generator(seed, generator)
        for block in [*self.branch1, *self.branch2]:
            block.reset_parameters(gen)
        return self

    @staticmethod
    def _run(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        for block in blocks:  # `levels` blocks: depth of the network, not tokens
            x = block(x)
        return x

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        root = math.sqrt(self.num_features)
        prod = self._run(self.branch1, x) * self._run(self.branch2, x)
        return torch.tanh(prod / root) * root

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``(x·y)^degree``: (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty)."""
        x = check_tensor(x, "x", min_dim=2, last_dim=self.dim)
        y = check_tensor(y, "y", min_dim=2, last_dim=self.dim)
        return (x @ y.transpose(-1, -2)) ** self.degree

    def fit(self, q: torch.Tensor, k: torch.Tensor, **kwargs) -> list[float]:
        """Train the network to imitate ``target_kernel`` on samples (``llops.fit_kernel``)."""
        return fit_kernel(self, q, k, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, expansion={self.expansion}, levels={self.levels}, "
            f"degree={self.degree}"
        )
