"""Factorized Polynomial Attention (FPA): an exact degree-n kernel with a tunable state size.

FPA paper (factorized-polynomial-attention.md, §"The FPA Kernel"): project z ∈ R^D into n
branches z^{(l)} = W^{(l)} z ∈ R^{d_l} and take their Kronecker product,

    φ_FPA(z) = ⊗_{l=1..n} W^{(l)} z ∈ R^F,  F = ∏_l d_l,

so that (§"Relationship to Linear Attention")

    φ_FPA(q)·φ_FPA(k) = ∏_{l=1..n} (W^{(l)} q)·(W^{(l)} k) = k_FPA(q, k).

Table 1 special cases: n = 1 is linear attention (up to W); W^{(l)} = I is power attention
(TPOW, ``tensor_power``); diagonal W^{(l)} = diag(w_l) gives G^{(l)} = diag(w_l²); coordinate
select / blocks pick subsets of coordinates; TSPOW (``symmetric_power``) is a sum of FPA heads
with fixed block masks (Appendix), built by ``tspow_maps``.

Shapes: x (..., D) -> (..., F); kernels (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from itertools import combinations_with_replacement

import numpy as np
import torch
import torch.nn.functional as nnf
from torch import nn

from .._checks import check_choice, check_int, check_positive_int, check_tensor
from ..random import gaussian, make_generator
from .base import FeatureMap, Fixed, Hyperparameter, register
from .exact import MAX_FEATURES, check_kernel_pair, kron_features

__all__ = ["PROJECTIONS", "FactorizedPolynomial", "tspow_weights", "tspow_maps"]

#: Built-in choices of the branch projections W^{(l)}.
PROJECTIONS = ("random", "identity", "diagonal", "block", "coordinate")

# how each projection is stored: dense (d_l, D) matrix, (D,) diagonal, or (d_l,) indices
_STORAGE = {
    "random": "dense",
    "identity": "dense",
    "weights": "dense",
    "diagonal": "diagonal",
    "block": "index",
    "coordinate": "index",
}


def _default_branch_dims(dim: int, degree: int, projection: str) -> list[int]:
    """D per branch, except block/coordinate: split D into n nearly equal parts (>= 1)."""
    if projection in ("block", "coordinate"):
        return [max(1, len(part)) for part in np.array_split(np.arange(dim), degree)]
    return [dim] * degree


def _infer_degree(branch_dims) -> int:
    """n when ``degree`` is not given: len(branch_dims) for a sequence of widths, else 2."""
    if (
        branch_dims is not None
        and not isinstance(branch_dims, (str, bool, int))
        and isinstance(branch_dims, Sequence)
        and len(branch_dims) > 0
    ):
        return len(branch_dims)
    return 2


def _check_branch_dims(branch_dims, dim: int, degree: int, projection: str) -> list[int]:
    if branch_dims is None:
        return _default_branch_dims(dim, degree, projection)
    if isinstance(branch_dims, bool):
        raise TypeError("branch_dims must be an int or a sequence of ints, got bool")
    if isinstance(branch_dims, int):
        branch_dims = [branch_dims] * degree
    if not isinstance(branch_dims, Sequence) or isinstance(branch_dims, str):
        raise TypeError(
            f"branch_dims must be an int or a sequence of ints, got {type(branch_dims).__name__}"
        )
    if len(branch_dims) != degree:
        raise ValueError(f"branch_dims must have degree={degree} entries, got {len(branch_dims)}")
    dims = [check_positive_int(d, f"branch_dims[{l}]") for l, d in enumerate(branch_dims)]
    if projection in ("identity", "diagonal") and any(d != dim for d in dims):
        raise ValueError(
            f"branch_dims must all equal dim={dim} for projection={projection!r}, got {dims}"
        )
    if projection in ("block", "coordinate") and any(d > dim for d in dims):
        raise ValueError(
            f"branch_dims must be <= dim={dim} for projection={projection!r}, got {dims}"
        )
    return dims


def _check_weights(weights, dim: int) -> list[torch.Tensor]:
    if isinstance(weights, torch.Tensor) or not isinstance(weights, Sequence):
        raise TypeError(f"weights must be a list of (d_l, D) tensors, got {type(weights).__name__}")
    if len(weights) == 0:
        raise ValueError("weights must hold at least one (d_l, D) tensor, got none")
    out = []
    for l, w in enumerate(weights):
        check_tensor(w, f"weights[{l}]", min_dim=2, last_dim=dim)
        if w.dim() != 2 or w.shape[0] < 1:
            raise ValueError(f"weights[{l}] must have shape (d_l, {dim}), got {tuple(w.shape)}")
        out.append(w.detach().clone())
    return out


@register("fpa")
class FactorizedPolynomial(FeatureMap):
    """φ(x) = ⊗_{l=1..n} W_l x, the exact map of k(x, y) = ∏_l (W_l x)·(W_l y) (FPA paper).

    F = ∏_l d_l. Each branch is one small matmul (or a gather / elementwise product for the
    parameter-free projections); the Kronecker product is built by repeated outer products
    with branch 1's index varying slowest (so ``projection="identity"`` gives exactly
    ``tensor_power``'s features, TPOW, Table 1 "Power attention").

    Args:
        dim: D, the input dimension.
        degree: n >= 1, the number of branches (kernel degree; default len(weights), else
            len(branch_dims) for a sequence of widths, else 2).
        branch_dims: the widths d_l: a sequence of n ints, or one int for every branch.
            Default D each; for "block"/"coordinate" D split into n nearly equal parts.
        projection: how W_l is built (default "random"):
            "random": Gaussian entries / √d_l, so E[W_lᵀ W_l] = I and E[k(x, y)] over one
            branch is x·y; drawn from ``seed=``/``generator=``; ``redraw_`` redraws it.
            "identity": W_l = I (d_l = D) — power attention (TPOW) of degree n.
            "diagonal": W_l = diag(w_l) with w_l = 1 at init (d_l = D), Table 1 "Diagonal
            factors" G_l = diag(w_l²); meant for ``trainable=True``.
            "block": W_l selects d_l contiguous coordinates starting after the previous
            branch's block (cyclically), so the blocks are disjoint when Σ d_l <= D
            (Table 1 "Orthogonal blocks" / "Coordinate select"); parameter-free.
            "coordinate": W_l selects a random subset of d_l coordinates (Table 1
            "Coordinate select"), drawn from ``seed=``/``generator=``; parameter-free.
        weights: instead of ``projection``, n user-given (d_l, D) tensors W_l; stored in the
            dtype given (float64 weights keep the fp64-exactness of e.g. ``tspow_maps``).
        trainable: if True the W_l (dense or diagonal) are ``nn.Parameter``s, else buffers.
            Not allowed with the parameter-free "block"/"coordinate". Trainable maps are not
            redrawn by ``redraw_`` (their random draw is only an initialization).
        square: effective features φ⊗φ; ``target_kernel`` becomes k(x, y)².
        seed, generator: the source of the random draw ("random", "coordinate"); if neither
            is given a seed is drawn from torch's global RNG. Ignored by the other projections.

    Shapes: ``query``/``key``: (..., D) -> (..., F).
    """

    kind = "exact"
    # the default projection ("random") is random; each instance sets its own ``is_random``
    is_random = True
    family = "polynomial"
    hyperparameters = {
        "degree": Hyperparameter(
            None, "n >= 1 branches (None: len(weights) or len(branch_dims) or 2)"
        ),
        "branch_dims": Hyperparameter(None, "the widths d_l (an int or n ints; None: D each)"),
        "projection": Hyperparameter(
            None, f"how W_l is built, one of {PROJECTIONS} (None: random)"
        ),
        "weights": Hyperparameter(None, "n user-given (d_l, D) matrices W_l instead of projection"),
        "trainable": Hyperparameter(False, "W_l are nn.Parameters (else buffers)"),
        "square": Hyperparameter(False, "score (φq·φk)², target k(x, y)²"),
        "seed": Hyperparameter(None, "seed of the random projections"),
        "generator": Hyperparameter(None, "torch.Generator for the draw (not with seed)"),
    }
    fixed = {"num_features": Fixed("feature_dim", "branch_dims (F = ∏ d_l, set it there)")}

    def __init__(
        self,
        dim: int,
        *,
        degree: int | None = None,
        branch_dims: int | Sequence[int] | None = None,
        projection: str | None = None,
        weights: Sequence[torch.Tensor] | None = None,
        trainable: bool = False,
        square: bool = False,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__(dim, square=square)
        if not isinstance(trainable, bool):
            raise TypeError(f"trainable must be a bool, got {type(trainable).__name__}")
        if weights is not None:
            if projection is not None:
                raise ValueError("pass either projection or weights, not both")
            given = _check_weights(weights, self.dim)
            if degree is not None and check_positive_int(degree, "degree") != len(given):
                raise ValueError(f"degree={degree} does not match len(weights)={len(given)}")
            projection = "weights"
            degree = len(given)
            dims = [w.shape[0] for w in given]
            if (
                branch_dims is not None
                and _check_branch_dims(branch_dims, self.dim, degree, projection) != dims
            ):
                raise ValueError(f"branch_dims={branch_dims} does not match weights rows {dims}")
        else:
            projection = check_choice(
                "random" if projection is None else projection, "projection", PROJECTIONS
            )
            if degree is None:  # a sequence of branch widths fixes n; otherwise n = 2
                degree = _infer_degree(branch_dims)
            degree = check_positive_int(degree, "degree")
            dims = _check_branch_dims(branch_dims, self.dim, degree, projection)
        if trainable and projection in ("block", "coordinate"):
            raise ValueError(
                f"trainable=True needs a parametrized projection; {projection!r} is "
                "parameter-free (use projection='diagonal' or 'random')"
            )
        feature_dim = math.prod(dims)
        if feature_dim > MAX_FEATURES:
            raise ValueError(
                f"branch_dims={dims} (degree={degree}) give feature_dim {feature_dim} > "
                f"{MAX_FEATURES} (2**24); use smaller branch_dims"
            )
        self.degree = degree
        self.branch_dims = dims
        self.projection = projection
        self.trainable = trainable
        self.is_random = projection in ("random", "coordinate") and not trainable
        self.nonnegative = square or (projection == "identity" and degree % 2 == 0)
        self._storage = _STORAGE[projection]

        if projection in ("random", "coordinate"):
            self._draw(make_generator(seed, generator))
        elif projection == "weights":
            for l, w in enumerate(given):
                self._store(f"weight_{l}", w)
        elif projection == "identity":
            for l in range(degree):
                self._store(f"weight_{l}", torch.eye(self.dim))
        elif projection == "diagonal":
            for l in range(degree):
                self._store(f"diag_{l}", torch.ones(self.dim))
        else:  # block: cyclic contiguous blocks, disjoint while Σ d_l <= D
            offsets = np.cumsum([0, *dims[:-1]])
            for l, (start, d) in enumerate(zip(offsets, dims, strict=True)):
                index = (int(start) + torch.arange(d)) % self.dim
                self.register_buffer(f"index_{l}", index)

    # ----- storage ----------------------------------------------------------------------
    def _store(self, name: str, value: torch.Tensor) -> None:
        """A parameter when ``trainable``, else a buffer (overwritten in place on redraw)."""
        if self.trainable:
            if name in self._parameters:
                with torch.no_grad():
                    self._parameters[name].copy_(value)
            else:
                self.register_parameter(name, nn.Parameter(value))
        else:
            self._set_buffer(name, value)

    def _draw(self, generator: torch.Generator) -> None:
        """Draw W_l ~ N(0, 1/d_l) entrywise ("random") or random subsets ("coordinate")."""
        for l, d in enumerate(self.branch_dims):
            if self.projection == "random":
                self._store(
                    f"weight_{l}", gaussian(d, self.dim, generator=generator) / math.sqrt(d)
                )
            else:
                subset = torch.randperm(self.dim, generator=generator)[:d].sort().values
                self._set_buffer(f"index_{l}", subset)

    def projections(self) -> list[torch.Tensor]:
        """The matrices W_l as dense (d_l, D) tensors (for inspection and tests)."""
        out = []
        for l in range(self.degree):
            if self._storage == "dense":
                out.append(getattr(self, f"weight_{l}"))
            elif self._storage == "diagonal":
                out.append(torch.diag(getattr(self, f"diag_{l}")))
            else:
                eye = torch.eye(self.dim, device=getattr(self, f"index_{l}").device)
                out.append(eye[getattr(self, f"index_{l}")])
        return out

    # ----- features and kernel ----------------------------------------------------------
    @property
    def feature_dim(self) -> int:
        return math.prod(self.branch_dims)

    def _branch(self, x: torch.Tensor, l: int) -> torch.Tensor:
        """z^{(l)} = W_l x: (..., D) -> (..., d_l), in x's dtype."""
        if self._storage == "dense":
            return nnf.linear(x, getattr(self, f"weight_{l}").to(x.dtype))
        if self._storage == "diagonal":
            return x * getattr(self, f"diag_{l}").to(x.dtype)
        return x[..., getattr(self, f"index_{l}")]

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        return kron_features([self._branch(x, l) for l in range(self.degree)])

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """∏_l (W_l x)·(W_l y), squared when ``square``.

        Shapes: x (..., Tx, D), y (..., Ty, D) -> (..., Tx, Ty).

        Computed factor by factor (the FPA paper's "parallel form": n small matmuls and an
        elementwise product), never forming the F-dimensional features.
        """
        x, y, out_dtype = check_kernel_pair(x, y, self.dim)
        k = None
        for l in range(self.degree):
            s = self._branch(x, l) @ self._branch(y, l).transpose(-1, -2)
            k = s if k is None else k * s
        return (k * k if self.square else k).to(out_dtype)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, degree={self.degree}, branch_dims={self.branch_dims}, "
            f"projection={self.projection!r}, trainable={self.trainable}"
        )


