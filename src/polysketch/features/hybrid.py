"""Hybrid random features (HRF §2.2–2.4): angular and Gaussian hybrids for exp(scale · x·y).

A hybrid estimator mixes base estimators SM̂_1..SM̂_{p+1} with estimated coefficients λ̂_k
drawn independently of them (Eq. 8):

    SM̂_hyb(x, y) = Σ_k λ̂_k(x, y) SM̂_k(x, y) + (1 − Σ_k λ̂_k(x, y)) SM̂_{p+1}(x, y),

unbiased whenever the base estimators are. When λ̂_k = a_k + ρ1_k(x)·ρ2_k(y) (Eq. 9–10) and
SM̂_k = φ_k(x)·φ_k(y), the estimator is one dot product (Lemma 2.3, Eq. 11), using the
tensor product (ρ1⊗φ)(x)·(ρ2⊗φ)(y) = (ρ1(x)·ρ2(y)) (φ(x)·φ(y)). The paper writes the negative
terms with a factor i on both sides; we keep REAL features by putting the minus sign on the
query side only, so the hybrid maps are asymmetric (query ≠ key) and signed.

* ``hybrid_angular`` (bipolar, Eq. 12 and 19): SM̂ = λ̂ SM̂_++ + (1 − λ̂) SM̂_trig with
  λ̂ = 1/2 − ρ(x)·ρ(y), ρ(z) = (2n)^{-1/2} sgn(τ_j·z)_{j≤n}, τ_j ~ N(0, I): E[λ̂] = θ_{x,y}/π
  (Goemans–Williamson), E[λ̂²] per Lemma 3.2 (Eq. 24); MSE per Theorem 3.1 (Eq. 22, or Eq. 23
  with ``shared_directions=True``). On a sphere the MSE vanishes at θ = 0 and θ = π.
* ``hybrid_gaussian`` (Eq. 20): λ̂_k estimates exp(−‖x + M_k y‖²/(2c_k²)) with a_k = 0,
  ρ1_k(x) = e^{−‖x‖²/(2c_k²)} φ_SM(x/c_k), ρ2_k(y) = e^{−‖M_k y‖²/(2c_k²)} φ_SM(−M_k y/c_k).

Inputs are scaled first, u = sqrt(scale)·x, and every estimator and coefficient acts on u.

Stabilized queries (``query_stabilized``): a row mixes blocks whose scales differ wildly
(FAVOR+ blocks carry exp(−‖u‖²/2), trig blocks exp(+‖u‖²/2)), so each block is computed as a
normalized part times exp(its log-scale) and the whole row is divided by exp(the largest
log-scale of the row) before any exponential is taken: one positive factor per row, the row's
largest |feature| in [1/2, 1], blocks far below it underflow to zero as they would beside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .._checks import check_choice, check_finite, check_float, check_positive_int, check_tensor
from .base import Hyperparameter, register
from .random_features import (
    SoftmaxRandomFeatureMap,
    _check_directions,
    positive_exponents,
    positive_features,
    trig_features,
)

__all__ = [
    "angular_hybrid_features",
    "gaussian_hybrid_features",
    "AngularHybrid",
    "GaussianHybrid",
]

_BASES = ("positive", "trig")


def _outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise vectorized outer product: (..., A), (..., B) -> (..., A·B)."""
    return (a.unsqueeze(-1) * b.unsqueeze(-2)).flatten(-2)


