"""PolySketchFormer's learned sketch: a small network in place of the random sketch.

PolySketchFormer (``polysketchformer.md``) approximates degree-4 polynomial attention by a
degree-2 sketch followed by self-tensoring (§2.1, Theorem 2.5: scores ``(φ(q)·φ(k))²`` are
non-negative and imitate ``(q·k)^4``). Its learned variant replaces the random degree-2 sketch
``(xS_1) ∘ (xS_2)`` (Definition 2.4, TensorSRHT) by the product of two learned branches:

    φ(x) = √r · tanh( b1(x) ∘ b2(x) / √r ),      scores (φ(q)·φ(k))²,

where each branch is ``levels`` feed-forward sketch blocks
``LayerNorm(D_in) → Linear(D_in → e·r) → GELU → Linear(e·r → r)`` (no biases), the first
taking D and the later ones r. The tanh bounds each feature by √r, so a score is at most
``(r·r)² = r⁴`` regardless of the input's scale.

Initialization: every Linear weight is LeCun-normal, a normal of variance 1/fan_in truncated
at two standard deviations (flax's ``Dense`` default, which the public code uses). The scale
matters because the score is a degree-8 polynomial of the weights and competes with the 1
in the normalizer ``1 + Σ``: with LeCun-normal weights a block's outputs have RMS ≈ 0.65 on
LayerNorm'd inputs, φ has RMS ≈ 0.4 and a score averages ≈ 2 (D = 64, r = 32, e = 8), so
the offset holds ≈ 1% of a normalizer at T = 256. torch's default ``U(±1/√fan_in)`` has a
third of that variance per layer; over the four Linear layers of a branch φ falls to RMS
≈ 0.04, scores to ≈ 1e-4 and the offset holds ≈ 98% of every normalizer, so attention
starts switched off (measured in ``docs/quality_gap.md``).

Fitting (``fit``): a score is a degree-8 polynomial of the last-layer weights (two branches
multiplied, then φ·φ squared), and Adam moves every weight by about ``lr`` per step whatever
its fan-in n, so one step changes a layer's output by a relative ``≈ lr·n`` (weights start
with standard deviation ≈ 1/√n) and the scores by that to the 8th power. The learning rate
must therefore shrink like 1/n for the widest layer, n = e·r: ``fit`` defaults to
``lr = 1/(4·e·r)`` (on LayerNorm'd Gaussians with D = 64, r = 128, e = 8 a fixed
lr = 1e-2 multiplies the loss by 1.6e7 in its first step, and 30 steps later it is still
3e4 times the start; the default lowers it). ``fit`` also never returns a map that is worse on the
fitted data than the one it started from.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._checks import check_positive_int, check_tensor
from ..random import make_generator
from .base import FeatureMap, Hyperparameter, register
from .fitting import fit_kernel, flat_finite, keep_start_if_worse, kernel_loss, strided_rows

__all__ = ["LearnedPolySketch", "SketchBlock"]


_TRUNCATED_STD = 0.87962566103423978
"""Standard deviation of a standard normal truncated to [−2, 2] (flax's ``variance_scaling``
divides by it so that the truncated draw keeps the requested variance)."""


def lecun_normal(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """LeCun-normal weights for a (out, in) Linear: N(0, 1/in) truncated at ±2σ, variance 1/in.

    Drawn in float64 on the CPU, stored float32 (reproducible across devices).
    """
    draw = torch.empty(shape, dtype=torch.float64)
    torch.nn.init.trunc_normal_(draw, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=generator)
    return (draw * (shape[1] ** -0.5 / _TRUNCATED_STD)).to(torch.float32)


class SketchBlock(nn.Module):
    """``LayerNorm(D_in) → Linear(D_in → e·r, no bias) → GELU → Linear(e·r → r, no bias)``.

    Shapes: (..., D_in) -> (..., r). Weights are cast to the input dtype at use, so fp64
    inputs give fp64 outputs without converting the module.
    """

    def __init__(self, d_in: int, hidden: int, d_out: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_in)
        self.up = nn.Parameter(torch.zeros(hidden, d_in))
        self.down = nn.Parameter(torch.zeros(d_out, hidden))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """LayerNorm to identity; Linear weights LeCun-normal (``lecun_normal``, module doc)."""
        self.norm.reset_parameters()
        self.up.copy_(lecun_normal(tuple(self.up.shape), generator))
        self.down.copy_(lecun_normal(tuple(self.down.shape), generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        h = nn.functional.layer_norm(
            x,
            self.norm.normalized_shape,
            self.norm.weight.to(dt),
            self.norm.bias.to(dt),
            self.norm.eps,
        )
        h = nn.functional.gelu(h @ self.up.to(dt).T)
        return h @ self.down.to(dt).T


@register("learned_polysketch")
class LearnedPolySketch(FeatureMap):
    """PolySketchFormer's learned sketch (see the module docstring): (..., D) -> (..., r).

    ``φ(x) = √r · tanh(b1(x) ∘ b2(x) / √r)``, one module for queries and keys, ``square``
    (scores ``(φ(q)·φ(k))² ≥ 0``, ``state_dim = r²``). ``target_kernel`` is the polynomial
    ``(x·y)^degree`` (degree 4 by default) that the network is trained to imitate — a learned
    approximation, not an estimator: before training (or with ``fit``) its scores need not
    resemble the target at all.

    Args:
        dim: D. num_features: r ≥ 1 (default 32). expansion: e ≥ 1 (default 8).
        levels: blocks per branch ≥ 1 (default 2). degree: even target degree (default 4).
        seed, generator: make the initial weights reproducible.
    """

    kind = "learned"
    is_random = False
    family = "polynomial"
    hyperparameters = {
        "num_features": Hyperparameter(32, "r >= 1, the sketch size"),
        "expansion": Hyperparameter(8, "e >= 1, hidden width e·r of each block"),
        "levels": Hyperparameter(2, "blocks per branch >= 1"),
        "degree": Hyperparameter(4, "even degree of the target (x·y)^degree"),
        "seed": Hyperparameter(None, "seed of the initial weights"),
        "generator": Hyperparameter(None, "torch.Generator for the weights (not with seed)"),
    }
    fit_keywords = frozenset(
        {"degree", "steps", "lr", "batch", "seed", "generator", "progress", "check_rows"}
    )

    def __init__(
        self,
        dim: int,
        *,
        num_features: int = 32,
        expansion: int = 8,
        levels: int = 2,
        degree: int = 4,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__(dim, square=True, nonnegative=True)
        self.num_features = check_positive_int(num_features, "num_features")
        self.expansion = check_positive_int(expansion, "expansion")
        self.levels = check_positive_int(levels, "levels")
        self.degree = check_positive_int(degree, "degree")
        if self.degree % 2:
            raise ValueError(f"degree must be even (squared scores are >= 0), got {degree}")
        r, hidden = self.num_features, self.expansion * self.num_features

        def branch() -> nn.ModuleList:
            dims = [self.dim] + [r] * (self.levels - 1)
            return nn.ModuleList(SketchBlock(d, hidden, r) for d in dims)

        self.branch1 = branch()
        self.branch2 = branch()
        self.reset_parameters(seed=seed, generator=generator)

    @property
    def feature_dim(self) -> int:
        return self.num_features

    def reset_parameters(
        self, *, seed: int | None = None, generator: torch.Generator | None = None
    ) -> LearnedPolySketch:
        """Redraw every weight from ``seed``/``generator`` (reproducible); returns ``self``."""
        gen = make_generator(seed, generator)
        for block in [*self.branch1, *self.branch2]:
            block.reset_parameters(gen)
        return self

    @staticmethod
    def _run(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        for block in blocks:  # `levels` blocks: depth of the network, not tokens
            x = block(x)
        return x

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        root = math.sqrt(self.num_features)
        prod = self._run(self.branch1, x) * self._run(self.branch2, x)
        return torch.tanh(prod / root) * root

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``(x·y)^degree``: (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty)."""
        x = check_tensor(x, "x", min_dim=2, last_dim=self.dim)
        y = check_tensor(y, "y", min_dim=2, last_dim=self.dim)
        return (x @ y.transpose(-1, -2)) ** self.degree

    @property
    def fit_lr(self) -> float:
        """Default Adam learning rate of ``fit``: ``1/(4·e·r)`` (module docstring).

        The widest layer (``down``, fan-in n = e·r) then changes its output by a relative
        ≈ √3/4 per step at most, whatever the width.
        """
        return 0.25 / (self.expansion * self.num_features)

    def fit(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        degree: int | None = None,
        steps: int = 500,
        lr: float | None = None,
        batch: int | None = 1024,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        progress: bool | None = None,
        check_rows: int = 2048,
    ) -> list[float]:
        """Train the network to imitate ``target_kernel`` on samples (``fitting.fit_kernel``).

        Minimises ``‖S − A‖_F² / ‖A‖_F²`` (LLoPS Eq. 6, normalised) with Adam at
        ``lr`` (None: ``fit_lr`` = 1/(4·e·r), see the module docstring; other arguments
        as in ``fit_kernel``). The loss on the fitted data is measured before and after;
        if training made it worse, the initial parameters are restored (with a warning),
        so ``fit`` never ends worse than it started. q, k: (..., D); data with more than
        ``check_rows`` rows are checked on an evenly strided subset of that many rows.

        Returns: the loss before each step (``steps`` floats, as ``fit_kernel``).
        """
        q = flat_finite(q, "q", self.dim)
        k = flat_finite(k, "k", self.dim)
        if degree is not None:
            degree = check_positive_int(degree, "degree")
        check_rows = check_positive_int(check_rows, "check_rows")
        lr = self.fit_lr if lr is None else lr
        qc, kc = strided_rows(q, check_rows), strided_rows(k, check_rows)

        def train() -> list[float]:
            return fit_kernel(
                self, q, k, degree=degree, steps=steps, lr=lr, batch=batch, seed=seed,
                generator=generator, progress=progress,
            )  # fmt: skip

        return keep_start_if_worse(
            self,
            lambda: kernel_loss(self, qc, kc, degree),
            train,
            label=f"learned_polysketch.fit (lr={lr:g})",
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, expansion={self.expansion}, levels={self.levels}, "
            f"degree={self.degree}"
        )