# ----- TSPOW as a sum of FPA heads (FPA paper, Appendix) ------------------------------------
def tspow_weights(
    dim: int, *, degree: int = 2, block_size: int = 2, compact: bool = True
) -> list[list[torch.Tensor]]:
    """The fixed FPA heads whose summed kernels give TSPOW: Σ_h k_FPA,h(x, y) = (x·y)^p.

    FPA paper, Appendix "TSPOW is a special case of FPA". Blocks S_h = {hb, ..., hb+b-1}
    (0-based, the last one shorter when b does not divide D), h = 0..m-1, m = ⌈D/b⌉.

    Degree 2 (the Appendix's construction, exactly): head h has n = 2 branches,
    W^{(1)}_h selects S_h ((|S_h|, D) identity rows) and W^{(2)}_h is the diagonal mask with
    1 on S_h, √2 on coordinates after S_h and 0 before it. Head h gives Σ_{i,j∈S_h} plus
    2·Σ_{i∈S_h, j after S_h} of q_i k_i q_j k_j, and the sum over heads is (q·k)².

    Degree p > 2 (our completion of the Appendix's sketch, which reduces to the above at
    p = 2): one head per non-decreasing block tuple t = (h_1 <= ... <= h_{p-1}); branch r < p
    selects S_{h_r}, branch 1 is scaled by √A; branch p keeps coordinates of blocks >= h_{p-1}
    with weight 1 on S_{h_{p-1}} and √(μ+1) after it, where μ is the multiplicity of h_{p-1}
    in t and A = p! / (∏_j μ_j! · (μ+1)). Each sorted full block tuple then carries its
    multinomial coefficient p!/∏ μ_j!, so the heads sum to (x·y)^p, without duplicates.

    With ``block_size=1`` and ``compact=True`` the heads' features, concatenated, are exactly
    ``symmetric_power``'s features in the same (lexicographic) order.

    Args:
        dim: D.
        degree: p >= 2.
        block_size: b >= 1 (the Appendix's first construction uses b = 2).
        compact: drop the zero rows of the last branch (shape (D - h_{p-1} b, D)); False keeps
            the Appendix's literal (D, D) diagonal mask. The kernels are identical.

    Returns:
        One list of p float64 matrices (d_l, D) per head (lexicographic order of t).
    """
    dim = check_positive_int(dim, "dim")
    degree = check_int(degree, "degree", minimum=2)
    block_size = check_positive_int(block_size, "block_size")
    if not isinstance(compact, bool):
        raise TypeError(f"compact must be a bool, got {type(compact).__name__}")
    block = torch.arange(dim) // block_size
    num_blocks = math.ceil(dim / block_size)
    eye = torch.eye(dim, dtype=torch.float64)
    heads = []
    for t in combinations_with_replacement(range(num_blocks), degree - 1):
        mult = Counter(t)
        last, mu = t[-1], mult[t[-1]]
        a = math.factorial(degree) // (math.prod(map(math.factorial, mult.values())) * (mu + 1))
        branches = [eye[block == h] for h in t]
        branches[0] = branches[0] * math.sqrt(a)
        scale = torch.full((dim,), math.sqrt(mu + 1), dtype=torch.float64)
        mask = torch.where(block == last, 1.0, scale) * (block >= last)
        final = torch.diag(mask)
        branches.append(final[block >= last] if compact else final)
        heads.append(branches)
    return heads


def tspow_maps(
    dim: int, *, degree: int = 2, block_size: int = 2, compact: bool = True
) -> nn.ModuleList:
    """TSPOW as FPA heads: a ``ModuleList`` of ``FactorizedPolynomial`` maps (fixed weights).

    Σ_h heads[h].approx_kernel(x, y) = (x·y)^p = ``symmetric_power``'s kernel; equivalently
    the concatenation of the heads' features is one exact feature map of (x·y)^p. See
    ``tspow_weights`` for the construction (FPA paper, Appendix) and the arguments.
    """
    heads = tspow_weights(dim, degree=degree, block_size=block_size, compact=compact)
    return nn.ModuleList(FactorizedPolynomial(dim, weights=w) for w in heads)
