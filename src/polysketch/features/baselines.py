"""Baseline feature maps of linear attention: elu + 1, BASED's Taylor map, element-wise power.

These maps are not estimators of a fixed kernel: each *defines* its kernel, and
``target_kernel`` writes that kernel in closed form (without building the features), so the
fidelity tests check the feature computation against an independent formula.

- ``elu`` (Katharopoulos et al., 2020): ``φ(x) = elu(x) + 1``.
- ``taylor`` (BASED, Arora et al., 2024; LLoPS paper §2.2, Eq. 4–5 and footnote 2): the
  second-order Taylor map of ``exp(s)``, ``φ(x)·φ(y) = 1 + s + s²/2`` with ``s = scale·x·y``.
- ``elementwise_power`` (Flatten Transformer, Han et al., 2023; LLoPS paper §3.3):
  ``φ(x) = (Θx)^{∘p}``, the LLoPS special case Θ_1 = ... = Θ_p.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._checks import check_float, check_positive_int, check_tensor
from ..random import gaussian, make_generator
from .base import FeatureMap, Fixed, Hyperparameter, register

__all__ = ["EluFeatures", "TaylorFeatures", "ElementwisePower"]


def _pair(self: FeatureMap, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = check_tensor(x, "x", min_dim=2, last_dim=self.dim)
    y = check_tensor(y, "y", min_dim=2, last_dim=self.dim)
    return x, y


@register("elu")
class EluFeatures(FeatureMap):
    """``φ(x) = elu(x) + 1`` (Katharopoulos et al., 2020): (..., D) -> (..., D), F = D.

    Computed as ``e^x`` for x ≤ 0 and ``x + 1`` otherwise (the same function without the
    cancellation of ``(e^x − 1) + 1``, which rounds to 0 below x ≈ −37), so every feature is
    > 0 down to x ≈ −745 in fp64 and scores are non-negative.
    ``target_kernel(x, y) = Σ_d (elu(x_d) + 1)(elu(y_d) + 1)``.
    """

    kind = "approximate"
    family = "own"
    hyperparameters = {}
    fixed = {"num_features": Fixed("feature_dim", "dim (F = D)")}

    def __init__(self, dim: int):
        super().__init__(dim, nonnegative=True)

    @property
    def feature_dim(self) -> int:
        return self.dim

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x + 1.0, torch.exp(x.clamp(max=0.0)))

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``Σ_d (elu(x_d) + 1)(elu(y_d) + 1)``: (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty)."""
        x, y = _pair(self, x, y)
        elu = nn.functional.elu
        return torch.einsum("...id,...jd->...ij", elu(x) + 1.0, elu(y) + 1.0)


