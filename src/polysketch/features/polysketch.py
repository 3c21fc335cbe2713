"""PolySketch: the polynomial-kernel sketch of Ahle et al. (2020) used by PolySketchFormer.

Paper: ``shared/papers/polysketchformer.md`` §2 (Def. 2.3 SRHT, Def. 2.4 TensorSRHT, Fig. 3
degree 2 and 4 trees, Thm 2.2), §2.1 (self-tensoring, Thm 2.5).

The sketch of x^{⊗p} is a complete binary tree with 2^q leaves, q = ⌈log2 p⌉:

* leaf l (l < p) is a base sketch of x; leaves l >= p sketch the fixed unit vector e1, so the
  tree sketches x^{⊗p} ⊗ e1^{⊗(2^q − p)}, whose inner products are still ⟨x, y⟩^p
  (Ahle et al.'s completion for p not a power of two);
* each internal node sketches the elementwise (tensor) product of its two children.

Every sketch maps to r = ``num_features`` coordinates. Two projections:

``"srht"`` (Def. 2.3–2.4), H the ±1 Walsh–Hadamard matrix of order n (a power of two), D
random ±1 diagonals, P an n×r matrix whose r columns are i.i.d. uniform coordinate vectors:

    leaf:  SRHT(x)       = √(1/r) · x D H P
    node:  TSRHT(u, v)   = √(1/r) · (u D1 H P1) ∘ (v D2 H P2)

``"gaussian"`` (G, G1, G2 with i.i.d. N(0, 1) entries):

    leaf:  √(1/r) · x G,          node:  √(1/r) · (u G1) ∘ (v G2).

``"product"`` (the public JAX code's form at p = 2: one node on x, no leaves; G_1 … G_p
i.i.d. N(0, 1) matrices of shape D×r):

    φ(x) = √(1/r) · (x G_1) ∘ (x G_2) ∘ … ∘ (x G_p),

E[φ(x)·φ(y)] = (1/r) Σ_j Π_i E[(x·g_ij)(y·g_ij)] = ⟨x, y⟩^p. It skips the tree's leaf
projections (whose own randomness adds variance) and costs one D×(p·r) GEMM per vector.

All three are unbiased at every node — E[⟨SRHT x, SRHT y⟩] = Σ_i x_i y_i E[H_{ji}²] = ⟨x, y⟩, and
the node's expectation factorizes over its independent children — so
E[φ(x)·φ(y)] = ⟨x, y⟩^p (conditioning bottom-up on the independent draws).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._checks import (
    check_choice,
    check_feature_input,
    check_float,
    check_positive_int,
    compute_dtype,
)
from ..random import gaussian, make_generator, rademacher, randint
from ._hadamard import hadamard_columns, next_power_of_two
from .base import FeatureMap, Hyperparameter, register

__all__ = ["PolySketch", "SketchLevel"]

PROJECTIONS = ("gaussian", "srht", "product")


class SketchLevel(NamedTuple):
    """One level of the sketch tree, bottom (leaves) first.

    nodes: sketches at this level; in_dim: the dim of each input (D for leaves, r for the
    two inputs of a node); hadamard_dim: the power of two the input is zero-padded to for
    SRHT (equal to in_dim for Gaussian); out_dim: r.
    """

    kind: str  # "leaf" or "node"
    nodes: int
    in_dim: int
    hadamard_dim: int
    out_dim: int


@register("polysketch")
class PolySketch(FeatureMap):
    """Random polynomial sketch φ: R^D -> R^r with E[φ(x)·φ(y)] = (x·y)^p (Ahle et al.).

    The tree of SRHT / TensorSRHT (Def. 2.3–2.4, Fig. 3) or Gaussian sketches described in
    the module docstring; see ``sketch_tree`` for its levels. Shapes: (..., D) -> (..., r).

    Normalization (why it differs from the public JAX code): every leaf and every node carries
    exactly one factor √(1/r), as Def. 2.3 and 2.4 do, which makes each level — and hence the
    whole degree-p estimate — UNBIASED: E[φ(x)·φ(y)] = (x·y)^p, so ``target_kernel`` is the
    mean of ``approx_kernel``. The public JAX code (google-research ``polysketchformer``) has
    no leaves and divides each of its two Gaussian matrices by √r, i.e. it uses
    (x G1/√r) ∘ (x G2/√r), whose mean is (x·y)²/r; a constant factor cancels in normalized
    attention, but it would make this map's ``target_kernel`` wrong by 1/r.

    Args:
        dim: D, the input (head) dimension. For ``"srht"`` a D that is not a power of two is
            zero-padded to the next power of two n (signs, Hadamard and sampled columns live
            in R^n; the padded rows never touch x), never refused.
        degree: p >= 1 (default 2). p that is not a power of two completes the tree with
            e1 leaves (see the module docstring).
        num_features: r, the sketch size (default 32, as in the paper's experiments). Any
            r >= 1; for ``"srht"`` node inputs (dim r) are zero-padded to the next power of
            two for the Hadamard transform, the output keeps r coordinates.
        projection: ``"gaussian"`` (default, as the paper's experiments), ``"srht"``, or
            ``"product"`` (the public code's one-node form, no tree; see the module
            docstring; measured lower variance than the tree on LayerNorm'd q/k,
            ``docs/quality_gap.md``). The public code divides each of its two matrices by
            √r, so its scores are ours / r (and / r² after self-tensoring): the same
            attention with a normalizer offset r² instead of 1.
        nonnegative: if True, the effective features are φ⊗φ (``square=True``): the score is
            (φ(q)·φ(k))² >= 0 and approximates (q·k)^{2p} (§2.1, Thm 2.5), so
            ``target_kernel`` becomes (x·y)^{2p}. This estimate is biased upward:
            E[(φx·φy)²] = (x·y)^{2p} + Var[φx·φy]; the instance ``kind`` is then
            ``"approximate"``.
        output_scale: c > 0 multiplying every feature (default 1): E[φx·φy] = c²(x·y)^p
            and ``target_kernel`` carries the same factor (c⁴ when ``nonnegative``). The
            public code's normalization is c = 1/√r; in attention with a normalizer offset
            (1 + Σ) or beside exact local scores (``psf_mixed``) the constant is not
            neutral: c = 1/√r weighs the sketched scores r² times less.
        seed / generator: source of the random buffers.

    Buffers (float32 / int64, cast to the input's compute dtype at use):
        gaussian: ``leaf_gaussian`` (L, D, r), ``node_gaussian`` (L − 1, 2, r, r);
        product: ``product_gaussian`` (p, D, r);
        srht: ``leaf_signs`` (L, n), ``leaf_columns`` (L, r), ``node_signs`` (L − 1, 2, n_r),
        ``node_columns`` (L − 1, 2, r), with L = 2^q leaves, n = next_pow2(D),
        n_r = next_pow2(r); internal nodes are stored level by level, bottom first.

    Cost per vector: O(D·r·L + r²·L) multiply-adds (the SRHT is applied as a matmul with the
    r sampled Hadamard columns, which measured faster than a fast Walsh–Hadamard transform
    for D, r <= 256; see ``_hadamard``).
    """

    kind = "unbiased"
    is_random = True
    family = "polynomial"
    hyperparameters = {
        "degree": Hyperparameter(2, "p >= 1, the sketched degree"),
        "num_features": Hyperparameter(32, "r >= 1, the sketch size"),
        "projection": Hyperparameter("gaussian", "'gaussian', 'srht' or 'product'"),
        "nonnegative": Hyperparameter(False, "self-tensored: score (φq·φk)², target (x·y)^{2p}"),
        "output_scale": Hyperparameter(1.0, "c > 0 multiplying every feature"),
        "seed": Hyperparameter(None, "seed of the random sketch"),
        "generator": Hyperparameter(None, "torch.Generator for the draw (not with seed)"),
    }

    def __init__(
        self,
        dim: int,
        *,
        degree: int = 2,
        num_features: int = 32,
        projection: str = "gaussian",
        nonnegative: bool = False,
        output_scale: float = 1.0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        if not isinstance(nonnegative, bool):
            raise TypeError(f"nonnegative must be a bool, got {type(nonnegative).__name__}")
        super().__init__(dim, square=nonnegative, nonnegative=nonnegative)
        self.degree = check_positive_int(degree, "degree")
        self.num_features = check_positive_int(num_features, "num_features")
        self.projection = check_choice(projection, "projection", PROJECTIONS)
        self.output_scale = check_float(output_scale, "output_scale", minimum=0.0,
                                        strict_minimum=True)  # fmt: skip
        if nonnegative:
            self.kind = "approximate"  # E[(φx·φy)²] = (x·y)^{2p} + Var: biased upward
        self.levels = math.ceil(math.log2(self.degree)) if self.degree > 1 else 0
        self.num_leaves = 2**self.levels
        self._draw(make_generator(seed, generator))

    # ----- structure -----------------------------------------------------------------------
    @property
    def feature_dim(self) -> int:
        return self.num_features

    @property
    def sketch_tree(self) -> tuple[SketchLevel, ...]:
        """The levels of the tree, leaves first: (kind, nodes, in_dim, hadamard_dim, out_dim)."""
        r, srht = self.num_features, self.projection == "srht"
        if self.projection == "product":  # one node multiplying p projections of x
            return (SketchLevel("product", self.degree, self.dim, self.dim, r),)
        tree = [
            SketchLevel(
                "leaf",
                self.num_leaves,
                self.dim,
                next_power_of_two(self.dim) if srht else self.dim,
                r,
            )
        ]
        for level in range(1, self.levels + 1):
            nodes = self.num_leaves >> level
            tree.append(SketchLevel("node", nodes, r, next_power_of_two(r) if srht else r, r))
        return tuple(tree)

    # ----- randomness ----------------------------------------------------------------------
    def _draw(self, generator: torch.Generator) -> None:
        leaves, nodes, r = self.num_leaves, self.num_leaves - 1, self.num_features
        if self.projection == "product":
            self._set_buffer(
                "product_gaussian", gaussian(self.degree, self.dim, r, generator=generator)
            )
        elif self.projection == "gaussian":
            self._set_buffer("leaf_gaussian", gaussian(leaves, self.dim, r, generator=generator))
            self._set_buffer("node_gaussian", gaussian(nodes, 2, r, r, generator=generator))
        else:
            n, n_r = next_power_of_two(self.dim), next_power_of_two(r)
            self._set_buffer("leaf_signs", rademacher(leaves, n, generator=generator))
            self._set_buffer("leaf_columns", randint(n, leaves, r, generator=generator))
            self._set_buffer("node_signs", rademacher(nodes, 2, n_r, generator=generator))
            self._set_buffer("node_columns", randint(n_r, nodes, 2, r, generator=generator))

    def sketch_matrices(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense sketch matrices without the √(1/r) factors, in ``dtype``.

        Returns (W_leaf (L, D, r), W_node (L − 1, 2, r, r)), so that a leaf is
        √(1/r)·x W_leaf[l] and a node is √(1/r)·(u W_node[k, 0]) ∘ (v W_node[k, 1]).
        SRHT: W = diag(signs) H[:, columns] restricted to the first D (resp. r) rows, which
        equals zero-padding the input to the Hadamard order (Def. 2.3–2.4). Not defined for
        ``"product"`` (no tree; its matrices are the buffer ``product_gaussian``).
        """
        if self.projection == "product":
            raise ValueError('sketch_matrices: projection="product" has no tree')
        if self.projection == "gaussian":
            return self.leaf_gaussian.to(dtype), self.node_gaussian.to(dtype)
        d, r = self.dim, self.num_features
        n, n_r = next_power_of_two(d), next_power_of_two(r)
        leaf = self.leaf_signs.to(dtype).unsqueeze(-1) * hadamard_columns(
            n, self.leaf_columns, dtype=dtype
        )
        node = self.node_signs.to(dtype).unsqueeze(-1) * hadamard_columns(
            n_r, self.node_columns, dtype=dtype
        )
        return leaf[..., :d, :], node[..., :r, :]

    # ----- features ------------------------------------------------------------------------
    def _features(self, x: torch.Tensor) -> torch.Tensor:
        z = self._sketch(x)
        return z if self.output_scale == 1.0 else z * self.output_scale

    def _sketch(self, x: torch.Tensor) -> torch.Tensor:
        """φ(x) / output_scale: (..., D) -> (..., r); one matmul for the leaves and the first
        node level, then one batched matmul per further level.

        The first node level only sees leaves, and a leaf is linear in x, so node k's factors
        u G_(k,0) = √(1/r)·x W_(2k) G_(k,0) come from one GEMM with the D×r matrices W G
        composed in advance (the e1 leaves l >= p give constant rows e1 W_l G). Exact
        algebra; the naive level-by-level tree is the reference in the tests.
        """
        p, r, leaves = self.degree, self.num_features, self.num_leaves
        if self.projection == "product":  # √(1/r) ∘_i (x G_i): one GEMM, then p − 1 products
            lead, d = x.shape[:-1], self.dim
            g = self.product_gaussian.to(x.dtype).transpose(0, 1).reshape(d, p * r)
            y = (x.reshape(-1, d) @ g).view(-1, p, r)
            z = y[:, 0] * (1.0 / math.sqrt(r))
            for i in range(1, p):
                z = z * y[:, i]
            return z.reshape(*lead, r)
        w_leaf, w_node = self.sketch_matrices(x.dtype)
        scale = 1.0 / math.sqrt(r)
        lead, n_rows = x.shape[:-1], math.prod(x.shape[:-1])
        flat = x.reshape(n_rows, self.dim)
        if leaves == 1:  # degree 1: the leaf alone
            return (flat @ w_leaf[0] * scale).reshape(*lead, r)
        count = leaves // 2
        # children (2k, 2k+1) of first-level node k: composed matrices (2·count, D, r)
        composed = w_leaf @ w_node[:count].reshape(2 * count, r, r)
        real = composed[:p].transpose(0, 1).reshape(self.dim, p * r)
        y = flat @ real  # (N, p·r): the children that are leaves of x
        if leaves > p:  # leaves of e1: constant rows e1 W_l G, the same for every x
            const = composed[p:, 0, :].reshape(1, (leaves - p) * r).expand(n_rows, -1)
            y = torch.cat([y, const], dim=-1)
        y = y.view(n_rows, count, 2, r)
        z = y[:, :, 0] * y[:, :, 1] * scale**3  # (N, count, r): level 1
        z = z.transpose(0, 1)  # (count, N, r): every further level is one batched GEMM
        offset = count
        while count > 1:  # the remaining q - 1 levels
            count //= 2
            w = w_node[offset : offset + count].reshape(2 * count, r, r)
            offset += count
            y = torch.bmm(z, w).view(count, 2, n_rows, r)  # children of node k: 2k, 2k+1
            z = y[:, 0] * y[:, 1] * scale
        return z[0].reshape(*lead, r)

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(x·y)^p, or (x·y)^{2p} when ``nonnegative``.

        Shapes: (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty).
        """
        x = check_feature_input(x, self.dim, "x")
        y = check_feature_input(y, self.dim, "y")
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError("x and y must have shape (..., T, D)")
        dtype = compute_dtype(x.dtype)
        dots = x.to(dtype) @ y.to(dtype).transpose(-1, -2)
        power = 2 * self.degree if self.square else self.degree
        factor = self.output_scale ** (4 if self.square else 2)
        out = dots**power
        return (out if factor == 1.0 else out * factor).to(x.dtype)

    def extra_repr(self) -> str:
        levels = []
        for lv in self.sketch_tree:
            inputs = str(lv.in_dim) if lv.kind != "node" else f"{lv.in_dim}⊗{lv.in_dim}"
            pad = f"(pad {lv.hadamard_dim})" if lv.hadamard_dim != lv.in_dim else ""
            levels.append(f"{lv.kind}×{lv.nodes}: {inputs}{pad}->{lv.out_dim}")
        return (
            f"{super().extra_repr()}, degree={self.degree}, projection={self.projection!r}, "
            + (f"output_scale={self.output_scale:g}, " if self.output_scale != 1.0 else "")
            + f"sketch_tree=[{'; '.join(levels)}]"
        )
