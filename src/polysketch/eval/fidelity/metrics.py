"""Fidelity metrics of an approximate kernel matrix A against the exact one E.

For queries Q: (Nq, D) and keys K: (Nk, D) (any leading dims, e.g. heads, are allowed and
treated as a batch), a feature map gives the approximate kernel matrix
``A = φq(Q) φk(K)ᵀ`` (squared elementwise for ``square`` maps) and its ``target_kernel``
gives the exact matrix ``E`` (for polynomial maps ``E = (Q Kᵀ)^{∘p}``); ``kernel_matrices``
returns both. Metrics:

- relative Frobenius error ``‖A − E‖_F / ‖E‖_F``;
- RMAE, LLoPS Eq. 21: ``mean_ij |E_ij − A_ij| / |E_ij|``;
- max relative error ``max_ij |E_ij − A_ij| / |E_ij|``.

**Denominator guard.** Eq. 21 divides by the exact score. For data whose scores have a
density at zero (e.g. Gaussian q, k) the expectation of Eq. 21 is infinite (∫ ds/|s| diverges
at s = 0), so the sample mean is dominated by the few pairs with the smallest |E_ij|. RMAE
and the max relative error therefore divide by ``max(|E_ij|, rel_floor · max_ij |E_ij|)``
(per matrix, ``rel_floor`` default 1e-3): pairs whose exact score is below 0.1% of the
largest score are measured relative to that floor. ``rel_floor=0`` gives Eq. 21 verbatim
(inf when some E_ij = 0 and A_ij ≠ 0).
"""

from __future__ import annotations

import math

import torch

from ..._checks import check_float, check_tensor
from ...features import FeatureMap
from ...features.optimal_rank import check_qk

__all__ = [
    "METRICS",
    "kernel_matrices",
    "relative_frobenius_error",
    "rmae",
    "max_relative_error",
]

METRICS = ("rel_frobenius", "rmae", "max_rel")


def _check_pair(approx, exact) -> tuple[torch.Tensor, torch.Tensor]:
    approx = check_tensor(approx, "approx")
    exact = check_tensor(exact, "exact")
    if approx.shape != exact.shape:
        raise ValueError(
            f"approx and exact must have the same shape, got {tuple(approx.shape)} "
            f"and {tuple(exact.shape)}"
        )
    return approx.to(torch.float64), exact.to(torch.float64)


@torch.no_grad()
def kernel_matrices(
    feature_map: FeatureMap, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, E) = (φq(Q)φk(K)ᵀ [squared if square], target_kernel(Q, K)), each (..., Nq, Nk)."""
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a FeatureMap, got {type(feature_map).__name__}")
    q, k = check_qk(q, k)
    return feature_map.approx_kernel(q, k), feature_map.target_kernel(q, k)


def relative_frobenius_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """‖A − E‖_F / ‖E‖_F over all entries (and leading dims); 0/0 = 0, x/0 = inf."""
    approx, exact = _check_pair(approx, exact)
    num, den = float((approx - exact).norm()), float(exact.norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _relative_entries(approx, exact, rel_floor) -> torch.Tensor:
    """|A − E| / max(|E|, rel_floor · max|E|), elementwise (see the module docstring)."""
    approx, exact = _check_pair(approx, exact)
    rel_floor = check_float(rel_floor, "rel_floor", minimum=0.0)
    mag = exact.abs()
    floor = rel_floor * float(mag.max()) if mag.numel() else 0.0
    err = (approx - exact).abs()
    den = mag.clamp_min(floor)
    # 0/0 (exact zero score reproduced exactly) counts as no error.
    return torch.where(err == 0, torch.zeros_like(err), err / den)


def rmae(approx: torch.Tensor, exact: torch.Tensor, *, rel_floor: float = 1e-3) -> float:
    """Relative mean absolute error, LLoPS Eq. 21: mean_ij |E_ij − A_ij| / |E_ij|.

    approx, exact: (..., Nq, Nk). The denominator is guarded by ``rel_floor`` (module
    docstring); ``rel_floor=0`` is Eq. 21 verbatim.
    """
    return float(_relative_entries(approx, exact, rel_floor).mean())


def max_relative_error(
    approx: torch.Tensor, exact: torch.Tensor, *, rel_floor: float = 1e-3
) -> float:
    """max_ij |E_ij − A_ij| / max(|E_ij|, rel_floor · max|E|): the worst guarded entry."""
    return float(_relative_entries(approx, exact, rel_floor).max())
