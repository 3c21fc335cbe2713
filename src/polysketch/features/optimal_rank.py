"""The Eckart–Young optimum a feature map of state size m is measured against.

LLoPS Thm 3.1 / Eq. 7: any m-dimensional feature map gives rank(φq φkᵀ) ≤ m, so no map with
state size m beats ``min_{rank ≤ m} ‖A − E‖_F = sqrt(Σ_{i>m} σ_i²)``, σ_i the singular values
of the exact kernel matrix E, reached by the truncated SVD ``U Σ_m Vᵀ``. The one
implementation of this bound: ``features.llops.optimal_error`` (its Eq. 6 form) and
``polysketch.eval.fidelity`` (which re-exports these names) use it.

That bound is in-sample: the SVD sees the very matrix it approximates. ``fitted_optimum`` is
its out-of-sample counterpart, what a map can actually be fitted to do: Eq. 8's optimal linear
maps of ψ_p(x) = vec(x^{⊗p}), chosen by Eq. 7 on *fitting* samples, then applied to other
queries and keys. On the fitting samples no map fitted by Eq. 6 beats it (Thm 3.1; LLoPS is
a CP-factored linear map of ψ_p). On other samples it is the reference such a fit aims at, not
a bound: with fewer fitting vectors than dim ψ_p it interpolates them and can generalise worse
than a constrained map.
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
    "fitted_optimum",
    "fitted_optima",
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


def fitted_optima(
    q_fit: torch.Tensor,
    k_fit: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    degree: int,
    ranks: Sequence[int],
    rcond: float = 1e-12,
) -> list[torch.Tensor]:
    """``fitted_optimum`` for each rank in ``ranks``, sharing the Gram eigendecompositions and
    the SVD (one fit, truncated per rank). Returns one (Nq, Nk) float64 tensor per rank.

    ψ_p(Q) W_Q* (ψ_p(K) W_K*)ᵀ: Eq. 8's rank-m linear maps fitted on (q_fit, k_fit) by Eq. 7.

    With X = ψ_p(Q_fit), Y = ψ_p(K_fit) and A = X Yᵀ = (Q_fit K_fitᵀ)^{∘p}, the pair
    (W_Q, W_K) minimising ‖X W_Q W_Kᵀ Yᵀ − A‖_F over rank m (minimum norm) is, with the thin
    SVDs X = U_x S_x V_xᵀ, Y = U_y S_y V_yᵀ and U_xᵀ A U_y = W Σ Zᵀ,
    W_Q = V_x S_x⁻¹ W_m Σ_m^{1/2}, W_K = V_y S_y⁻¹ Z_m Σ_m^{1/2}
    (``features.llops_init.low_rank_bilinear`` on ψ_p). ψ_p never has to be formed: with the
    Gram matrix X Xᵀ = (Q_fit Q_fitᵀ)^{∘p} = U_x S_x² U_xᵀ, V_x = Xᵀ U_x S_x⁻¹, so
    ψ_p(q) W_Q = (q Q_fitᵀ)^{∘p} U_x S_x⁻² W_m Σ_m^{1/2} (and the same for keys): any p, any
    D, cost O(N² (D + N)) for N fitting samples. Eigenvalues of the Gram matrices below
    ``rcond`` × the largest are dropped (the lifted samples' numerical rank).

    Shapes: q_fit (N, D), k_fit (M, D), q (Nq, D), k (Nk, D) (leading dims flattened) ->
    (Nq, Nk), float64. When (q, k) = (q_fit, k_fit) this is the truncated SVD of A
    (``optimal_rank_approximation``).
    """
    degree = check_positive_int(degree, "degree")
    ranks = [check_positive_int(r, "rank") for r in ranks]
    q_fit = check_tensor(q_fit, "q_fit", min_dim=1)
    dim = q_fit.shape[-1]
    k_fit = check_tensor(k_fit, "k_fit", min_dim=1, last_dim=dim)
    q = check_tensor(q, "q", min_dim=1, last_dim=dim)
    k = check_tensor(k, "k", min_dim=1, last_dim=dim)
    q_fit, k_fit, q, k = (x.reshape(-1, dim).to(torch.float64) for x in (q_fit, k_fit, q, k))

    def gram_basis(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """U_x and S_x² of X = ψ_p(x), from the Gram matrix (x xᵀ)^{∘p}."""
        evals, evecs = torch.linalg.eigh((x @ x.T) ** degree)
        keep = evals > evals.max().clamp_min(0.0) * rcond
        return evecs[:, keep], evals[keep]

    u_x, s2_x = gram_basis(q_fit)
    u_y, s2_y = gram_basis(k_fit)
    core = u_x.T @ (q_fit @ k_fit.T) ** degree @ u_y
    w, sigma, zh = torch.linalg.svd(core, full_matrices=False)
    lift_q = (q @ q_fit.T) ** degree @ (u_x / s2_x) @ w  # ψ_p(q) V_x S_x⁻¹ W: (Nq, r)
    lift_k = (k @ k_fit.T) ** degree @ (u_y / s2_y) @ zh.T  # (Nk, r)
    out = []
    for rank in ranks:
        m = min(rank, sigma.shape[0])
        out.append((lift_q[:, :m] * sigma[:m]) @ lift_k[:, :m].T)
    return out


def fitted_optimum(
    q_fit: torch.Tensor,
    k_fit: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    degree: int,
    rank: int,
    rcond: float = 1e-12,
) -> torch.Tensor:
    """ψ_p(Q) W_Q* (ψ_p(K) W_K*)ᵀ for one rank: ``fitted_optima`` (which documents the method)
    with ``ranks=[rank]``. Shapes: q_fit (N, D), k_fit (M, D), q (Nq, D), k (Nk, D) ->
    (Nq, Nk), float64; with (q, k) = (q_fit, k_fit) the truncated SVD of (Q_fit K_fitᵀ)^{∘p}."""
    return fitted_optima(q_fit, k_fit, q, k, degree=degree, ranks=[rank], rcond=rcond)[0]
