"""The exact quadratic references against torch SDPA and explicit formulas."""

import pytest
import torch
import torch.nn.functional as nnf

from conftest import rel_err
from polysketch.ops import (
    causal_mask,
    naive_linear_attention,
    polynomial_attention,
    softmax_attention,
    stabilize_denominator,
)

F64 = torch.float64


def qkv(tq, tk, d=5, e=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, 2, tq, d, generator=g, dtype=F64),
        torch.randn(2, 2, tk, d, generator=g, dtype=F64),
        torch.randn(2, 2, tk, e, generator=g, dtype=F64),
    )


@pytest.mark.parametrize("causal,tq,tk", [(False, 4, 9), (True, 9, 9), (True, 3, 9)])
def test_softmax_matches_sdpa(causal, tq, tk):
    q, k, v = qkv(tq, tk)
    mask = causal_mask(tq, tk, q.device)  # bottom-right aligned: query i at position tk - tq + i
    ref = nnf.scaled_dot_product_attention(q, k, v, attn_mask=mask if causal else None)
    assert rel_err(softmax_attention(q, k, v, causal=causal), ref) <= 1e-12
    kpm = torch.rand(2, 1, tk, generator=torch.Generator().manual_seed(1)) > 0.3
    kpm[..., -1] = True
    full = kpm.unsqueeze(-2) & mask if causal else kpm.unsqueeze(-2)
    ref = nnf.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=0.3)
    got = softmax_attention(q, k, v, causal=causal, scale=0.3, key_padding_mask=kpm)
    assert rel_err(got, ref) <= 1e-12


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_polynomial_attention_matches_explicit_sum(degree, causal):
    q, k, v = qkv(6, 6, seed=degree)
    offset = 1.0
    out = polynomial_attention(q, k, v, degree=degree, causal=causal, denominator_offset=offset)
    ref = torch.empty_like(out)
    for i in range(6):  # Eq. (1) row by row
        j = slice(0, i + 1) if causal else slice(0, 6)
        s = torch.einsum("...d,...jd->...j", q[..., i, :], k[..., j, :]) ** degree
        ref[..., i, :] = (s.unsqueeze(-1) * v[..., j, :]).sum(-2) / (
            offset + s.sum(-1, keepdim=True)
        )
    assert rel_err(out, ref) <= 1e-12


def test_naive_linear_with_tensor_power_features_is_polynomial_attention():
    q, k, v = qkv(7, 7, d=3, seed=4)
    tensor2 = lambda x: torch.einsum("...a,...b->...ab", x, x).flatten(-2)  # noqa: E731
    for causal in (False, True):
        ref = polynomial_attention(q, k, v, degree=2, causal=causal)
        plain = naive_linear_attention(tensor2(q), tensor2(k), v, causal=causal)
        squared = naive_linear_attention(q, k, v, causal=causal, square=True)
        assert rel_err(plain, ref) <= 1e-12 and rel_err(squared, ref) <= 1e-12
        num = naive_linear_attention(q, k, v, causal=causal, square=True, normalize=False)
        s = (q @ k.transpose(-1, -2)) ** 2
        s = s.tril() if causal else s
        assert rel_err(num, s @ v) <= 1e-12


def test_stabilize_denominator_keeps_sign():
    den = torch.tensor([-1.0, -1e-9, 0.0, 1e-9, 2.0], dtype=F64)
    got = stabilize_denominator(den, 1e-6)
    assert torch.equal(got, torch.tensor([-1.0, -1e-6, 1e-6, 1e-6, 2.0], dtype=F64))
    assert torch.equal(stabilize_denominator(den, 0.0), den)


def test_half_precision_references_are_finite():
    q, k, v = (x.to(torch.bfloat16) for x in qkv(64, 64))
    for out in (
        softmax_attention(10 * q, 10 * k, v, causal=True),
        polynomial_attention(q, k, v, degree=4, causal=True),
    ):
        assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
