"""Rounding-error bounds for tests that compare two float computations summing in other orders.

Standard first-order analysis (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3):
with unit roundoff u = eps/2 of the working dtype, a sum of n products computed in any order
satisfies

    |fl(Σ_i a_i b_i) − Σ_i a_i b_i| <= γ_n Σ_i |a_i b_i|,      γ_n = n u / (1 − n u).

Two computations of the same value in different orders (two BLAS kernels, a joint call against
separate ones, a decode step against the full forward) therefore differ by at most the sum of
their two bounds. These helpers turn that into per-element tolerances, so that a test's
tolerance follows from the dtype and the sizes instead of from what one machine printed
(``blas_noise.py`` is how the suite checks that it does).
"""

from __future__ import annotations

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2 of a floating dtype (fp32: 5.96e-8; bf16: 3.9e-3; fp64: 1.1e-16)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """γ_n = n u / (1 − n u): the relative bound of an n-term sum of products in ``dtype``."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"n u = {nu:.3g} >= 1: no first-order bound for n = {n} in {dtype}")
    return nu / (1 - nu)


def matmul_error_bound(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise bound on |fl(A B) − A B| for a product computed in ``dtype``:
    γ_K (|A| |B|), K = A.shape[-1]; computed in fp64. a (..., M, K), b (..., K, N)."""
    k = a.shape[-1]
    return gamma(k, dtype) * (a.double().abs() @ b.double().abs())


def linear_attention_error_bound(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    dtype: torch.dtype,
    causal: bool = True,
    square: bool = False,
    denominator_offset: float = 0.0,
) -> torch.Tensor:
    """Elementwise first-order bound on |out − out_exact| for normalized linear attention
    out_i = N_i / Z_i, N_i = Σ_j s_ij v_j, Z_i = offset + Σ_j s_ij, s_ij = φq_i·φk_j (squared
    when ``square``), computed from the given features in ``dtype`` in any order (any block
    size, scan or state form: every order sums the same products):

        |δN_i| <= γ_n Σ_j S̄_ij |v_j|,   |δZ_i| <= γ_n (|offset| + Σ_j S̄_ij),
        |δout_i| <= (|δN_i| + |out_i| |δZ_i|) / |Z_i| + u |out_i|,

    with S̄_ij = |φq_i|·|φk_j| (squared when ``square``) and n = F + T + 2 (2F + T + 2 when
    square: the pair features of a squared score). Where Z_i nearly cancels (signed maps) the
    bound grows as Σ_j S̄_ij / |Z_i|, the normalizer's condition number, as the error does.
    phi_q (..., Tq, F), phi_k (..., Tk, F), v (..., Tk, E) -> (..., Tq, E), fp64.
    """
    q, k, val = phi_q.double(), phi_k.double(), v.double()
    tq, tk, f = q.shape[-2], k.shape[-2], q.shape[-1]
    s = q @ k.transpose(-1, -2)
    sbar = q.abs() @ k.abs().transpose(-1, -2)
    if square:
        s, sbar = s * s, sbar * sbar
    if causal:
        keep = torch.ones(tq, tk, dtype=torch.bool, device=s.device).tril(tk - tq)
        s, sbar = (torch.where(keep, x, x.new_zeros(())) for x in (s, sbar))
    z = denominator_offset + s.sum(-1, keepdim=True)
    out = (s @ val) / z
    n = (2 * f if square else f) + tk + 2
    g = gamma(n, dtype)
    dn = g * (sbar @ val.abs())
    dz = g * (abs(denominator_offset) + sbar.sum(-1, keepdim=True))
    return (dn + out.abs() * dz) / z.abs() + unit_roundoff(dtype) * out.abs()


def assert_as_accurate(
    got: torch.Tensor,
    reference: torch.Tensor,
    exact: torch.Tensor,
    *,
    factor: float = 2.0,
    norm: str = "max",
) -> None:
    """flash-attention's rule for two ways of computing one value in the same dtype: the error
    of ``got`` against ``exact`` (an fp64 computation) is at most ``factor`` (2) times that of
    ``reference`` (the plain path, same dtype), plus one unit roundoff. Errors are relative:
    max-abs over max |exact| (``norm="max"``, for large tensors), or Frobenius over ‖exact‖
    (``norm="fro"``, steadier for small ones). Holds on every BLAS: both paths round by the
    same machine's arithmetic."""

    def err(x: torch.Tensor) -> float:
        d, e = x.double() - exact.double(), exact.double()
        if norm == "max":
            return float(d.abs().max() / e.abs().max().clamp_min(torch.finfo(e.dtype).tiny))
        return float(d.norm() / e.norm().clamp_min(torch.finfo(e.dtype).tiny))

    err_got, err_ref = err(got), err(reference)
    u = unit_roundoff(got.dtype)
    assert err_got <= factor * err_ref + u, (
        f"error {err_got:.3g} > {factor:g} x {err_ref:.3g} (the reference path's) + u"
    )
