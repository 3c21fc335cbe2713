"""The gradient surrogate of attention without in-block scores (``AttentionCore``,
``gradient_surrogate=λ``): λ·(o_lin − sg(o_lin)) is 0 in value, and its gradient is λ times
that of the same far-block attention with the kernel 1 + cos(q, k) and detached values."""

import pytest
import torch
import torch.nn.functional as F

from polysketch.nn import KernelAttention, TransformerConfig, TransformerLM, resolve_attention
from polysketch.nn.core import AttentionCore
from polysketch.ops.mixed import naive_mixed_attention

MAP = {"num_features": 12}


def _cores(lam):
    shape = dict(qk_dim=8, num_heads=2, value_dim=5)
    plain = AttentionCore(resolve_attention("soft_hash_far", 8, MAP, chunk_size=4),
                          **shape).double()  # fmt: skip
    spec = resolve_attention("soft_hash_far", 8, MAP, gradient_surrogate=lam, chunk_size=4)
    with_surrogate = AttentionCore(spec, **shape).double()
    with_surrogate.load_state_dict(plain.state_dict())
    return plain, with_surrogate


def _unit(x):
    return torch.cat([torch.ones_like(x[..., :1]), F.normalize(x, dim=-1)], dim=-1)


@pytest.mark.parametrize("t", [3, 4, 9, 16])
def test_value_is_unchanged_and_the_gradient_adds_lambda_times_the_linear_kernels(t):
    lam = 0.7
    plain, with_surrogate = _cores(lam)
    g = torch.Generator().manual_seed(t)
    q, k = (torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 2, t, 5, generator=g, dtype=torch.float64)
    w = torch.randn(2, 2, t, 5, generator=g, dtype=torch.float64)

    def grads(fn):
        x = [a.clone().requires_grad_(True) for a in (q, k, v)]
        out = fn(*x)
        got = torch.autograd.grad((out * w).sum(), x, allow_unused=True)
        return out, [torch.zeros_like(a) if d is None else d for a, d in zip(x, got, strict=True)]

    out0, g0 = grads(plain.attend)
    out1, g1 = grads(with_surrogate.attend)
    assert torch.equal(out0, out1)  # exactly: o − sg(o) is 0
    _, g_lin = grads(lambda q, k, v: naive_mixed_attention(
        q, k, v.detach(), _unit(q), _unit(k), chunk_size=4, local="none"))  # fmt: skip
    for a, b, c in zip(g1, g0, g_lin, strict=True):
        torch.testing.assert_close(a, b + lam * c, rtol=1e-10, atol=1e-12)
    assert g_lin[2].abs().max() == 0  # values are trained by the attention itself only
    if t > 4:  # queries past the first block read earlier keys: the surrogate reaches them
        assert g_lin[0][:, :, 4:].abs().max() > 0 and g_lin[1][:, :, :4].abs().max() > 0


def test_padding_decoding_and_no_grad_see_no_surrogate():
    small = dict(vocab_size=32, n_layer=2, n_head=2, n_embd=16, chunk_size=4, local_window=4,
                 global_heads=1, map_kwargs=MAP)  # fmt: skip
    a = TransformerLM(TransformerConfig(attention="soft_hash_far", **small)).double()
    b = TransformerLM(TransformerConfig(attention="soft_hash_far", gradient_surrogate=1.0,
                                        **small)).double()  # fmt: skip
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 32, (2, 13))
    keep = torch.ones(2, 13, dtype=torch.bool)
    keep[0, :3] = False  # left padding
    assert torch.equal(a(idx, key_padding_mask=keep)[0], b(idx, key_padding_mask=keep)[0])
    loss_a, loss_b = a(idx, idx)[1], b(idx, idx)[1]
    assert torch.equal(loss_a, loss_b)
    ga = torch.autograd.grad(loss_a, a.blocks[1].attn.qkv.weight)[0]
    gb = torch.autograd.grad(loss_b, b.blocks[1].attn.qkv.weight)[0]
    assert not torch.allclose(ga, gb)  # the surrogate reaches q and k
    caches = b.new_caches()
    steps = [b(idx[:, :6], caches=caches)[0]]
    steps += [b(idx[:, t : t + 1], caches=caches)[0] for t in range(6, 13)]
    torch.testing.assert_close(torch.cat(steps, 1), a(idx)[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "attention, kwargs, match",
    [
        ("psf_random", {}, "local='none'"),
        ("psf_mixed", {}, "local='polynomial'"),
        ("soft_hash_far", {"gradient_surrogate": -1.0}, "gradient_surrogate"),
    ],
)
def test_refused_where_it_does_not_apply(attention, kwargs, match):
    kwargs = {"gradient_surrogate": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        KernelAttention(16, 2, attention=attention, chunk_size=4, **kwargs)
