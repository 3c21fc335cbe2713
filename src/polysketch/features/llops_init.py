"""Closed-form, data-driven LLoPS factors: a low-rank bilinear form raised to the p-th power.

The LLoPS paper (``llops-learnable-polynomial-sketch.md``) shows that BASED's quadratic map
ψ2(Wx) is an LLoPS map (Eq. 20, ``llops.based_factors``): whenever queries and keys are
compressed linearly first, ``(q·k)^p ≈ (Aᵀq · Bᵀk)^p`` with A, B ∈ R^{D×s}, the right-hand
side is an *exact* polynomial kernel on R^s, and its monomial expansion

    (u·v)^p = Σ_{multisets a of size p from [s]}  c_a ∏_j u_{a_j} v_{a_j},
    c_a = p! / ∏_i m_i!   (m_i: how often index i occurs in a; the multinomial theorem)

has n = C(s + p − 1, p) terms. Each term is one rank-1 LLoPS column (Eq. 15 with t = 1):
``Θ_j[:, f] = c_a^{1/(2p)} A[:, a_j]`` for queries and the same with B for keys, so
``φQ(q)·φK(k) = (Aᵀq·Bᵀk)^p`` exactly with n ≤ F features (``monomial_factors``).

Theorem 3.1 says the best rank-F approximation of ``(QKᵀ)^{∘p}`` comes from a linear map of
``vec(q^{⊗p})``; LLoPS restricts each column to a product of p projections. The monomial
construction is such a product, and the remaining choice is (A, B). ``low_rank_bilinear``
takes the Eckart–Young optimum of the p = 1 problem, the A, B minimising
``‖QKᵀ − (QA)(KB)ᵀ‖_F`` over the samples: with Q = U_q S_q V_qᵀ, K = U_k S_k V_kᵀ and
``S_q V_qᵀ V_k S_k = W Σ Zᵀ``, ``A = V_q S_q⁻¹ W_s Σ_s^{1/2}``, ``B = V_k S_k⁻¹ Z_s Σ_s^{1/2}``.
Trained queries and keys are strongly anisotropic (on MQAR models 95–99% of their energy lies
in 16–22 directions), so this start is already close to the kernel: on q/k captured from
exact-polynomial MQAR models its RMAE (Eq. 21) was 20–200x lower than the default random start
after 300 Adam steps on Eq. 6. ``LLoPS.init_from_data_`` applies it; ``LLoPS.fit`` starts from
it by default.
"""

from __future__ import annotations

import itertools
import math

import torch

from .._checks import check_positive_int, check_tensor
from .fitting import flat_finite

__all__ = ["largest_rank", "low_rank_bilinear", "monomial_factors", "principal_directions"]


def largest_rank(num_features: int, degree: int, dim: int) -> int:
    """The largest s ≤ ``dim`` whose degree-p monomial count C(s + p − 1, p) fits in F."""
    num_features = check_positive_int(num_features, "num_features")
    degree = check_positive_int(degree, "degree")
    dim = check_positive_int(dim, "dim")
    s = 1
    while s < dim and math.comb(s + degree, degree) <= num_features:
        s += 1
    return s


def _samples(x, name: str, dim: int | None = None) -> torch.Tensor:
    return flat_finite(x, name, dim).to(torch.float64)


def _row_space(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x = U S Vᵀ -> (R = S Vᵀ, R⁺ = V S⁻¹) on the numerically nonzero singular values."""
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    keep = s > s.max() * max(x.shape) * torch.finfo(x.dtype).eps
    s, vh = s[keep], vh[keep]
    return s[:, None] * vh, vh.T / s


def low_rank_bilinear(q, k, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A, B (D, s) minimising ``‖Q Kᵀ − (Q A)(K B)ᵀ‖_F`` (module docstring), float64.

    Shapes: q (..., D), k (..., D) samples (leading dims flattened); s = min(rank, rank of
    Q Kᵀ), so A and B may have fewer than ``rank`` columns when the data have fewer
    directions. Cost O((N + M) D² + D³).
    """
    rank = check_positive_int(rank, "rank")
    q = _samples(q, "q")
    k = _samples(k, "k", q.shape[-1])
    r_q, r_q_pinv = _row_space(q)
    r_k, r_k_pinv = _row_space(k)
    w, sigma, zh = torch.linalg.svd(r_q @ r_k.T, full_matrices=False)
    s = min(rank, int((sigma > sigma.max() * 1e-12).sum())) if sigma.numel() else 0
    if s == 0:
        raise ValueError("q and k have no common directions (Q Kᵀ is zero)")
    root = sigma[:s].sqrt()
    return r_q_pinv @ w[:, :s] * root, r_k_pinv @ zh[:s].T * root


def principal_directions(x, rank: int) -> torch.Tensor:
    """U (D, s): the top-s right singular vectors of the samples x (..., D), float64; the
    shared-map (φQ = φK) choice A = B = U, so ``Uᵀq·Uᵀk`` is q·k projected on their span."""
    rank = check_positive_int(rank, "rank")
    x = _samples(x, "x")
    r, _ = _row_space(x)
    _, _, vh = torch.linalg.svd(r, full_matrices=False)
    return vh[: min(rank, vh.shape[0])].T


def monomial_factors(projection: torch.Tensor, degree: int) -> torch.Tensor:
    """LLoPS factors (p, D, n) with ``φ(x)·φ'(y) = (Aᵀx · Bᵀy)^p`` (module docstring).

    ``projection``: A (D, s); build the key factors from B with the same call (the columns
    enumerate the same multisets in the same order). n = C(s + p − 1, p).
    """
    a = check_tensor(projection, "projection", min_dim=2)
    if a.dim() != 2:
        raise ValueError(f"projection must have shape (D, s), got {tuple(a.shape)}")
    degree = check_positive_int(degree, "degree")
    combos = list(itertools.combinations_with_replacement(range(a.shape[1]), degree))
    index = torch.tensor(combos, device=a.device).T  # (p, n)
    counts = [math.prod(math.factorial(c.count(i)) for i in set(c)) for c in combos]
    weight = torch.tensor(
        [(math.factorial(degree) / m) ** (0.5 / degree) for m in counts],
        dtype=a.dtype,
        device=a.device,
    )
    return a[:, index].permute(1, 0, 2) * weight  # (p, D, n)
