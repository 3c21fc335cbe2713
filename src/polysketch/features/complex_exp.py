"""Complex exponential (CE) random features for exp(scale · x·y) (HRF §2.3, Eq. 14–16).

For an invertible A ∈ C^{D×D} and ω_i ~ N(0, I_D), Lemma 2.4 (Eq. 13) gives (Eq. 14–15)

    SM(x, y) = E[Ψ_A(x)ᵀ Ψ_{(Aᵀ)^{-1}}(y)],
    Ψ_M(u) = k^{-1/2} exp(−(Mu)²/2) (exp(ω_1ᵀMu), ..., exp(ω_kᵀMu)),

where (v)² = Σ_j v_j² (no conjugation). The estimator Ψ_A(x)ᵀΨ_B(y) (Eq. 16) is complex in
general; its real part is real and unbiased. We compute it with REAL tensors: write a = Ψ_A(x),
b = Ψ_B(y); then Re(aᵀb) = Re a·Re b − Im a·Im b, so

    φq(x) = [Re a, Im a],   φk(y) = [Re b, −Im b],   φq·φk = Re(aᵀb).

With v = Mu = v_r + i v_i the exponent is
ωᵀv − v²/2 = (ωᵀv_r − (‖v_r‖² − ‖v_i‖²)/2) + i (ωᵀv_i − v_r·v_i), so a = exp(re)(cos im + i sin im).
A real-dtype A gives real features (the imaginary half is identically 0 and is dropped).

A = I reproduces positive random features and A = iI trigonometric ones: with the antithetic
rows [ω; −ω] (``antithetic=True``, default) the estimate is *identical* to ``positive`` /
``trig`` built on the same ω (for A = iI also without antithetic rows, up to its real part).
The variance vanishes when Re(A)x + Re((Aᵀ)^{-1})y = 0 and Im(A)x + Im((Aᵀ)^{-1})y = 0 (Eq. 18).
"""

from __future__ import annotations

import math

import torch

from .._checks import check_choice, check_finite, check_positive_int, check_tensor
from .base import Hyperparameter, register
from .random_features import SoftmaxRandomFeatureMap, _check_directions, stabilized_exp

__all__ = ["complex_exp_features", "key_matrix", "ComplexExpRandomFeatures"]


