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

import json
import os
from collections.abc import Callable, Sequence

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


def rounding_sigma(
    exact_fn: Callable[[], torch.Tensor], *, like: torch.dtype = torch.float32, draws: int = 6
) -> torch.Tensor:
    """σ_t, how far rounding in ``like`` moves each row t (the last dim: a token's logits) of
    the value ``exact_fn()`` computes in fp64: the RMS, over ``draws`` runs of ``exact_fn``
    under ``BlasNoise`` at ``like``'s unit roundoff (each run another BLAS's summation orders),
    of ‖out_s,t − out_t‖, with the floor u ‖out_t‖ of one rounding of the row itself:

        σ_t² = (1/S) Σ_s ‖out_s,t − out_t‖² + (u ‖out_t‖)².

    A row whose value hangs on a cancelling sum (at random init, the first tokens' q·k after a
    LayerNorm, or a polynomial score of a small dot product) has a large σ_t: its error in any
    computation of ``like`` is a draw of that size, and dividing by σ_t takes the row's
    condition out of a comparison (``assert_as_accurate(..., sigma=)``). exact_fn runs in fp64
    and is called draws + 1 times. Returns (..., ) = the value's shape without its last dim."""
    from blas_noise import BlasNoise

    if draws < 5:
        raise ValueError(f"draws must be >= 5 (a finite variance of scaled errors), got {draws}")
    with torch.no_grad():
        base = exact_fn().double()
        acc = torch.zeros(base.shape[:-1], dtype=torch.float64)
        for s in range(draws):
            with BlasNoise(1_000_003 + s, unit_of=like):
                acc += (exact_fn().double() - base).pow(2).sum(-1)
        floor = unit_roundoff(like) * base.norm(dim=-1)
        return (acc / draws + floor.pow(2)).sqrt()


def per_token_in_other_shapes(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, extra: Sequence[int] = (0, 5, 11)
) -> list[torch.Tensor]:
    """fn(x) for a map that acts on each token (row of dim -2) alone, computed inside longer
    inputs: x followed by e more random tokens along dim -2, for each e in ``extra``, then cut
    back to x's tokens. The same values, summed in other shapes: references for
    ``assert_as_accurate`` where ``got`` rounds in another shape than fn(x)."""
    g = torch.Generator().manual_seed(54321)
    t = x.shape[-2]
    out = []
    with torch.no_grad():
        for e in extra:
            more = torch.randn(*x.shape[:-2], e, x.shape[-1], generator=g, dtype=torch.float64)
            out.append(fn(torch.cat([x, more.to(x.dtype)], dim=-2))[..., :t, :])
    return out


def relative_error(x: torch.Tensor, exact: torch.Tensor, norm: str = "max",
                   sigma: torch.Tensor | None = None) -> float:  # fmt: skip
    """The error of ``x`` against ``exact``, in fp64: max-abs over max |exact| (``norm="max"``),
    Frobenius over ‖exact‖ (``norm="fro"``), or, given ``sigma`` (``rounding_sigma``), the RMS
    over rows of ‖x_t − exact_t‖ / σ_t (``norm="sigma"``: in units of each row's rounding)."""
    if norm not in ("max", "fro", "sigma"):
        raise ValueError(f"norm must be 'max', 'fro' or 'sigma', got {norm!r}")
    d, e = x.detach().double() - exact.detach().double(), exact.detach().double()
    tiny = torch.finfo(e.dtype).tiny
    if norm == "max":
        return float(d.abs().max() / e.abs().max().clamp_min(tiny))
    if norm == "fro":
        return float(d.norm() / e.norm().clamp_min(tiny))
    if sigma is None or sigma.shape != e.shape[:-1]:
        raise ValueError(f"norm='sigma' needs sigma of shape {tuple(e.shape[:-1])}")
    return float((d.norm(dim=-1) / sigma.double().clamp_min(tiny)).pow(2).mean().sqrt())


