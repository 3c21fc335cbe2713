"""Short convolution and separate q/k and value sizes in KernelAttention / TransformerLM
(BASED / Zoology's model options): the convolution against its formula, causality, padding,
decoding in pieces, state sizes, and errors."""

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from polysketch.nn import KernelAttention, TransformerConfig, TransformerLM
from polysketch.nn.short_conv import ShortConv

E, H = 16, 2


def _conv(k=3, c=5):
    torch.manual_seed(0)
    return ShortConv(c, k).double()


def test_short_conv_matches_formula():
    conv = _conv(k=3, c=5)
    u = torch.randn(2, 7, 5, dtype=torch.float64)
    y, tail = conv(u)
    w, b = conv.weight[:, 0], conv.bias  # (C, K), (C,)
    padded = torch.cat([torch.zeros(2, 2, 5, dtype=torch.float64), u], dim=1)
    want = torch.stack(
        [(padded[:, t : t + 3] * w.T).sum(1) + b for t in range(7)], dim=1
    )  # y_t = Σ_i w_i u_{t-2+i} + b
    assert torch.allclose(y, F.silu(want), rtol=1e-12, atol=1e-12)
    assert torch.equal(tail, u[:, -2:])


def test_short_conv_causal_pieces_and_padding():
    conv = _conv(k=4, c=3)
    u = torch.randn(2, 11, 3, dtype=torch.float64)
    y, _ = conv(u)
    u2 = u.clone()
    u2[:, 6:] = torch.randn(2, 5, 3, dtype=torch.float64)
    assert torch.equal(conv(u2)[0][:, :6], y[:, :6])  # the future does not leak back
    parts, tail = [], None
    for lo, hi in [(0, 1), (1, 5), (5, 6), (6, 11)]:  # pieces shorter and longer than K - 1
        out, tail = conv(u[:, lo:hi], tail=tail)
        parts.append(out)
    assert torch.allclose(torch.cat(parts, 1), y, rtol=1e-12, atol=1e-12)
    keep = torch.ones(2, 11, dtype=torch.bool)
    keep[0, [2, 3]] = False
    u3 = u.clone()
    u3[0, [2, 3]] = 1e3
    assert torch.equal(conv(u3, keep=keep)[0], conv(u, keep=keep)[0])  # padded rows: zeros
    with pytest.raises(ValueError, match="tail"):
        conv(u, tail=torch.zeros(2, 2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="channels"):
        conv(torch.zeros(2, 4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="kernel_size"):
        ShortConv(3, 1)


def _layer(attention, **kw):
    torch.manual_seed(0)
    return KernelAttention(E, H, attention=attention, chunk_size=4, **kw).double()


@pytest.mark.parametrize(
    "attention,kw",
    [
        ("softmax", {"short_conv": 3}),
        ("polynomial", {"short_conv": 4, "qk_dim": 6}),
        ("psf_random", {"short_conv": 3}),
        ("psf_mixed", {"short_conv": 2, "qk_dim": 4}),
        ("taylor", {"short_conv": 3, "qk_dim": 4}),
        ("psf_random", {"value_dim": 3}),
        ("softmax", {"value_dim": 5, "short_conv": 3}),
        ("soft_hash_1k", {"value_dim": 3, "num_features": 6, "unit_directions": True}),
    ],
)
def test_decode_in_pieces_equals_full_forward(attention, kw):
    layer = _layer(attention, **kw)
    x = torch.randn(2, 13, E, dtype=torch.float64)
    full = layer(x)
    x2 = x.clone()
    x2[:, 9:] += 1.0
    assert torch.equal(layer(x2)[:, :9], full[:, :9])  # causal through the convolution
    cache = layer.new_cache()
    parts = [layer(x[:, :5], cache=cache), layer(x[:, 5:8], cache=cache)]
    parts += [layer(x[:, t : t + 1], cache=cache) for t in range(8, 13)]
    assert rel_err(torch.cat(parts, 1), full) < 1e-10
    assert cache.num_floats() == 2 * layer.decode_state_size(13)


def test_qk_dim_shapes_and_state_size():
    layer = _layer("taylor", qk_dim=4)
    assert layer.qkv.weight.shape == (2 * H * 4 + E, E)
    assert layer.feature_map.feature_dim == 1 + 4 + 16  # BASED's map on 4-dim q, k
    assert layer.decode_state_size(7) == H * 21 * (E // H + 1)
    kv = _layer("softmax", qk_dim=4, short_conv=3)
    assert kv.decode_state_size(10) == H * (4 + E // H) * 10 + 2 * (2 * H * 4 + E)
    same = _layer("psf_random")  # default qk_dim = head dim: the old (3E, E) projection
    assert same.qk_dim == E // H and same.qkv.weight.shape == (3 * E, E)


@pytest.mark.parametrize("attention", ["psf_random", "soft_hash_1k", "softmax", "psf_mixed"])
def test_value_dim_equals_the_wide_layer_with_zero_value_columns(attention):
    """value_dim D_v < D: the layer equals the default-width layer whose value columns past
    D_v in every head, and the output projection's matching inputs, are zero (values and
    input gradients): the narrow values are laid out head by head like the wide ones."""
    dv, d = 3, E // H
    narrow = _layer(attention, value_dim=dv)
    wide = _layer(attention)
    assert narrow.qkv.weight.shape == (2 * E + H * dv, E)
    assert narrow.out_proj.weight.shape == (E, H * dv)
    if attention != "psf_mixed":  # (mixed also keeps its current block's keys and values)
        per_head = (
            9 * (d + dv) if attention == "softmax" else narrow.feature_map.state_dim * (dv + 1)
        )
        assert narrow.decode_state_size(9) == H * per_head
    wide.load_state_dict(  # feature maps, norms: the same draws; projections set below
        {
            k: v
            for k, v in narrow.state_dict().items()
            if k not in ("qkv.weight", "out_proj.weight")
        },
        strict=False,
    )
    with torch.no_grad():
        w = torch.zeros_like(wide.qkv.weight)
        w[: 2 * E] = narrow.qkv.weight[: 2 * E]
        o = torch.zeros_like(wide.out_proj.weight)
        for h in range(H):
            w[2 * E + h * d : 2 * E + h * d + dv] = narrow.qkv.weight[
                2 * E + h * dv : 2 * E + (h + 1) * dv
            ]
            o[:, h * d : h * d + dv] = narrow.out_proj.weight[:, h * dv : (h + 1) * dv]
        wide.qkv.weight.copy_(w)
        wide.out_proj.weight.copy_(o)
    x = torch.randn(2, 11, E, dtype=torch.float64, requires_grad=True)
    y_narrow, y_wide = narrow(x), wide(x)
    assert rel_err(y_narrow, y_wide) < 1e-12
    g = torch.randn_like(y_wide)
    (gx_n,) = torch.autograd.grad((y_narrow * g).sum(), [x])
    (gx_w,) = torch.autograd.grad((y_wide * g).sum(), [x])
    assert rel_err(gx_n, gx_w) < 1e-12
    assert "value_dim=3" in repr(narrow)


def test_model_value_dim_beside_a_window_decodes_as_it_forwards():
    cfg = TransformerConfig(
        vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, attention="soft_hash_1k",
        map_kwargs={"num_features": 6}, chunk_size=4, local_window=4, global_heads=1, value_dim=3,
    )  # fmt: skip
    model = TransformerLM(cfg).double().eval()
    attn = model.blocks[0].attn
    assert (attn.num_heads, attn.qk_dim, attn.value_dim) == (1, 8, 3)
    assert model.blocks[0].decode_state_size(10) == 6 * (3 + 1) + 2 * 4 * (8 + 8)
    prompt = torch.randint(0, 32, (2, 5))
    out = model.generate(prompt, max_new_tokens=6, temperature=0.0)
    seq = prompt
    for _ in range(6):
        logits = model(seq)
        logits = logits[0] if isinstance(logits, tuple) else logits
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_padding_does_not_leak_through_convolution():
    layer = _layer("psf_random", short_conv=3)
    x = torch.randn(2, 9, E, dtype=torch.float64)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[0, [3, 4]] = False
    y = layer(x, key_padding_mask=keep)
    x2 = x.clone()
    x2[0, [3, 4]] = 50 * torch.randn(2, E, dtype=torch.float64)
    y2 = layer(x2, key_padding_mask=keep)
    assert torch.allclose(y[keep], y2[keep], rtol=1e-10, atol=1e-12)


def test_model_generate_with_short_conv_equals_greedy_forward():
    cfg = TransformerConfig(
        vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16,
        attention="psf_random", chunk_size=4, short_conv=3, qk_dim=4,
    )  # fmt: skip
    model = TransformerLM(cfg).double().eval()
    prompt = torch.randint(0, 32, (2, 5))
    out = model.generate(prompt, max_new_tokens=6, temperature=0.0)
    seq = prompt
    for _ in range(6):  # greedy decoding by full forwards, no cache
        logits = model(seq)
        logits = logits[0] if isinstance(logits, tuple) else logits
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_bad_arguments():
    with pytest.raises(ValueError, match="short_conv"):
        KernelAttention(E, H, short_conv=1)
    with pytest.raises(ValueError, match="short_conv"):
        KernelAttention(E, H, short_conv=-2)
    with pytest.raises(ValueError, match="qk_dim"):
        KernelAttention(E, H, qk_dim=0)
    with pytest.raises(ValueError, match="short_conv"):
        TransformerConfig(short_conv=1).validate()
    with pytest.raises(ValueError, match="qk_dim"):
        TransformerConfig(qk_dim=0).validate()
    with pytest.raises(ValueError, match="value_dim"):
        KernelAttention(E, H, value_dim=0)
    with pytest.raises(TypeError, match="value_dim"):
        KernelAttention(E, H, value_dim=2.5)
    with pytest.raises(ValueError, match="value_dim"):
        TransformerConfig(value_dim=-1).validate()
    with pytest.raises(ValueError, match="value_dim must stay None"):
        TransformerConfig(attention="soft_hash_1k", local_window=4, local_shared=True,
                          value_dim=4).validate()  # fmt: skip
