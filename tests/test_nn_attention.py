"""KernelAttention: shapes/dtypes, exact references, key padding, decode caches, RoPE, errors."""

import math

import pytest
import torch

from conftest import rel_err
from polysketch.nn import KernelAttention, RotaryEmbedding
from polysketch.ops import polynomial_attention, softmax_attention

E, H = 16, 2
D = E // H

ATTENTIONS = ["softmax", "polynomial", "psf_random", "psf_learned", "psf_mixed", "positive", "elu"]


def _layer(attention, **kw):
    torch.manual_seed(0)
    return KernelAttention(E, H, attention=attention, chunk_size=4, **kw).double()


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_shapes_and_dtypes(attention):
    layer = KernelAttention(E, H, attention=attention, chunk_size=4)
    x = torch.randn(2, 7, E)
    assert layer(x).shape == (2, 7, E) and layer(x).dtype == torch.float32
    assert layer.double()(x.double()).dtype == torch.float64
    layer.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    # bf16 autocast stays close to fp32 (attention core runs in fp32)
    assert rel_err(y.float(), layer(x)) < 5e-2


def _qkv(layer, x):
    q, k, v = layer.qkv(x).unflatten(-1, (3, H, D)).permute(2, 0, 3, 1, 4)
    if layer.q_norm is not None:
        q, k = layer.q_norm(q), layer.k_norm(k)
    if layer.rotary is not None:
        q, k = layer.rotary(q), layer.rotary(k)
    return q, k, v


def _finish(layer, o):
    return layer.out_proj(o.transpose(1, 2).flatten(-2))


def test_softmax_and_polynomial_match_references():
    x = torch.randn(2, 9, E, dtype=torch.float64)
    sm = _layer("softmax")
    q, k, v = _qkv(sm, x)
    ref = _finish(sm, softmax_attention(q, k, v, causal=True, scale=1 / math.sqrt(D)))
    assert rel_err(sm(x), ref) < 1e-12
    poly = _layer("polynomial")
    q, k, v = _qkv(poly, x)
    ref = polynomial_attention(q, k, v, degree=4, causal=True, denominator_offset=1.0)
    assert rel_err(poly(x), _finish(poly, ref)) < 1e-12


def test_exact_feature_map_equals_polynomial_preset():
    """tensor_power degree 2, squared, with LayerNorm and offset 1 is exact degree-4 attention."""
    x = torch.randn(2, 11, E, dtype=torch.float64)
    poly = _layer("polynomial")
    exact = _layer("tensor_power", degree=2, square=True)
    exact.load_state_dict(poly.state_dict())
    assert exact.q_norm is not None and exact.denominator_offset == 1.0
    assert rel_err(exact(x), poly(x)) < 1e-10


def test_polysketch_default_is_psf_random():
    a, b = _layer("polysketch"), _layer("psf_random")
    assert a.feature_map.square and a.feature_map.feature_dim == 32
    x = torch.randn(1, 6, E, dtype=torch.float64)
    assert torch.equal(a(x), b(x))


def test_softmax_maps_get_scale_and_no_norm():
    layer = _layer("positive")
    assert layer.q_norm is None and layer.denominator_offset == 0.0
    assert layer.feature_map.head_map(0).scale == pytest.approx(1 / math.sqrt(D))
    assert _layer("positive", scale=0.5).feature_map.head_map(0).scale == 0.5


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_key_padding_mask(attention):
    """Padded keys never matter: their content is irrelevant and removing them changes nothing."""
    layer = _layer(attention, rope=False)
    x = torch.randn(2, 9, E, dtype=torch.float64)
    keep = torch.ones(2, 9, dtype=torch.bool)
    pads = [1, 4]
    keep[0, pads] = False
    y = layer(x, key_padding_mask=keep)
    x2 = x.clone()
    x2[0, pads] = 100 * torch.randn(len(pads), E, dtype=torch.float64)
    y2 = layer(x2, key_padding_mask=keep)
    assert torch.allclose(y[keep], y2[keep], rtol=1e-10, atol=1e-12)
    assert torch.equal(y[1], y2[1])
    if attention != "psf_mixed":  # mixed blocks are absolute positions: removal shifts them
        real = layer(x[:1, keep[0]])
        assert rel_err(y[0, keep[0]], real[0]) < 1e-10