def _log_scaled(exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp(e) as (exp(e − c), c) with c = the row's largest exponent (detached), (..., 1)."""
    c = exponents.amax(-1, keepdim=True).detach()
    return torch.exp(exponents - c), c


def _scaled_base(name: str, u: torch.Tensor, omega: torch.Tensor):
    """Base features as (normalized part, log-scale): features = part · exp(log-scale)."""
    if name == "positive":
        return _log_scaled(positive_exponents(u, omega))
    sq = 0.5 * (u * u).sum(-1, keepdim=True) - 0.5 * math.log(omega.shape[-2])
    return trig_features(u, omega, stabilize=True), sq


def _scaled_lambda(v: torch.Tensor, omega: torch.Tensor, name: str):
    """``_gaussian_lambda_features`` as (normalized part, log-scale)."""
    n = omega.shape[-2]
    if name == "trig":
        return trig_features(v, omega, stabilize=True), v.new_full(
            (*v.shape[:-1], 1), -0.5 * math.log(n)
        )
    proj = v @ omega.transpose(-1, -2)
    shift = (v * v).sum(-1, keepdim=True) + 0.5 * math.log(2 * n)
    return _log_scaled(torch.cat([proj - shift, -proj - shift], dim=-1))


def _assemble(blocks, stabilize: bool) -> torch.Tensor:
    """Concatenate blocks (part, log-scale): part·exp(log − c) with c the row's largest
    log-scale when ``stabilize`` (one positive factor per row), else part·exp(log)."""
    logs = [log for _, log in blocks]
    c = torch.cat(logs, dim=-1).amax(-1, keepdim=True).detach() if stabilize else None
    return torch.cat(
        [part * torch.exp(log if c is None else log - c) for part, log in blocks], dim=-1
    )


def angular_hybrid_features(
    u: torch.Tensor,
    omega_pos: torch.Tensor,
    omega_trig: torch.Tensor,
    tau: torch.Tensor,
    role: str,
    *,
    stabilize: bool = False,
) -> torch.Tensor:
    """Real features of the angular hybrid estimator (Eq. 11, 12, 19).

    query: [φ++/√2, −ρ⊗φ++, φtrig/√2, ρ⊗φtrig],  key: [φ++/√2, ρ⊗φ++, φtrig/√2, ρ⊗φtrig],
    so query(x)·key(y) = (1/2 − ρ(x)·ρ(y)) SM̂_++ + (1/2 + ρ(x)·ρ(y)) SM̂_trig.

    Shapes: u (..., T, D) already scaled; omega_pos, omega_trig (m, D) (may be the same tensor
    for shared directions); tau (n, D) — any of them batched (R, ·, D) broadcasting with u like
    matmul -> (..., T, 4m(n+1)). ``stabilize=True``: the row times one positive factor, its
    largest |feature| in [1/2, 1] (module docstring; for queries in normalized attention).
    """
    role = check_choice(role, "role", ("query", "key"))
    _check_directions(u, tau)
    n = tau.shape[-2]
    rho = torch.sign(u @ tau.transpose(-1, -2)) / math.sqrt(2 * n)
    if stabilize:  # both bases share the row's largest log-scale
        _check_directions(u, omega_pos)
        _check_directions(u, omega_trig)
        (pos, log_pos), (trg, log_trg) = (
            _scaled_base("positive", u, omega_pos),
            _scaled_base("trig", u, omega_trig),
        )
        c = torch.maximum(log_pos, log_trg).detach()
        pos, trg = pos * torch.exp(log_pos - c), trg * torch.exp(log_trg - c)
    else:
        pos = positive_features(u, omega_pos)
        trg = trig_features(u, omega_trig)
    half = math.sqrt(0.5)
    mixed_pos = _outer(rho, pos)
    if role == "query":
        mixed_pos = -mixed_pos
    return torch.cat([pos * half, mixed_pos, trg * half, _outer(rho, trg)], dim=-1)


def _gaussian_lambda_features(v: torch.Tensor, omega: torch.Tensor, name: str) -> torch.Tensor:
    """e^{−‖v‖²/2} φ_SM(v) (Eq. 20) for φ_SM positive or trig, computed without overflow."""
    proj = v @ omega.transpose(-1, -2)
    n = omega.shape[-2]
    if name == "trig":  # e^{−‖v‖²/2} · e^{‖v‖²/2} (sin, cos)/√n
        return torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1) / math.sqrt(n)
    shift = (v * v).sum(-1, keepdim=True) + 0.5 * math.log(2 * n)
    return torch.exp(torch.cat([proj - shift, -proj - shift], dim=-1))


