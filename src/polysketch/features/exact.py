"""Exact polynomial feature maps: the tensor power x^{⊗p} and its deduplicated form.

Both maps compute the (inhomogeneous) polynomial kernel exactly,

    k(x, y) = (c + x·y)^p = φ(x)·φ(y),

(PolySketchFormer §1: ⟨q^{⊗p}, k^{⊗p}⟩ = ⟨q, k⟩^p; TensorSketch paper, "inhomogeneous
polynomial kernel": append √c to x). ``tensor_power`` materializes all D^p monomials (the
TPOW map of power attention, FPA paper §Background); ``symmetric_power`` keeps one monomial
per multiset of indices, scaled by the square root of its multinomial coefficient (TSPOW),
so F = C(D+p-1, p) and the kernel is the same.

Shapes: x (..., D) -> (..., F); kernels (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from einops import einsum, rearrange

from .._checks import (
    check_feature_input,
    check_float,
    check_positive_int,
    compute_dtype,
)
from .base import FeatureMap, Fixed, Hyperparameter, register

__all__ = [
    "MAX_FEATURES",
    "TensorPower",
    "SymmetricPower",
    "kron_features",
    "multiset_table",
    "check_kernel_pair",
]

#: Largest feature dimension an exact map agrees to materialize (2**24 ≈ 16.8M per token).
MAX_FEATURES = 2**24


def kron_features(factors: list[torch.Tensor]) -> torch.Tensor:
    """Row-wise Kronecker product z_1 ⊗ z_2 ⊗ ... ⊗ z_n (FPA paper, φ_FPA).

    Args:
        factors: n tensors of shapes (..., d_l) with the same leading dims.

    Returns:
        (..., ∏ d_l); the index of z_1 varies slowest (row-major flattening of the outer
        product tensor), so ⟨⊗_l a_l, ⊗_l b_l⟩ = ∏_l ⟨a_l, b_l⟩.
    """
    out = factors[0]
    for z in factors[1:]:
        out = rearrange(einsum(out, z, "... i, ... j -> ... i j"), "... i j -> ... (i j)")
    return out


def check_kernel_pair(x, y, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """Validate the inputs of ``target_kernel``: x (..., Tx, D), y (..., Ty, D).

    Returns x and y cast to the common compute dtype, and the dtype to cast the result to.
    """
    x = check_feature_input(x, dim, "x")
    y = check_feature_input(y, dim, "y")
    if x.dim() < 2:
        raise ValueError(f"x must have shape (..., Tx, D), got shape {tuple(x.shape)}")
    if y.dim() < 2:
        raise ValueError(f"y must have shape (..., Ty, D), got shape {tuple(y.shape)}")
    out_dtype = torch.promote_types(x.dtype, y.dtype)
    dtype = compute_dtype(out_dtype)
    return x.to(dtype), y.to(dtype), out_dtype


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _check_size(num_features: int, what: str) -> int:
    if num_features > MAX_FEATURES:
        raise ValueError(
            f"{what} gives feature_dim {num_features} > {MAX_FEATURES} (2**24); reduce it "
            "or use a sketch (tensorsketch, polysketch)"
        )
    return num_features


def multiset_table(n: int, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """All multisets i_1 <= ... <= i_p of {0..n-1} and their multinomial coefficients.

    Returns:
        index: (C(n+p-1, p), p) int64, rows in lexicographic order.
        multinomial: (C(n+p-1, p),) int64, p! / ∏_j m_j! with m_j the multiplicity of j.

    Built column by column without Python loops over rows: each row ending in a is followed
    by the indices a, a+1, ..., n-1. The product ∏_j m_j! is ∏_k r_k where r_k counts how
    many equal indices end at column k (1 + r_{k-1} if i_k = i_{k-1}, else 1).
    """
    index = np.arange(n, dtype=np.int64)[:, None]
    for _ in range(degree - 1):
        last = index[:, -1]
        counts = n - last
        rows = np.repeat(np.arange(len(index)), counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        new = last[rows] + (np.arange(len(rows)) - starts)
        index = np.concatenate([index[rows], new[:, None]], axis=1)
    run = np.ones(len(index), dtype=np.int64)
    denominator = np.ones(len(index), dtype=np.int64)
    for k in range(1, degree):
        run = np.where(index[:, k] == index[:, k - 1], run + 1, 1)
        denominator *= run
    return index, math.factorial(degree) // denominator


class _PolynomialKernel(FeatureMap):
    """Shared parts of the exact maps: k(x, y) = (c + x·y)^p (squared when ``square``)."""

    kind = "exact"
    family = "polynomial"
    hyperparameters = {
        "degree": Hyperparameter(2, "p >= 1, the polynomial degree"),
        "coef0": Hyperparameter(0.0, "c >= 0 of the inhomogeneous kernel (c + x·y)^p"),
        "square": Hyperparameter(False, "score (φq·φk)², kernel (c + x·y)^{2p}"),
    }
    fixed = {"num_features": Fixed("feature_dim", "dim and degree (every monomial is kept)")}

    def __init__(self, dim: int, *, degree: int = 2, coef0: float = 0.0, square: bool = False):
        degree = check_positive_int(degree, "degree")
        coef0 = check_float(coef0, "coef0", minimum=0.0)
        _check_bool(square, "square")
        super().__init__(dim, square=square, nonnegative=square or degree % 2 == 0)
        self.degree = degree
        self.coef0 = coef0
        # the dimension of x̃ = (x, √c), TensorSketch paper "inhomogeneous polynomial kernel"
        self.lifted_dim = self.dim + (1 if self.coef0 > 0 else 0)

    def _lift(self, x: torch.Tensor) -> torch.Tensor:
        """x̃ = (x, √c): (..., D) -> (..., D+1) when c > 0, else x."""
        if self.coef0 == 0:
            return x
        pad = torch.full_like(x[..., :1], math.sqrt(self.coef0))
        return torch.cat([x, pad], dim=-1)

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(c + x·y)^p, squared when ``square``: (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty)."""
        x, y, out_dtype = check_kernel_pair(x, y, self.dim)
        k = (self.coef0 + x @ y.transpose(-1, -2)) ** self.degree
        return (k * k if self.square else k).to(out_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, degree={self.degree}, coef0={self.coef0}"


@register("tensor_power")
class TensorPower(_PolynomialKernel):
    """φ(x) = x̃^{⊗p} with x̃ = (x, √c): the exact map of (c + x·y)^p (TPOW).

    ⟨x^{⊗p}, y^{⊗p}⟩ = ⟨x, y⟩^p (PolySketchFormer §1; TensorSketch Eq. for x^{(p)}), and
    appending √c gives ⟨x̃, ỹ⟩ = c + x·y. F = D^p, or (D+1)^p when c > 0. Built by p-1
    repeated outer products, vectorized over the leading dims.

    Args:
        dim: D, the input dimension.
        degree: p >= 1 (default 2).
        coef0: c >= 0 (default 0, the homogeneous kernel (x·y)^p).
        square: if True the effective features are φ⊗φ (never materialized by the ops) and
            ``target_kernel`` is the squared kernel (c + x·y)^{2p} (PolySketchFormer's
            self-tensoring, which makes every score non-negative).

    Shapes: ``query``/``key``: (..., D) -> (..., F).
    """

    def __init__(self, dim: int, *, degree: int = 2, coef0: float = 0.0, square: bool = False):
        super().__init__(dim, degree=degree, coef0=coef0, square=square)
        _check_size(self.lifted_dim**self.degree, f"dim={self.dim}, degree={self.degree}")

    @property
    def feature_dim(self) -> int:
        return self.lifted_dim**self.degree

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        x = self._lift(x)
        return kron_features([x] * self.degree)


@register("symmetric_power")
class SymmetricPower(_PolynomialKernel):
    """Deduplicated exact map of (c + x·y)^p: one feature per multiset i_1 <= ... <= i_p.

    φ(x)_{i_1..i_p} = √(p! / ∏_j m_j!) · ∏_k x̃_{i_k}, with m_j the multiplicity of index j
    and x̃ = (x, √c). By the multinomial theorem, (x·y)^p = Σ_{multisets} p!/∏m_j! ∏_k
    x_{i_k} y_{i_k}, so φ(x)·φ(y) equals ``tensor_power``'s kernel with F = C(D'+p-1, p)
    instead of D'^p (D' = D, or D+1 when c > 0): the TSPOW map of [Gelada et al. 2025], see
    the FPA paper §Background and Appendix.

    The index table (F, p) and the integer multinomial coefficients (F,) are int64 buffers
    built once in ``__init__``; the square roots are taken in the compute dtype at use, so
    fp64 input gets fp64-exact coefficients whatever the module dtype.

    Args:
        dim: D, the input dimension.
        degree: p >= 1 (default 2).
        coef0: c >= 0 (default 0).
        square: effective features φ⊗φ; ``target_kernel`` becomes (c + x·y)^{2p}.

    Shapes: ``query``/``key``: (..., D) -> (..., F).
    """

    def __init__(self, dim: int, *, degree: int = 2, coef0: float = 0.0, square: bool = False):
        super().__init__(dim, degree=degree, coef0=coef0, square=square)
        n = self.lifted_dim
        what = f"dim={self.dim}, degree={self.degree}"
        num = _check_size(math.comb(n + self.degree - 1, self.degree), what)
        index, multinomial = multiset_table(n, self.degree)
        self._num_features = num
        self.register_buffer("index", torch.from_numpy(index))
        self.register_buffer("multinomial", torch.from_numpy(multinomial))

    @property
    def feature_dim(self) -> int:
        return self._num_features

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        x = self._lift(x)
        out = x[..., self.index[:, 0]]
        for k in range(1, self.degree):
            out = out * x[..., self.index[:, k]]
        return out * self.multinomial.to(x.dtype).sqrt()
