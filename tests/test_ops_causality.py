"""Causality: changing or scaling tokens after t leaves outputs at <= t bit-identical."""

import pytest
import torch

from polysketch import features, kernel_attention
from polysketch.ops import linear_attention

# (name, kwargs): feature maps applied per token, signed and non-negative, plain and squared
MAPS = [
    ("tensor_power", {"degree": 2}),
    ("tensor_power", {"degree": 1, "square": True}),
    ("polysketch", {"degree": 2, "num_features": 8, "seed": 0}),
    ("polysketch", {"degree": 2, "num_features": 8, "nonnegative": True, "seed": 0}),
    ("positive", {"num_features": 16, "seed": 0}),
    ("trig", {"num_features": 16, "seed": 0}),
    ("elu", {}),
]


def perturbed(x, t, how, factor=1e3):
    """x with every token after position t scaled by ``factor`` or replaced by fresh noise."""
    y = x.clone()
    if how == "scale":
        y[..., t + 1 :, :] *= factor
    else:
        g = torch.Generator().manual_seed(99)
        y[..., t + 1 :, :] = torch.randn(y[..., t + 1 :, :].shape, generator=g).to(y.dtype)
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name,kw", MAPS)
def test_feature_maps_are_causal(name, kw, dtype):
    fmap = features.create(name, 4, **kw).to(dtype)
    g = torch.Generator().manual_seed(1)
    q = (0.5 * torch.randn(2, 40, 4, generator=g)).to(dtype)
    k = (0.5 * torch.randn(2, 40, 4, generator=g)).to(dtype)
    v = torch.randn(2, 40, 3, generator=g).to(dtype)
    # trig's features carry exp(‖x‖²/2): future tokens scaled by 1e3 overflow them, and
    # kernel_attention now refuses that (features.stability); scale them by 4 instead.
    factor = 4.0 if name == "trig" else 1e3
    if name == "trig":
        with pytest.raises(ValueError, match="features of feature map 'trig' overflow"):
            kernel_attention(perturbed(q, 0, "scale"), perturbed(k, 0, "scale"), v, fmap,
                             causal=True, denominator_offset=1.0)  # fmt: skip
    for algorithm in ("chunked", "cumsum"):
        base = kernel_attention(
            q, k, v, fmap, causal=True, chunk_size=16, denominator_offset=1.0, algorithm=algorithm
        )
        for t in (0, 15, 16, 22):
            for how in ("scale", "noise"):
                out = kernel_attention(
                    perturbed(q, t, how, factor), perturbed(k, t, how, factor),
                    perturbed(v, t, how, factor), fmap, causal=True, chunk_size=16,
                    denominator_offset=1.0, algorithm=algorithm,
                )  # fmt: skip
                assert torch.equal(out[..., : t + 1, :], base[..., : t + 1, :])
                assert not torch.equal(out, base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_raw_signed_features_are_causal(normalize, square, dtype):
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(3, 50, 5, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(3, 50, 4, generator=g).to(dtype)
    for algorithm, chunk in (("chunked", 8), ("chunked", 50), ("chunked", 64), ("cumsum", 8)):
        kw = {"causal": True, "square": square, "normalize": normalize, "chunk_size": chunk,
              "algorithm": algorithm}  # fmt: skip
        base = linear_attention(q, k, v, **kw)
        for t in (0, 7, 8, 31):
            out = linear_attention(perturbed(q, t, "scale"), perturbed(k, t, "scale"),
                                   perturbed(v, t, "scale"), **kw)  # fmt: skip
            assert torch.equal(out[..., : t + 1, :], base[..., : t + 1, :])