def gaussian_hybrid_features(
    u: torch.Tensor,
    base_omegas: torch.Tensor,
    lambda_omegas: torch.Tensor,
    M: torch.Tensor,
    widths: torch.Tensor,
    role: str,
    *,
    estimators: Sequence[str],
    lambda_estimator: str = "positive",
    stabilize: bool = False,
) -> torch.Tensor:
    """Real features of the Gaussian-λ hybrid estimator (Eq. 8, 11, 20) with a_k = 0.

    With ρ1_k, ρ2_k from Eq. 20 and φ_k the base feature maps (``estimators[k]``):
    query = [ρ1_k⊗φ_k]_{k≤p} ⊕ φ_{p+1} ⊕ [−ρ1_k⊗φ_{p+1}]_{k≤p},
    key   = [ρ2_k⊗φ_k]_{k≤p} ⊕ φ_{p+1} ⊕ [ρ2_k⊗φ_{p+1}]_{k≤p}.

    Shapes: u (..., T, D) already scaled; base_omegas (p+1, m, D); lambda_omegas (p, n, D)
    (both may carry a leading batch dim R broadcasting with u like matmul); M (p, D, D);
    widths (p,) -> (..., T, 2m(1 + 4pn)).

    Every block is a normalized part times exp(its log-scale) (the log-scales of the two
    factors of ρ⊗φ add), so no product meets 0·inf; ``stabilize=True`` divides the row by
    exp(its largest log-scale) (module docstring; for queries in normalized attention).
    """
    role = check_choice(role, "role", ("query", "key"))
    lambda_estimator = check_choice(lambda_estimator, "lambda_estimator", _BASES)
    p = M.shape[-3]
    if len(estimators) != p + 1:
        raise ValueError(f"estimators must have p + 1 = {p + 1} entries, got {len(estimators)}")
    _check_directions(u, base_omegas.flatten(-3, -2))
    _check_directions(u, lambda_omegas.flatten(-3, -2))
    bases = [
        _scaled_base(check_choice(name, "estimators", _BASES), u, omega)
        for name, omega in zip(estimators, base_omegas.unbind(-3), strict=True)
    ]
    head, tail = [], []
    last, log_last = bases[p]
    for k, omega in enumerate(lambda_omegas.unbind(-3)):
        v = u if role == "query" else -(u @ M[k].transpose(-1, -2))
        rho, log_rho = _scaled_lambda(v / widths[k], omega, lambda_estimator)
        head.append((_outer(rho, bases[k][0]), log_rho + bases[k][1]))
        mixed = _outer(rho, last)
        tail.append((-mixed if role == "query" else mixed, log_rho + log_last))
    return _assemble([*head, bases[p], *tail], stabilize)


class _HybridFeatureMap(SoftmaxRandomFeatureMap):
    """Hybrid maps are asymmetric: ``_features_for(x, role)`` computes both sides."""

    def _features_for(self, x: torch.Tensor, role: str, stabilize: bool = False) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} must define _features_for")

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        return self._features_for(x, "query")

    def _query_stabilized(self, x: torch.Tensor) -> torch.Tensor:
        return self._features_for(x, "query", stabilize=True)

    def _key(self, x: torch.Tensor) -> torch.Tensor:
        return self._features_for(x, "key")