def key_matrix(
    a_real: torch.Tensor, a_imag: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Aᵀ)^{-1} for A = a_real + i·a_imag, as (real part, imaginary part or None).

    Real arithmetic only: the complex inverse is read off the inverse of the real 2D×2D
    embedding [[A_r, −A_i], [A_i, A_r]] = [[P_r, −P_i], [P_i, P_r]]^{-1} with P = A^{-1};
    then (Aᵀ)^{-1} = Pᵀ. Shapes (D, D) -> (D, D).
    """
    if a_imag is None:
        return torch.linalg.inv(a_real).transpose(-1, -2), None
    d = a_real.shape[-1]
    embed = torch.cat(
        [torch.cat([a_real, -a_imag], dim=-1), torch.cat([a_imag, a_real], dim=-1)], dim=-2
    )
    inv = torch.linalg.inv(embed)
    p_real, p_imag = inv[..., :d, :d], inv[..., d:, :d]
    return p_real.transpose(-1, -2), p_imag.transpose(-1, -2)


def _split_matrix(
    A: torch.Tensor | None, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    d = u.shape[-1]
    if A is None:
        return torch.eye(d, dtype=u.dtype, device=u.device), None
    check_tensor(A, "A", min_dim=2, floating=False)
    if tuple(A.shape) != (d, d):
        raise ValueError(f"A must have shape ({d}, {d}), got {tuple(A.shape)}")
    if A.is_complex():
        return A.real.to(u.dtype), A.imag.to(u.dtype)
    if not A.is_floating_point():
        raise TypeError(f"A must be a real or complex floating tensor, got {A.dtype}")
    return A.to(u.dtype), None


def complex_exp_projected(
    u: torch.Tensor,
    omega: torch.Tensor,
    m_real: torch.Tensor,
    m_imag: torch.Tensor | None,
    conjugate: bool,
    *,
    stabilize: bool = False,
) -> torch.Tensor:
    """Real features of Ψ_M(u) for M = m_real + i·m_imag (HRF Eq. 15), no validation.

    Shapes: u (..., T, D), omega (k, D) or batched (R, k, D), M (D, D) -> (..., T, 2k) laid out
    [Re Ψ, ±Im Ψ] (minus when ``conjugate``, i.e. for the key side), or (..., T, k) = Re Ψ when
    m_imag is None (real M, the imaginary part is 0). ``stabilize=True`` (queries) subtracts
    each row's largest log-modulus first (``random_features.stabilized_exp``): the row is
    multiplied by a positive factor and its largest |feature| is in [2^{-1/2}, 1].
    """
    k = omega.shape[-2]
    vr = u @ m_real.transpose(-1, -2)
    sq = (vr * vr).sum(-1, keepdim=True)
    re = vr @ omega.transpose(-1, -2)
    if m_imag is not None:
        vi = u @ m_imag.transpose(-1, -2)
        sq = sq - (vi * vi).sum(-1, keepdim=True)
    log_mod = re - 0.5 * sq - 0.5 * math.log(k)
    amp = stabilized_exp(log_mod) if stabilize else torch.exp(log_mod)
    if m_imag is None:
        return amp
    im = vi @ omega.transpose(-1, -2) - (vr * vi).sum(-1, keepdim=True)
    sin = torch.sin(im)
    return torch.cat([amp * torch.cos(im), amp * (-sin if conjugate else sin)], dim=-1)


def complex_exp_features(
    u: torch.Tensor,
    omega: torch.Tensor,
    A: torch.Tensor | None = None,
    role: str = "query",
) -> torch.Tensor:
    """Real CE features (HRF Eq. 14–16): φq = [Re Ψ_A(u), Im Ψ_A(u)], φk = [Re Ψ_B, −Im Ψ_B].

    Args:
        u: (..., T, D), already scaled (float32/float64).
        omega: (k, D) directions, or batched (R, k, D) broadcasting with u like matmul. Pass
            ``torch.cat([w, -w])`` for the antithetic construction.
        A: (D, D) real or complex tensor (``None`` = identity).
        role: ``"query"`` uses M = A, ``"key"`` uses M = (Aᵀ)^{-1} and the conjugated sign.

    Returns: (..., T, 2k) for complex-dtype A, (..., T, k) for real A (Re Ψ only, ≥ 0). For
    every ω, φq(x)·φk(y) = Re(Ψ_A(x)ᵀ Ψ_{(Aᵀ)^{-1}}(y)), unbiased for exp(x·y).
    """
    _check_directions(u, omega)
    role = check_choice(role, "role", ("query", "key"))
    m_real, m_imag = _split_matrix(A, u)
    if role == "key":
        m_real, m_imag = key_matrix(m_real, m_imag)
    return complex_exp_projected(u, omega, m_real, m_imag, conjugate=role == "key")


@register("complex_exp")
class ComplexExpRandomFeatures(SoftmaxRandomFeatureMap):
    """Complex exponential random features for exp(scale · x·y) (HRF Eq. 14–16), asymmetric.

    query(x) = [Re Ψ_A(u), Im Ψ_A(u)], key(y) = [Re Ψ_B(w), −Im Ψ_B(w)], B = (Aᵀ)^{-1},
    u = sqrt(scale)·x, w = sqrt(scale)·y, so query(x)·key(y) = Re of the CE estimator (Eq. 16).

    Keywords: ``A`` (D, D) real or complex, invertible (default identity); ``num_features`` m
    directions (default 4·D); ``antithetic`` (default True: rows [ω; −ω], k = 2m Ψ-entries,
    which makes A = I exactly FAVOR+ and A = iI exactly trig on the same ω); ``scale``,
    ``orthogonal``, ``seed``/``generator``.
    feature_dim F = k for a real-dtype A (features ≥ 0, ``nonnegative``), 2k for a complex A.
    Buffers: ``omega`` (m, D), ``A_real`` and ``A_imag`` (D, D); (Aᵀ)^{-1} is recomputed in
    the compute dtype at each call (a 2D×2D inverse).
    """

    hyperparameters = {
        **SoftmaxRandomFeatureMap.hyperparameters,
        "A": Hyperparameter(None, "(D, D) invertible real or complex matrix (None: identity)"),
        "antithetic": Hyperparameter(True, "use the rows [ω; −ω] (2m Ψ-entries)"),
    }

    def __init__(
        self,
        dim: int,
        *,
        A: torch.Tensor | None = None,
        antithetic: bool = True,
        **kwargs,
    ):
        dim = check_positive_int(dim, "dim")  # before torch.eye(dim) can fail on it
        if not isinstance(antithetic, bool):
            raise TypeError(f"antithetic must be a bool, got {type(antithetic).__name__}")
        if A is None:
            A = torch.eye(dim, dtype=torch.float64)
        check_tensor(A, "A", min_dim=2, floating=False)
        if not (A.is_complex() or A.is_floating_point()):
            raise TypeError(f"A must be a real or complex floating tensor, got {A.dtype}")
        if tuple(A.shape) != (dim, dim):
            raise ValueError(f"A must have shape ({dim}, {dim}), got {tuple(A.shape)}")
        A = A.detach().to("cpu", torch.complex128 if A.is_complex() else torch.float64)
        check_finite(torch.view_as_real(A) if A.is_complex() else A, "A")
        if torch.linalg.matrix_rank(A).item() < dim:
            raise ValueError("A must be invertible")
        is_complex = bool(A.is_complex())
        super().__init__(dim, default_num_features=4 * dim, nonnegative=not is_complex, **kwargs)
        self.is_complex = is_complex
        self.antithetic = antithetic
        self.register_buffer("A_real", (A.real if self.is_complex else A).to(torch.float32))
        self.register_buffer(
            "A_imag", (A.imag if self.is_complex else torch.zeros_like(A)).to(torch.float32)
        )
        self._first_draw()

    @property
    def feature_dim(self) -> int:
        k = 2 * self.num_features if self.antithetic else self.num_features
        return 2 * k if self.is_complex else k

    def _draw(self, generator: torch.Generator) -> None:
        self._set_buffer("omega", self._directions(self.num_features, generator))

    def _rows(self, dtype: torch.dtype) -> torch.Tensor:
        omega = self.omega.to(dtype)
        return torch.cat([omega, -omega]) if self.antithetic else omega

    def _matrices(self, dtype: torch.dtype, role: str):
        m_real = self.A_real.to(dtype)
        m_imag = self.A_imag.to(dtype) if self.is_complex else None
        return key_matrix(m_real, m_imag) if role == "key" else (m_real, m_imag)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        m_real, m_imag = self._matrices(x.dtype, "query")
        return complex_exp_projected(self._scaled(x), self._rows(x.dtype), m_real, m_imag, False)

    def _key(self, x: torch.Tensor) -> torch.Tensor:
        m_real, m_imag = self._matrices(x.dtype, "key")
        return complex_exp_projected(self._scaled(x), self._rows(x.dtype), m_real, m_imag, True)

    def _query_stabilized(self, x: torch.Tensor) -> torch.Tensor:
        m_real, m_imag = self._matrices(x.dtype, "query")
        u, rows = self._scaled(x), self._rows(x.dtype)
        return complex_exp_projected(u, rows, m_real, m_imag, False, stabilize=True)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, antithetic={self.antithetic}, complex={self.is_complex}"