@register("taylor")
class TaylorFeatures(FeatureMap):
    """BASED's 2nd-order Taylor map: ``φ(x) = [1, u, vec(u ⊗ u)/√2]``, ``u = √scale · x``.

    Then ``φ(x)·φ(y) = 1 + s + s²/2`` with ``s = scale · x·y``, the Taylor expansion of
    ``exp(s)`` to second order (LLoPS paper footnote 2; its Eq. 5 is the quadratic term).
    BASED scales x by ``D^{-1/4}`` (``scale = 1/√D``, the default), so ``s`` is the softmax
    logit ``x·y/√D``. F = 1 + D + D² (the full outer product, as BASED).
    The kernel is ``((s + 1)² + 1)/2 ≥ 1/2``, so scores are positive.

    Shapes: x (..., D) -> (..., 1 + D + D²).
    """

    kind = "approximate"
    family = "own"
    hyperparameters = {
        "scale": Hyperparameter(None, "s > 0 in s = scale·x·y (None: 1/√D, as BASED)"),
    }
    fixed = {
        "degree": Fixed("degree", "the map (a second-order Taylor expansion)"),
        "num_features": Fixed("feature_dim", "dim (F = 1 + D + D²)"),
    }
    degree = 2

    def __init__(self, dim: int, *, scale: float | None = None):
        super().__init__(dim, nonnegative=True)
        if scale is None:
            scale = 1.0 / math.sqrt(self.dim)
        self.scale = check_float(scale, "scale", minimum=0.0, strict_minimum=True)

    @property
    def feature_dim(self) -> int:
        return 1 + self.dim + self.dim * self.dim

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        u = x * math.sqrt(self.scale)
        quad = (u.unsqueeze(-1) * u.unsqueeze(-2)).flatten(-2) / math.sqrt(2.0)
        return torch.cat([torch.ones_like(u[..., :1]), u, quad], dim=-1)

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``1 + s + s²/2``, ``s = scale · x·y``: (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty)."""
        x, y = _pair(self, x, y)
        s = self.scale * (x @ y.transpose(-1, -2))
        return 1.0 + s + 0.5 * s * s

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.4g}"


@register("elementwise_power")
class ElementwisePower(FeatureMap):
    """``φ(x) = (Θx)^{∘p}`` (LLoPS paper §3.3; Flatten Transformer): (..., D) -> (..., F).

    The kernel is ``Σ_f (θ_f·x)^p (θ_f·y)^p``, LLoPS (Eq. 17) with all factors equal.
    Θ: (F, D), drawn with i.i.d. N(0, F^{-1/p}) entries from ``seed``/``generator``, so at
    init the kernel is the average over F Gaussian directions g of ``(g·x)^p (g·y)^p``.
    ``trainable=True`` makes Θ an ``nn.Parameter`` (default); otherwise a fixed buffer.
    ``redraw_`` redraws Θ in either case. Non-negative when p is even.

    Args:
        dim: D. degree: p ≥ 1 (default 2). num_features: F ≥ 1 (default D).
    """

    kind = "approximate"
    is_random = True
    family = "polynomial"
    hyperparameters = {
        "degree": Hyperparameter(2, "p >= 1, the element-wise power"),
        "num_features": Hyperparameter(None, "F >= 1, rows of Θ (None: D)"),
        "trainable": Hyperparameter(True, "Θ is an nn.Parameter (else a fixed buffer)"),
        "seed": Hyperparameter(None, "seed of the draw of Θ"),
        "generator": Hyperparameter(None, "torch.Generator for the draw of Θ (not with seed)"),
    }

    def __init__(
        self,
        dim: int,
        *,
        degree: int = 2,
        num_features: int | None = None,
        trainable: bool = True,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        degree = check_positive_int(degree, "degree")
        super().__init__(dim, nonnegative=degree % 2 == 0)
        self.degree = degree
        self.num_features = check_positive_int(
            self.dim if num_features is None else num_features, "num_features"
        )
        if not isinstance(trainable, bool):
            raise TypeError(f"trainable must be a bool, got {type(trainable).__name__}")
        self.trainable = trainable
        theta = self._sample(make_generator(seed, generator))
        if trainable:
            self.theta = nn.Parameter(theta)
        else:
            self.register_buffer("theta", theta)

    def _sample(self, generator: torch.Generator) -> torch.Tensor:
        std = self.num_features ** (-0.5 / self.degree)
        return gaussian(self.num_features, self.dim, generator=generator) * std

    def _draw(self, generator: torch.Generator) -> None:
        self.theta.copy_(self._sample(generator))

    @property
    def feature_dim(self) -> int:
        return self.num_features

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.theta.to(x.dtype).T) ** self.degree

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``Σ_f ((θ_f·x)(θ_f·y))^p``: (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty)."""
        x, y = _pair(self, x, y)
        theta = self.theta.to(x.dtype)
        px = torch.einsum("...id,fd->...if", x, theta)
        py = torch.einsum("...jd,fd->...jf", y, theta)
        return (px.unsqueeze(-2) * py.unsqueeze(-3)).pow(self.degree).sum(-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, degree={self.degree}, trainable={self.trainable}"