@register("hybrid_angular")
class AngularHybrid(_HybridFeatureMap):
    """Angular hybrid random features for exp(scale · x·y) (HRF Eq. 12, 19; Lemma 2.3).

    SM̂(x, y) = λ̂ SM̂_++ + (1 − λ̂) SM̂_trig with λ̂ = 1/2 − (2n)^{-1} Σ_j sgn(τ_j·x) sgn(τ_j·y),
    E[λ̂] = θ_{x,y}/π. query/key: (..., D) -> (..., F), F = 4m(n+1) (see
    ``angular_hybrid_features``); asymmetric and signed. Unbiased; on a sphere ‖x‖ = ‖y‖ the
    estimate is exact at θ = 0 (λ̂ = 0, trig exact at x = y) and θ = π (λ̂ = 1, FAVOR+ exact at
    x = −y). MSE: Theorem 3.1 (Eq. 22; Eq. 23 when ``shared_directions=True``).

    Keywords: ``num_features`` m per base estimator (default D), ``lambda_features`` n
    (default 4), ``shared_directions`` (trig and positive use the same ω; default False),
    ``scale``, ``orthogonal`` (for ω's and τ's), ``seed``/``generator``.
    Buffers: ``omega_pos`` (m, D), ``omega_trig`` (m, D, absent when shared), ``tau`` (n, D).
    """

    hyperparameters = {
        **SoftmaxRandomFeatureMap.hyperparameters,
        "num_features": Hyperparameter(None, "m >= 1 directions per base estimator (None: D)"),
        "lambda_features": Hyperparameter(4, "n >= 1 sign features of λ̂"),
        "shared_directions": Hyperparameter(False, "trig and positive share the ω's"),
    }

    def __init__(
        self,
        dim: int,
        *,
        lambda_features: int = 4,
        shared_directions: bool = False,
        **kwargs,
    ):
        if not isinstance(shared_directions, bool):
            raise TypeError(
                f"shared_directions must be a bool, got {type(shared_directions).__name__}"
            )
        super().__init__(dim, default_num_features=dim, **kwargs)
        self.lambda_features = check_positive_int(lambda_features, "lambda_features")
        self.shared_directions = shared_directions
        self._first_draw()

    @property
    def feature_dim(self) -> int:
        return 4 * self.num_features * (self.lambda_features + 1)

    def _draw(self, generator: torch.Generator) -> None:
        self._set_buffer("omega_pos", self._directions(self.num_features, generator))
        if not self.shared_directions:
            self._set_buffer("omega_trig", self._directions(self.num_features, generator))
        self._set_buffer("tau", self._directions(self.lambda_features, generator))

    def _features_for(self, x: torch.Tensor, role: str, stabilize: bool = False) -> torch.Tensor:
        omega_pos = self.omega_pos.to(x.dtype)
        omega_trig = omega_pos if self.shared_directions else self.omega_trig.to(x.dtype)
        u, tau = self._scaled(x), self.tau.to(x.dtype)
        return angular_hybrid_features(u, omega_pos, omega_trig, tau, role, stabilize=stabilize)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, lambda_features={self.lambda_features}, "
            f"shared_directions={self.shared_directions}"
        )