@pytest.mark.parametrize("attention", ATTENTIONS + ["tensor_power"])
def test_decode_cache_equals_full_forward(attention):
    """Prefill 5, then 3 tokens at once, then 1 by 1: equal to the full causal forward."""
    layer = _layer(attention)
    x = torch.randn(2, 13, E, dtype=torch.float64)
    full = layer(x)
    cache = layer.new_cache()
    parts = [layer(x[:, :5], cache=cache), layer(x[:, 5:8], cache=cache)]
    parts += [layer(x[:, t : t + 1], cache=cache) for t in range(8, 13)]
    assert cache.length == 13
    assert rel_err(torch.cat(parts, 1), full) < 1e-10
    assert cache.num_floats() == 2 * layer.decode_state_size(13)


def test_decode_state_size():
    lin, kv, mixed = _layer("psf_random"), _layer("softmax"), _layer("psf_mixed")
    fs = 32 * (32 // 2 + 1)  # the pair layout of a squared r = 32 sketch (ops.pairs)
    assert lin.decode_state_size(5) == lin.decode_state_size(500) == H * fs * (D + 1)
    assert kv.decode_state_size(10) == 2 * H * D * 10
    assert mixed.decode_state_size(9) == H * fs * (D + 1) + H * 1 * (2 * D + 32)


def test_checkpoint_same_values_and_grads():
    x = torch.randn(2, 9, E, dtype=torch.float64, requires_grad=True)
    for attention in ("psf_random", "psf_mixed"):
        a, b = _layer(attention), _layer(attention, checkpoint=True)
        ya, yb = a(x), b(x)
        assert torch.equal(ya, yb)
        ga = torch.autograd.grad(ya.square().sum(), [x, *a.parameters()])
        gb = torch.autograd.grad(yb.square().sum(), [x, *b.parameters()])
        for u, w in zip(ga, gb, strict=True):
            assert torch.allclose(u, w, rtol=1e-12, atol=1e-14)


def test_noncausal_linear_matches_naive():
    layer = _layer("tensor_power", degree=2, square=True, causal=False)
    ref = _layer("polynomial", causal=False)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(2, 7, E, dtype=torch.float64)
    assert rel_err(layer(x), ref(x)) < 1e-10


def test_rope_relative_and_offset():
    rope = RotaryEmbedding(7)  # odd D: the last coordinate is not rotated
    q, k = torch.randn(1, 5, 7, dtype=torch.float64), torch.randn(1, 5, 7, dtype=torch.float64)
    s0 = rope(q) @ rope(k).transpose(-1, -2)
    s3 = rope(q, 3) @ rope(k, 3).transpose(-1, -2)
    assert torch.allclose(s0, s3, rtol=1e-12, atol=1e-12)
    assert torch.allclose(rope(q).norm(dim=-1), q.norm(dim=-1), rtol=1e-12)
    assert torch.equal(rope(q)[..., -1], q[..., -1])
    full = rope(torch.cat([q, k], 1))
    assert torch.allclose(full[:, 5:], rope(k, 5), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(rope(k), rope(k, 5))


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="embed_dim"):
        KernelAttention(10, 3)
    with pytest.raises(ValueError, match="attention must be one of .*psf_random"):
        KernelAttention(E, H, attention="nope")
    with pytest.raises(ValueError, match="causal"):
        KernelAttention(E, H, attention="psf_mixed", causal=False)
    with pytest.raises(ValueError, match="map_kwargs"):
        KernelAttention(E, H, attention="softmax", num_features=3)
    with pytest.raises(ValueError, match="chunk_size"):
        KernelAttention(E, H, chunk_size=0)
    with pytest.raises(ValueError, match="num_features"):
        KernelAttention(E, H, attention="positive", num_features=0)
    with pytest.raises(TypeError, match="qk_norm"):
        KernelAttention(E, H, qk_norm="yes")
    layer = KernelAttention(E, H)
    with pytest.raises(ValueError, match="x"):
        layer(torch.randn(2, 5, E + 1))
    with pytest.raises(ValueError, match="key_padding_mask"):
        layer(torch.randn(2, 5, E), key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="cache"):
        layer(torch.randn(2, 5, E), cache=KernelAttention(E, H, attention="softmax").new_cache())


@pytest.mark.parametrize("attention", ["softmax", "polynomial", "psf_random", "psf_mixed"])
def test_decode_cache_with_key_padding(attention):
    layer = _layer(attention)
    x = torch.randn(2, 10, E, dtype=torch.float64)
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[0, [0, 6]] = False
    full = layer(x, key_padding_mask=keep)
    cache = layer.new_cache()
    parts = [layer(x[:, :5], key_padding_mask=keep[:, :5], cache=cache)]
    parts += [
        layer(x[:, t : t + 1], key_padding_mask=keep[:, t : t + 1], cache=cache)
        for t in range(5, 10)
    ]
    got = torch.cat(parts, 1)
    assert rel_err(got[keep], full[keep]) < 1e-10