def _record(got_err: dict, ref_err: dict, n_refs: int, factor: float, norm: str) -> None:
    """Appends one line per comparison to $POLYSKETCH_TEST_MARGINS (a JSON-lines file), with the
    errors in each norm: ``tests/numerics_margins.py`` tabulates them per branch."""
    path = os.environ.get("POLYSKETCH_TEST_MARGINS")
    if not path:
        return
    row = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0],
           "norm": norm, "factor": factor, "refs": n_refs,
           "got": got_err, "ref": ref_err}  # fmt: skip
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def assert_as_accurate(
    got: torch.Tensor,
    reference: torch.Tensor | Sequence[torch.Tensor],
    exact: torch.Tensor,
    *,
    factor: float = 2.0,
    norm: str = "max",
    sigma: torch.Tensor | Callable[[], torch.Tensor] | None = None,
) -> None:
    """flash-attention's rule for two ways of computing one value in the same dtype: the error
    of ``got`` against ``exact`` (an fp64 computation) is at most ``factor`` (2) times that of
    ``reference`` (the plain path, same dtype), plus one unit roundoff. Errors are relative:
    max-abs over max |exact| (``norm="max"``, for large tensors), or Frobenius over ‖exact‖
    (``norm="fro"``, steadier for small ones). Holds on every BLAS: both paths round by the
    same machine's arithmetic.

    Where ``got`` rounds in other shapes than the reference (a padded batch against the row
    alone, a decode step against the full forward, a joint call against separate ones), both
    errors are draws of one random variable, the orders a BLAS picks per shape, and a bound
    that rests on one draw fails whenever that draw is small (issue 69: a max-norm 2.04e-5
    against 4.32e-5 on one MKL path). There:

    * ``reference`` is several computations of the value in other shapes (a sequence, at least
      three): the yardstick is the largest of their errors, never one lucky draw;
    * ``sigma`` (``rounding_sigma``, or a callable returning it, called only when needed)
      measures each row's error in units of that row's own sensitivity to rounding
      (``norm="sigma"``). A few ill-conditioned rows (the first tokens of a random-init model)
      otherwise carry most of any plain norm, so that the ratio of two errors is the ratio of
      two single draws, which exceeds 2 often (``tests/numerics_margins.py`` shows it); in
      sigma units every row weighs alike and the RMS over many rows is steady. The unit
      roundoff term is then one rounding of each row in those units. With ``norm="fro"`` (or
      ``"max"``) and ``sigma`` given, the bound is: within ``factor`` in that norm, or, where
      it fails there, in sigma units (the same claim, stated where it is steady): sigma costs
      a few fp64 runs, paid only where the plain norm is carried by a few rows."""
    refs = [reference] if isinstance(reference, torch.Tensor) else list(reference)
    if not refs:
        raise ValueError("reference must hold at least one tensor")
    for r in refs:
        if r.shape != exact.shape or got.shape != exact.shape:
            raise ValueError(f"shapes {tuple(got.shape)} (got), {tuple(r.shape)} (a reference) "
                             f"and {tuple(exact.shape)} (exact) differ")  # fmt: skip
    if norm not in ("max", "fro", "sigma"):
        raise ValueError(f"norm must be 'max', 'fro' or 'sigma', got {norm!r}")
    if norm == "sigma" and sigma is None:
        raise ValueError("norm='sigma' needs sigma (numerics.rounding_sigma)")
    u = unit_roundoff(got.dtype)
    got_err = {n: relative_error(got, exact, n) for n in ("max", "fro")}
    ref_err = {n: max(relative_error(r, exact, n) for r in refs) for n in ("max", "fro")}
    checks = [] if norm == "sigma" else [norm]
    plain_ok = norm != "sigma" and got_err[norm] <= factor * ref_err[norm] + u
    if sigma is not None and (not plain_ok or os.environ.get("POLYSKETCH_TEST_MARGINS")):
        sig = sigma() if callable(sigma) else sigma
        got_err["sigma"] = relative_error(got, exact, "sigma", sig)
        ref_err["sigma"] = max(relative_error(r, exact, "sigma", sig) for r in refs)
        rows = exact.detach().double().norm(dim=-1)
        tiny = torch.finfo(torch.float64).tiny
        u_sigma = float((u * rows / sig.double().clamp_min(tiny)).pow(2).mean().sqrt())
        checks.append("sigma")
    _record(got_err, ref_err, len(refs), factor, norm)
    if plain_ok:
        return
    last = checks[-1]
    bound = factor * ref_err[last] + (u_sigma if last == "sigma" else u)
    tried = " and ".join(f"{n}: {got_err[n]:.3g} vs {ref_err[n]:.3g}" for n in checks)
    largest = f", largest of {len(refs)}" if len(refs) > 1 else ""
    assert got_err[last] <= bound, (
        f"error {got_err[last]:.3g} > {factor:g} x {ref_err[last]:.3g} (the reference path's"
        f"{largest}) + u ({last} norm; {tried})"
    )
