"""The Eckart–Young optimum a feature map of state size m is measured against.

LLoPS Thm 3.1 / Eq. 7: any m-dimensional feature map gives rank(φq φkᵀ) ≤ m, so no map with
state size m beats ``min_{rank ≤ m} ‖A − E‖_F = sqrt(Σ_{i>m} σ_i²)``, σ_i the singular values
of the exact kernel matrix E, reached by the truncated SVD ``U Σ_m Vᵀ``. Used by
``polysketch.eval.fidelity`` (which re-exports these names).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .._checks import check_positive_int, check_tensor

__all__ = [
    "OptimalError",
    "optimal_rank_approximation",
    "optimal_rank_error_of",
    "optimal_rank_error",
    "optimal_curve",
]


def check_qk(q, k) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate queries (..., Nq, D) and keys (..., Nk, D): tensors, same D and dtype."""
    q = check_tensor(q, "q", min_dim=2)
    k = check_tensor(k, "k", min_dim=2, last_dim=q.shape[-1])
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must have the same dtype, got {q.dtype} and {k.dtype}")
    return q, k


def polynomial_target(q: torch.Tensor, k: torch.Tensor, degree: int) -> torch.Tensor:
    """(Q Kᵀ)^{∘p}: q (..., Nq, D), k (..., Nk, D) -> (..., Nq, Nk) (LLoPS Eq. 22)."""
    q, k = check_qk(q, k)
    degree = check_positive_int(degree, "degree")
    return (q @ k.transpose(-1, -2)) ** degree


class OptimalError(NamedTuple):
    """The least Frobenius error of a rank-``rank`` approximation (LLoPS Eq. 7)."""

    absolute: float  # sqrt(Σ_{i>m} σ_i²)
    relative: float  # absolute / ‖E‖_F
    rank: int


def _singular_values(matrix: torch.Tensor) -> torch.Tensor:
    """σ_1 ≥ σ_2 ≥ ... of each (..., N, M) matrix, computed in float64."""
    return torch.linalg.svdvals(matrix.to(torch.float64))


def optimal_rank_approximation(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """Truncated SVD U Σ_m Vᵀ of ``matrix`` (..., N, M): the best rank-m approximation (Eq. 7).

    Returned in float64. By Thm 3.1 it is reached by the linear feature maps
    φq*(Q) = ψp(Q) W_Q*, φk*(K) = ψp(K) W_K* (Eq. 8).
    """
    matrix = check_tensor(matrix, "matrix", min_dim=2)
    rank = check_positive_int(rank, "rank")
    u, s, vh = torch.linalg.svd(matrix.to(torch.float64), full_matrices=False)
    m = min(rank, s.shape[-1])
    return (u[..., :m] * s[..., None, :m]) @ vh[..., :m, :]


def _tail_error(sv: torch.Tensor, rank: int) -> OptimalError:
    total = float(sv.square().sum())
    tail = float(sv[..., rank:].square().sum()) if rank < sv.shape[-1] else 0.0
    absolute = math.sqrt(tail)
    relative = absolute / math.sqrt(total) if total > 0 else 0.0
    return OptimalError(absolute, relative, rank)


def optimal_rank_error_of(matrix: torch.Tensor, rank: int) -> OptimalError:
    """Least ‖A − E‖_F over rank-m A for E = ``matrix`` (..., N, M): sqrt(Σ_{i>m} σ_i²).

    Eckart–Young (LLoPS §3.1): any m-dimensional feature map gives rank(φq φkᵀ) ≤ m, so no
    map with state size m does better. Leading dims are independent matrices (errors add in
    squares). Also returned relative to ‖E‖_F.
    """
    matrix = check_tensor(matrix, "matrix", min_dim=2)
    rank = check_positive_int(rank, "rank")
    return _tail_error(_singular_values(matrix), rank)


def optimal_rank_error(q: torch.Tensor, k: torch.Tensor, degree: int, rank: int) -> OptimalError:
    """The rank-m optimum (LLoPS Thm 3.1) for the polynomial kernel matrix (Q Kᵀ)^{∘p}.

    q: (..., Nq, D), k: (..., Nk, D). For a ``square`` map use rank = state_dim = F².
    """
    return optimal_rank_error_of(polynomial_target(q, k, degree), rank)


def optimal_curve(
    q: torch.Tensor, k: torch.Tensor, *, degrees: Sequence[int], ranks: Sequence[int]
) -> list[dict]:
    """Rows {"degree", "rank", "absolute", "relative"} of the optimum for (Q Kᵀ)^{∘p}.

    One SVD per degree, reused for every rank (for plotting the bound vs feature dim).
    """
    rows = []
    for degree in degrees:
        sv = _singular_values(polynomial_target(q, k, degree))
        for rank in ranks:
            opt = _tail_error(sv, check_positive_int(rank, "ranks"))
            rows.append(
                {
                    "degree": int(degree),
                    "rank": int(rank),
                    "absolute": opt.absolute,
                    "relative": opt.relative,
                }
            )
    return rows
