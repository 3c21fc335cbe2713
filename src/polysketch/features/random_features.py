"""Random features for the softmax kernel SM(x, y) = exp(scale · x·y): trigonometric and positive.

Paper: hybrid-random-features.md (HRF, Choromanski et al.). With ω_1..ω_m ~ N(0, I_D) and u the
(scaled) input,

* trigonometric (Eq. 2):  φ(u) = m^{-1/2} exp(‖u‖²/2) (sin ω_i·u, cos ω_i·u)_{i≤m}, F = 2m;
* positive / FAVOR+ (Eq. 3, antithetic pair ±ω):
  φ(u) = (2m)^{-1/2} exp(−‖u‖²/2) (exp(ω_i·u), exp(−ω_i·u))_{i≤m}, F = 2m.

Both are unbiased: E[φ(x)·φ(y)] = exp(x·y); their MSEs are Lemma 2.2 (Eq. 7). The target
exp(scale · x·y) is obtained by feeding u = sqrt(scale) · x to the maps (scale > 0), since
exp((√s x)·(√s y)) = exp(s x·y); attention users pass scale = 1/sqrt(D).

``orthogonal=True`` draws the ω's in blocks of D mutually orthogonal directions with independent
chi(D) norms (``polysketch.random.orthogonal_gaussian``), so each ω_i is still marginally
N(0, I_D) and both estimators stay unbiased, with lower variance (HRF §4; Yu et al. 2016).

The pure functions ``draw_directions``, ``trig_features`` and ``positive_features`` are the
building blocks reused by ``complex_exp``, ``hybrid`` and ``hybrid_clustered``; their
signatures are stable.

Stabilized queries (``FeatureMap.query_stabilized``, ``stable_query = True`` for every map
here): a query row may be multiplied by any c(u) > 0 where normalized attention without an
offset cancels it. ``stabilize=True`` returns the features times c(u) = exp(−log-scale of
the row), computed before any exponential, so the row's largest |feature| is in [2^{-1/2}, 1]
whatever ‖u‖: trig drops exp(‖u‖²/2)/√m (which overflows fp32 at ‖u‖ ≈ 13), positive
subtracts the row's largest exponent (its rows underflow to all zeros at ‖u‖ ≈ 13 in fp32).
Key features are never shifted (module docs of ``features.base``).
"""

from __future__ import annotations

import math

import torch

from .._checks import check_feature_input, check_float, check_positive_int, check_tensor
from ..random import gaussian, make_generator, orthogonal_gaussian
from .base import FeatureMap, Hyperparameter, register

__all__ = [
    "draw_directions",
    "stabilized_exp",
    "trig_features",
    "positive_exponents",
    "positive_features",
    "SoftmaxRandomFeatureMap",
    "TrigRandomFeatures",
    "PositiveRandomFeatures",
]


def draw_directions(
    num: int, dim: int, *, orthogonal: bool = False, generator: torch.Generator
) -> torch.Tensor:
    """Draw ω_1..ω_num, each marginally N(0, I_dim): (num, dim) float32.

    i.i.d. Gaussian rows, or (``orthogonal=True``) blocks of ``dim`` mutually orthogonal rows
    with independent chi(dim) norms (unbiased orthogonal random features, HRF §4).
    """
    num = check_positive_int(num, "num")
    dim = check_positive_int(dim, "dim")
    if not isinstance(orthogonal, bool):
        raise TypeError(f"orthogonal must be a bool, got {type(orthogonal).__name__}")
    if orthogonal:
        return orthogonal_gaussian(num, dim, generator=generator)
    return gaussian(num, dim, generator=generator)


def _check_directions(u: torch.Tensor, omega: torch.Tensor) -> None:
    check_tensor(u, "u", min_dim=1)
    check_tensor(omega, "omega", min_dim=2, last_dim=u.shape[-1])
    if omega.dtype != u.dtype:
        raise ValueError(f"omega must have the dtype of u ({u.dtype}), got {omega.dtype}")


def stabilized_exp(exponents: torch.Tensor) -> torch.Tensor:
    """exp(e − max_f e) per row: (..., F) -> (..., F), the row's largest entry 1.

    The shift is detached: it cancels in normalized attention, whose gradient is therefore
    the same with or without it (``FeatureMap.query_stabilized``).
    """
    return torch.exp(exponents - exponents.amax(-1, keepdim=True).detach())


