"""Soft hashing: a learned soft assignment of queries and keys to F buckets.

For a head dimension D and F learned directions (the columns of W ∈ R^{D×F}),

    φq(x) = softmax( τ · x W_q / √D ),      φk(x) = softmax( τ · x W_k / √D ),      (1)

each a probability vector over the F buckets, with one learnable temperature τ = exp(log τ)
shared by queries and keys. The score is

    s(q, k) = φq(q) · φk(k) = Σ_f P(q → f) P(k → f),                                  (2)

the probability that q and k land in the same bucket when each draws its bucket from its own
softmax. So 0 < s ≤ 1, and s → 1 only when both put all their mass on one bucket: a key whose
bucket no other key shares is retrieved among t keys with weight s* / Σ_j s_j, which does not
fall as 1/t the way a sketch's does (its floor is the mass the other keys put on q's buckets,
not a variance term). Linear attention with this map has the decode state F × (E + 1) per
head (not squared); F = 1024 is 1.9× ``psf_random``'s 544 pair features.

Why: on the long-context repeat probe (``docs/results/long_context/screens/``), this is the
first linear-time map found that learns to copy a passage 1024 tokens back within the budget
in which softmax and exact degree-4 attention do; the random and learned polynomial sketches,
Hedgehog (up to 1024 features), exact degree 4 on 8-dim q/k and BASED's Taylor map do not.
The init matters for that: W is Gaussian N(0, 1) and τ starts at 4, so on LayerNorm'd inputs
(‖x‖ = √D) the logits x·w_f·τ/√D have standard deviation τ and each softmax starts peaked
on a few buckets (Hedgehog's semi-orthogonal W starts near the uniform distribution when F ≫
D, and learned nothing on the probe).

The target kernel is the map's own (2), computed in log space as
``exp(logsumexp_f(log φq + log φk))`` (no feature map is imitated; ``family = "own"``).
Parameters: ``weight_q`` (D, F), ``weight_k`` (D, F) unless ``shared`` (both start from the
same draw), ``log_temperature`` (a scalar, a buffer when ``learn_temperature=False``); stored
float32, cast to the input's compute dtype at use.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._checks import check_float, check_positive_int, check_tensor
from ..random import gaussian, make_generator
from .base import FeatureMap, Hyperparameter, register

__all__ = ["SoftHashFeatureMap"]


@register("soft_hash")
class SoftHashFeatureMap(FeatureMap):
    """φ(x) = softmax(τ · x W / √D) over F learned buckets (module docstring, Eqs. 1–2).

    Args:
        dim: D. num_features: F ≥ 2, the number of buckets (default 4D).
        temperature: τ's initial value, > 0 (default 4).
        learn_temperature: τ is trained (a parameter) or fixed (a buffer).
        shared: one W for queries and keys (a symmetric kernel); default separate W_q, W_k.
        output_scale: a constant c > 0 multiplying the features (scores × c², so 0 < s ≤ c²).
            Normalized linear attention does not depend on it; in mixed attention
            (``mixed=True``) it weighs the far blocks against the exact local ones, and with
            ``learn_balance=True`` it becomes the learned balance's start (β₀ = 2 ln c).
        seed, generator: the Gaussian draw of W.
    """

    kind = "learned"
    is_random = False
    family = "own"
    hyperparameters = {
        "num_features": Hyperparameter(None, "F >= 2, the number of buckets (None: 4D)"),
        "temperature": Hyperparameter(4.0, "initial τ > 0 of softmax(τ·xW/√D)"),
        "learn_temperature": Hyperparameter(True, "τ is a parameter (else a buffer)"),
        "shared": Hyperparameter(False, "one W for queries and keys"),
        "output_scale": Hyperparameter(1.0, "c > 0 multiplying the features (scores × c²)"),
        "seed": Hyperparameter(None, "seed of the Gaussian draw of W"),
        "generator": Hyperparameter(None, "torch.Generator for W (not with seed)"),
    }

    def __init__(
        self,
        dim: int,
        *,
        num_features: int | None = None,
        temperature: float = 4.0,
        learn_temperature: bool = True,
        shared: bool = False,
        output_scale: float = 1.0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__(dim, square=False, nonnegative=True)
        self.num_features = check_positive_int(
            4 * self.dim if num_features is None else num_features, "num_features"
        )
        if self.num_features < 2:
            raise ValueError(f"num_features must be >= 2 buckets, got {self.num_features}")
        temperature = check_float(temperature, "temperature", minimum=0.0, strict_minimum=True)
        for name, flag in (("learn_temperature", learn_temperature), ("shared", shared)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.shared = shared
        self.output_scale = check_float(
            output_scale, "output_scale", minimum=0.0, strict_minimum=True
        )
        w = gaussian(self.dim, self.num_features, generator=make_generator(seed, generator))
        self.weight_q = nn.Parameter(w.float().clone())
        self.weight_k = None if shared else nn.Parameter(w.float().clone())
        log_t = torch.tensor(math.log(temperature), dtype=torch.float32)
        if learn_temperature:
            self.log_temperature = nn.Parameter(log_t)
        else:
            self.register_buffer("log_temperature", log_t)

    @property
    def feature_dim(self) -> int:
        return self.num_features

    @property
    def temperature(self) -> float:
        """τ = exp(log τ), the current temperature."""
        return float(self.log_temperature.detach().exp())

    def _logits(self, x: torch.Tensor, key: bool) -> torch.Tensor:
        """τ · x W / √D: (..., D) -> (..., F); W is scaled first (D×F, not T×F, products)
        unless x has fewer rows than D (a decoding step)."""
        w = self.weight_k if key and not self.shared else self.weight_q
        scale = self.log_temperature.exp() / math.sqrt(self.dim)
        if x.dim() >= 2 and x.shape[-2] < self.dim:
            return (x @ w.to(x.dtype)) * scale.to(x.dtype)
        return x @ (w * scale).to(x.dtype)

    def _scaled(self, phi: torch.Tensor) -> torch.Tensor:
        return phi if self.output_scale == 1.0 else phi * self.output_scale

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        return self._scaled(self._logits(x, False).softmax(-1))

    def _key(self, x: torch.Tensor) -> torch.Tensor:
        return self._scaled(self._logits(x, True).softmax(-1))

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """c² Σ_f P(x → f) P(y → f) (Eq. 2 × output_scale²), in log space:
        (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty)."""
        x = check_tensor(x, "x", min_dim=2, last_dim=self.dim)
        y = check_tensor(y, "y", min_dim=2, last_dim=self.dim)
        log_q = self._logits(x, False).log_softmax(-1).unsqueeze(-2)  # (..., Tx, 1, F)
        log_k = self._logits(y, True).log_softmax(-1).unsqueeze(-3)  # (..., 1, Ty, F)
        return torch.logsumexp(log_q + log_k, dim=-1).exp() * self.output_scale**2

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_features={self.num_features}, "
            f"temperature={self.temperature:.4g}, shared={self.shared}"
        )