@register("hybrid_gaussian")
class GaussianHybrid(_HybridFeatureMap):
    """Gaussian-λ hybrid random features for exp(scale · x·y) (HRF Eq. 8, 20; Lemma 2.3).

    SM̂ = Σ_{k≤p} λ̂_k SM̂_k + (1 − Σ_k λ̂_k) SM̂_{p+1}, λ̂_k an unbiased estimate (n random
    features of kind ``lambda_estimator``) of exp(−‖u_x + M_k u_y‖²/(2c_k²)), which "fires"
    where u_x ≈ −M_k u_y. Default: p = 1, M = I, c = 1, estimators (positive, trig): weight on
    FAVOR+ near x ≈ −y (small kernel values), on trig elsewhere. Unbiased, asymmetric, signed.
    query/key: (..., D) -> (..., F), F = 2m(1 + 4pn).

    Keywords: ``M`` (D, D) or (p, D, D) real (default I); ``widths`` c_k, a float or p floats
    > 0 (default 1.0); ``estimators`` p + 1 names in {"positive", "trig"} (default p ×
    "positive" then "trig"); ``lambda_estimator`` "positive" (λ̂ ≥ 0, default) or "trig";
    ``num_features`` m (default D); ``lambda_features`` n (default 4); ``scale``,
    ``orthogonal``, ``seed``/``generator``.
    Buffers: ``base_omega`` (p+1, m, D), ``lambda_omega`` (p, n, D), ``M`` (p, D, D),
    ``widths`` (p,).
    """

    hyperparameters = {
        **SoftmaxRandomFeatureMap.hyperparameters,
        "num_features": Hyperparameter(None, "m >= 1 directions per base estimator (None: D)"),
        "lambda_features": Hyperparameter(4, "n >= 1 random features per λ̂_k"),
        "M": Hyperparameter(None, "(D, D) or (p, D, D) real matrices M_k (None: I)"),
        "widths": Hyperparameter(1.0, "c_k > 0, a float or p floats"),
        "estimators": Hyperparameter(None, "p + 1 base names in {positive, trig}"),
        "lambda_estimator": Hyperparameter("positive", "'positive' or 'trig' features of λ̂"),
    }

    def __init__(
        self,
        dim: int,
        *,
        lambda_features: int = 4,
        M: torch.Tensor | None = None,
        widths: float | Sequence[float] | torch.Tensor = 1.0,
        estimators: Sequence[str] | None = None,
        lambda_estimator: str = "positive",
        **kwargs,
    ):
        super().__init__(dim, default_num_features=dim, **kwargs)
        self.lambda_features = check_positive_int(lambda_features, "lambda_features")
        if M is None:
            M = torch.eye(dim, dtype=torch.float64)
        check_tensor(M, "M", min_dim=2)
        if M.dim() == 2:
            M = M.unsqueeze(0)
        if M.dim() != 3 or tuple(M.shape[1:]) != (dim, dim):
            raise ValueError(
                f"M must have shape ({dim}, {dim}) or (p, {dim}, {dim}), got {tuple(M.shape)}"
            )
        check_finite(M, "M")
        p = M.shape[0]
        if isinstance(widths, torch.Tensor):
            widths = widths.flatten().tolist()
        if isinstance(widths, (int, float)) and not isinstance(widths, bool):
            widths = [widths] * p
        if not isinstance(widths, Sequence) or len(widths) != p:
            raise ValueError(f"widths must be a positive float or {p} positive floats")
        widths = [check_float(w, "widths", minimum=0.0, strict_minimum=True) for w in widths]
        if estimators is None:
            estimators = ("positive",) * p + ("trig",)
        if isinstance(estimators, str) or not isinstance(estimators, Sequence):
            raise TypeError("estimators must be a sequence of names")
        if len(estimators) != p + 1:
            raise ValueError(f"estimators must have p + 1 = {p + 1} entries, got {len(estimators)}")
        self.estimators = tuple(check_choice(e, "estimators", _BASES) for e in estimators)
        self.lambda_estimator = check_choice(lambda_estimator, "lambda_estimator", _BASES)
        self.num_coefficients = p
        self.register_buffer("M", M.detach().to("cpu", torch.float32))
        self.register_buffer("widths", torch.tensor(widths, dtype=torch.float32))
        self._first_draw()

    @property
    def feature_dim(self) -> int:
        m, n, p = self.num_features, self.lambda_features, self.num_coefficients
        return 2 * m * (1 + 4 * p * n)

    def _draw(self, generator: torch.Generator) -> None:
        p = self.num_coefficients
        base = [self._directions(self.num_features, generator) for _ in range(p + 1)]
        lam = [self._directions(self.lambda_features, generator) for _ in range(p)]
        self._set_buffer("base_omega", torch.stack(base))
        self._set_buffer("lambda_omega", torch.stack(lam))

    def _features_for(self, x: torch.Tensor, role: str, stabilize: bool = False) -> torch.Tensor:
        dt = x.dtype
        return gaussian_hybrid_features(
            self._scaled(x),
            self.base_omega.to(dt),
            self.lambda_omega.to(dt),
            self.M.to(dt),
            self.widths.to(dt),
            role,
            estimators=self.estimators,
            lambda_estimator=self.lambda_estimator,
            stabilize=stabilize,
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, lambda_features={self.lambda_features}, "
            f"p={self.num_coefficients}, estimators={self.estimators}, "
            f"lambda_estimator={self.lambda_estimator!r}"
        )