def trig_features(u: torch.Tensor, omega: torch.Tensor, *, stabilize: bool = False) -> torch.Tensor:
    """Trigonometric features (HRF Eq. 2): m^{-1/2} exp(‖u‖²/2) (sin ω_i·u, cos ω_i·u).

    Shapes: u (..., T, D) (already scaled), omega (m, D) or batched (R, m, D) (leading dims
    broadcast with u's like ``torch.matmul``) -> (..., T, 2m), layout [sin_1..m, cos_1..m].
    φ(x)·φ(y) = exp((‖x‖²+‖y‖²)/2) (1/m) Σ_i cos ω_i·(x−y), unbiased for exp(x·y).
    Overflows (fp32) once ‖u‖² > 2·88, i.e. ‖u‖ ≳ 13. ``stabilize=True`` returns
    (sin ω_i·u, cos ω_i·u), the features divided by their row factor exp(‖u‖²/2)/√m.
    """
    _check_directions(u, omega)
    proj = u @ omega.transpose(-1, -2)
    if stabilize:
        return torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1)
    m = omega.shape[-2]
    log_amp = 0.5 * (u * u).sum(-1, keepdim=True) - 0.5 * math.log(m)
    return torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1) * torch.exp(log_amp)


def positive_exponents(u: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """The exponents of ``positive_features``: [±ω_i·u] − ‖u‖²/2 − log(2m)/2, (..., T, 2m)."""
    proj = u @ omega.transpose(-1, -2)
    m = omega.shape[-2]
    shift = 0.5 * (u * u).sum(-1, keepdim=True) + 0.5 * math.log(2 * m)
    return torch.cat([proj - shift, -proj - shift], dim=-1)


def positive_features(
    u: torch.Tensor, omega: torch.Tensor, *, stabilize: bool = False
) -> torch.Tensor:
    """Positive (FAVOR+) features (HRF Eq. 3): (2m)^{-1/2} exp(±ω_i·u − ‖u‖²/2).

    Shapes: u (..., T, D) (already scaled), omega (m, D) or batched (R, m, D) -> (..., T, 2m),
    layout [exp(+ω_1..m·u), exp(−ω_1..m·u)] · exp(−‖u‖²/2) / sqrt(2m).

    Computed as one exp of the exponent ±ω·u − ‖u‖²/2 − log(2m)/2, in the dtype of u (callers
    pass fp32 or fp64; the FeatureMap casts half inputs to fp32 first). Since
    ω·u − ‖u‖²/2 = ‖ω‖²/2 − ‖u − ω‖²/2 ≤ ‖ω‖²/2, the features never overflow while
    max_i ‖ω_i‖² < 2·88.7 (fp32; ‖ω‖² ~ χ²_D: P > 177 is 2e-12 for D = 64, 5e-22 for D = 32)
    and ≤ exp(‖ω‖‖u‖ − ‖u‖²/2) in general; and since one of ±ω·u is ≥ 0, every row has a
    feature ≥ exp(−‖u‖²/2)/sqrt(2m), so no row underflows to all zeros while ‖u‖ ≤ 12 (fp32,
    bf16) or ‖u‖ ≤ 36 (fp64). ``stabilize=True`` subtracts each row's largest exponent
    (``stabilized_exp``): a query-side factor only (see ``PositiveRandomFeatures``).
    """
    _check_directions(u, omega)
    exponents = positive_exponents(u, omega)
    return stabilized_exp(exponents) if stabilize else torch.exp(exponents)


def softmax_kernel(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """SM(x, y) = exp(scale · x·y): (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty)."""
    if x.dim() < 2 or y.dim() < 2:
        raise ValueError("x and y must have shape (..., T, D)")
    return torch.exp(scale * (x @ y.transpose(-1, -2)))


class SoftmaxRandomFeatureMap(FeatureMap):
    """Shared base of the random feature maps for SM(x, y) = exp(scale · x·y).

    Handles the shared keywords (``num_features`` = m, ``scale``, ``orthogonal``, ``seed``,
    ``generator``), the input scaling u = sqrt(scale) · x, ``target_kernel`` and the first
    draw; subclasses implement ``_draw(generator)`` and the feature computation on u.
    """

    kind = "unbiased"
    is_random = True
    family = "softmax"
    stable_query = True
    hyperparameters = {
        "num_features": Hyperparameter(None, "m >= 1 random directions (None: 4·D)"),
        "scale": Hyperparameter(1.0, "s > 0 of the target exp(s·x·y)"),
        "orthogonal": Hyperparameter(False, "draw ω in blocks of D orthogonal directions"),
        "seed": Hyperparameter(None, "seed of the random directions"),
        "generator": Hyperparameter(None, "torch.Generator for the draw (not with seed)"),
    }

    def __init__(
        self,
        dim: int,
        *,
        num_features: int | None = None,
        scale: float = 1.0,
        orthogonal: bool = False,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        nonnegative: bool = False,
        default_num_features: int | None = None,
    ):
        super().__init__(dim, nonnegative=nonnegative)
        if num_features is None:
            num_features = default_num_features if default_num_features is not None else dim
        self.num_features = check_positive_int(num_features, "num_features")
        self.scale = check_float(scale, "scale", minimum=0.0, strict_minimum=True)
        if not isinstance(orthogonal, bool):
            raise TypeError(f"orthogonal must be a bool, got {type(orthogonal).__name__}")
        self.orthogonal = orthogonal
        self._init_generator = make_generator(seed, generator)

    def _first_draw(self) -> None:
        """Subclasses call this at the end of __init__, once their sizes are set."""
        self._draw(self._init_generator)
        del self._init_generator

    def _directions(self, num: int, generator: torch.Generator) -> torch.Tensor:
        return draw_directions(num, self.dim, orthogonal=self.orthogonal, generator=generator)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """u = sqrt(scale) · x."""
        return x if self.scale == 1.0 else x * math.sqrt(self.scale)

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """exp(scale · x·y): (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty)."""
        check_feature_input(x, self.dim, "x")
        check_feature_input(y, self.dim, "y")
        return softmax_kernel(x, y, self.scale)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_features={self.num_features}, scale={self.scale}, "
            f"orthogonal={self.orthogonal}"
        )


@register("trig")
class TrigRandomFeatures(SoftmaxRandomFeatureMap):
    """Trigonometric random features for exp(scale · x·y) (HRF Eq. 2; Rahimi & Recht 2007).

    φ(x) = m^{-1/2} exp(‖u‖²/2) (sin ω_i·u, cos ω_i·u), u = sqrt(scale)·x: (..., D) -> (..., 2m).
    Unbiased, signed (scores can be negative); MSE = (2m)^{-1} e^{‖x+y‖²} SM^{-2}
    (1 − e^{−‖x−y‖²})² (Lemma 2.2, Eq. 7 with u-scaled inputs): exact at x = y, poor for small
    kernel values. Keywords: ``num_features`` m (default 4·D), ``scale``, ``orthogonal``,
    ``seed``/``generator``. Buffer ``omega`` (m, D).
    """

    def __init__(self, dim: int, **kwargs):
        super().__init__(dim, default_num_features=4 * dim, **kwargs)
        self._first_draw()

    @property
    def feature_dim(self) -> int:
        return 2 * self.num_features

    def _draw(self, generator: torch.Generator) -> None:
        self._set_buffer("omega", self._directions(self.num_features, generator))

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        return trig_features(self._scaled(x), self.omega.to(x.dtype))

    def _query_stabilized(self, x: torch.Tensor) -> torch.Tensor:
        return trig_features(self._scaled(x), self.omega.to(x.dtype), stabilize=True)


@register("positive")
class PositiveRandomFeatures(SoftmaxRandomFeatureMap):
    """Positive random features, FAVOR+ (HRF Eq. 3; Choromanski et al. 2021).

    φ(x) = (2m)^{-1/2} exp(−‖u‖²/2) (exp(ω_i·u), exp(−ω_i·u)), u = sqrt(scale)·x:
    (..., D) -> (..., 2m), with the antithetic pair ±ω_i. Unbiased, non-negative; MSE =
    (2m)^{-1} e^{‖x+y‖²} SM² (1 − e^{−‖x+y‖²})² (Lemma 2.2): exact at x = −y, poor for large
    kernel values. Keywords: ``num_features`` m (default 4·D), ``scale``, ``orthogonal``,
    ``seed``/``generator``. Buffer ``omega`` (m, D).

    Numerical range: see ``positive_features`` — with fp32 internals (also for bf16/fp16
    inputs) every row is finite and not all-zero for ‖u‖ ≤ 12 when max ‖ω_i‖² < 177 (holds
    with overwhelming probability for D ≤ 64); fp64 for ‖u‖ ≤ 36. fp16 *outputs* have a much
    narrower range (features above 65504 or below 6e-8 do not survive the cast back): prefer
    bf16 or fp32 inputs.

    Stabilizer: on queries only, and only through ``query_stabilized`` (each row's own max
    exponent subtracted), which the attention path uses where it cancels (normalized attention,
    no offset). performer-pytorch subtracts the max of the key exponents over the whole
    sequence, which leaks future tokens into causal attention. A per-row constant on *key*
    rows rescales each column differently and does NOT cancel, biasing the estimate. So
    ``query``/``key`` compute the exact unbiased features, and attention refuses keys whose
    features leave the range (``features.stability``).
    """

    def __init__(self, dim: int, **kwargs):
        super().__init__(dim, default_num_features=4 * dim, nonnegative=True, **kwargs)
        self._first_draw()

    @property
    def feature_dim(self) -> int:
        return 2 * self.num_features

    def _draw(self, generator: torch.Generator) -> None:
        self._set_buffer("omega", self._directions(self.num_features, generator))

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        return positive_features(self._scaled(x), self.omega.to(x.dtype))

    def _query_stabilized(self, x: torch.Tensor) -> torch.Tensor:
        return positive_features(self._scaled(x), self.omega.to(x.dtype), stabilize=True)
