"""Count Sketch and TensorSketch (Pham & Pagh 2013; see ``shared/papers/tensorsketch.md``).

Count Sketch with hash h: [D] -> [F] and signs s: [D] -> {±1}:

    (C x)_j = Σ_{i : h(i) = j} s(i) x_i,          E[⟨Cx, Cy⟩] = ⟨x, y⟩.

TensorSketch of degree p (tensorsketch.md, "General degree-p TensorSketch (Algorithm 1)"):
the Count Sketch of the tensor power x^{⊗p} under the composite hash
H(i_1..i_p) = Σ_l h_l(i_l) mod F and sign S = ∏_l s_l(i_l) is the circular convolution of p
independent Count Sketches, computed with the FFT:

    φ(x) = IFFT( FFT(C_1 x) ∘ … ∘ FFT(C_p x) ) ∈ R^F,

so that (Theorem 9) E[⟨φ(x), φ(y)⟩] = ⟨x, y⟩^p and
Var[⟨φ(x), φ(y)⟩] <= (3^p − 1)/F · ‖x‖^{2p} ‖y‖^{2p}. The inhomogeneous kernel (c + ⟨x, y⟩)^p
is sketched by appending √c to every vector (tensorsketch.md, "Inhomogeneous polynomial
kernel").
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._checks import check_feature_input, check_float, check_positive_int, compute_dtype
from ..random import make_generator, rademacher, randint
from .base import FeatureMap, Hyperparameter, register

__all__ = ["count_sketch", "CountSketch", "TensorSketch"]


def count_sketch(
    x: torch.Tensor, hashes: torch.Tensor, signs: torch.Tensor, num_features: int
) -> torch.Tensor:
    """Count Sketch (C x)_j = Σ_{i: h(i)=j} s(i) x_i along the last dim.

    Shapes: x (..., D); ``hashes`` (int64, values in [0, F)) and ``signs`` (±1) either (D,),
    giving (..., F), or (k, D) for k stacked independent sketches, giving (..., k, F).

    Implemented as one ``scatter_add`` on the last dim, the only path (it beats a dense
    one-hot matmul: ``docs/results/implementation_choices.md``).
    """
    signs = signs.to(x.dtype)
    lead = x.shape[:-1]
    if hashes.dim() == 1:
        src = x * signs
        index = hashes.expand_as(src)
        out = x.new_zeros(*lead, num_features)
    else:
        src = x.unsqueeze(-2) * signs  # (..., k, D)
        index = hashes.expand(*lead, *hashes.shape)
        out = x.new_zeros(*lead, hashes.shape[0], num_features)
    return out.scatter_add(-1, index, src)


class CountSketch(nn.Module):
    """Count Sketch C: R^D -> R^F, (C x)_j = Σ_{i: h(i)=j} s(i) x_i (tensorsketch.md).

    Unbiased for the dot product, E[⟨Cx, Cy⟩] = ⟨x, y⟩, with
    Var ≤ 2/F · ‖x‖² ‖y‖². A building block (not a registered feature map).

    Args:
        dim: D, the input dimension.
        num_features: F, the number of buckets.
        seed / generator: the source of the fully independent hash h (``hashes``, int64
            buffer of shape (D,)) and signs s (``signs``, float32 buffer of shape (D,)).

    Shapes: (..., D) -> (..., F), same dtype as the input.
    """

    def __init__(
        self,
        dim: int,
        num_features: int,
        *,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        self.dim = check_positive_int(dim, "dim")
        self.num_features = check_positive_int(num_features, "num_features")
        self.register_buffer("hashes", torch.empty(self.dim, dtype=torch.int64))
        self.register_buffer("signs", torch.empty(self.dim))
        self.redraw_(make_generator(seed, generator))

    @torch.no_grad()
    def redraw_(self, generator: torch.Generator | None = None) -> CountSketch:
        """Redraw h and s in place (from ``generator``, else a fresh seed). Returns ``self``."""
        g = make_generator(None, generator)
        hashes = randint(self.num_features, self.dim, generator=g)
        signs = rademacher(self.dim, generator=g)
        self.hashes = hashes.to(self.hashes.device)
        self.signs = signs.to(device=self.signs.device, dtype=self.signs.dtype)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = check_feature_input(x, self.dim, "x")
        out = count_sketch(x.to(compute_dtype(x.dtype)), self.hashes, self.signs, self.num_features)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_features={self.num_features}"


@register("tensorsketch")
class TensorSketch(FeatureMap):
    """TensorSketch: φ(x) = IFFT(∏_{l=1}^p FFT(C_l x̃)), unbiased for (c + ⟨x, y⟩)^p.

    x̃ = (x, √c) ∈ R^{D+1} (only when c > 0), C_1..C_p are independent Count Sketches
    R^{D+1} -> R^F (tensorsketch.md, Algorithm 1 and Theorem 9):

        E[φ(x)·φ(y)] = (c + x·y)^p,
        Var[φ(x)·φ(y)] ≤ (3^p − 1)/F · ‖x̃‖^{2p} ‖ỹ‖^{2p}.

    Shapes: (..., D) -> (..., F). Scores can be negative (``nonnegative`` is False).

    Args:
        dim: D, the input dimension.
        degree: p >= 1.
        num_features: F, the sketch size (default 256). Any F >= 1; the FFTs are real
            (``torch.fft.rfft``/``irfft`` with n = F), so the convolution is circular mod F.
        coef0: c >= 0 for the inhomogeneous kernel (c + x·y)^p (default 0).
        seed / generator: source of the hashes (``hashes``, int64 (p, D+1)) and signs
            (``signs``, float32 (p, D+1)); the last column serves the √c coordinate.

    Precision: the FFTs run in the compute dtype, i.e. fp32 for bf16/fp16 inputs (half FFTs
    are not used) and fp64 for fp64 inputs; the FFT round trip adds a relative error of a few
    ulps of that dtype times log F to the features.
    """

    kind = "unbiased"
    is_random = True
    family = "polynomial"
    hyperparameters = {
        "degree": Hyperparameter(2, "p >= 1, the polynomial degree"),
        "num_features": Hyperparameter(256, "F >= 1, the sketch size"),
        "coef0": Hyperparameter(0.0, "c >= 0 of the inhomogeneous kernel (c + x·y)^p"),
        "seed": Hyperparameter(None, "seed of the hashes and signs"),
        "generator": Hyperparameter(None, "torch.Generator for the draw (not with seed)"),
    }

    def __init__(
        self,
        dim: int,
        *,
        degree: int = 2,
        num_features: int = 256,
        coef0: float = 0.0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__(dim)
        self.degree = check_positive_int(degree, "degree")
        self.num_features = check_positive_int(num_features, "num_features")
        self.coef0 = check_float(coef0, "coef0", minimum=0.0)
        self._draw(make_generator(seed, generator))

    @property
    def feature_dim(self) -> int:
        return self.num_features

    def _draw(self, generator: torch.Generator) -> None:
        shape = (self.degree, self.dim + 1)
        self._set_buffer("hashes", randint(self.num_features, *shape, generator=generator))
        self._set_buffer("signs", rademacher(*shape, generator=generator))

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # T = 0 or B = 0: an empty output (the FFT refuses empty batches)
            return x.new_zeros(*x.shape[:-1], self.num_features)
        if self.coef0 > 0:
            const = x.new_full((*x.shape[:-1], 1), math.sqrt(self.coef0))
            sketches = count_sketch(
                torch.cat([x, const], dim=-1), self.hashes, self.signs, self.num_features
            )
        else:
            sketches = count_sketch(
                x, self.hashes[:, : self.dim], self.signs[:, : self.dim], self.num_features
            )
        spectra = torch.fft.rfft(sketches, n=self.num_features, dim=-1)  # (..., p, F//2+1)
        product = spectra[..., 0, :]
        for level in range(1, self.degree):  # loop over the degree only
            product = product * spectra[..., level, :]
        return torch.fft.irfft(product, n=self.num_features, dim=-1)

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(c + x·y)^p: (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty)."""
        x = check_feature_input(x, self.dim, "x")
        y = check_feature_input(y, self.dim, "y")
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError("x and y must have shape (..., T, D)")
        dtype = compute_dtype(x.dtype)
        dots = x.to(dtype) @ y.to(dtype).transpose(-1, -2)
        return ((self.coef0 + dots) ** self.degree).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, degree={self.degree}, coef0={self.coef0}"
