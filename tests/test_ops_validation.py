"""Bad input raises ValueError/TypeError naming the argument."""

import pytest
import torch

from numerics import linear_attention_error_bound
from polysketch import features, kernel_attention
from polysketch.ops import (
    LinearAttentionState,
    linear_attention,
    linear_attention_step,
    naive_linear_attention,
    polynomial_attention,
    softmax_attention,
)

Q = torch.rand(2, 5, 3)
K = torch.rand(2, 5, 3)
V = torch.rand(2, 5, 4)
BAD_DENOMINATOR = LinearAttentionState(torch.zeros(2, 3, 4), torch.zeros(2, 4))


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((Q.numpy(), K, V), {}, TypeError, "phi_q"),
        ((Q, K.long(), V), {}, TypeError, "phi_k"),
        ((Q, K, V.double()), {}, ValueError, "phi_q and v"),
        ((Q[0, 0], K, V), {}, ValueError, "phi_q"),
        ((Q, K[..., :2], V), {}, ValueError, "phi_q and phi_k"),
        ((Q, K, V[:, :4]), {}, ValueError, "phi_k and v"),
        ((Q[:1], K, V), {}, ValueError, "no broadcasting"),
        ((torch.rand(2, 7, 3), K, V), {}, ValueError, "Tq=7 > Tk=5"),
        ((Q, K[:, :0], V[:, :0]), {"causal": False}, ValueError, "phi_k must have length"),
        ((Q, K, V), {"chunk_size": 0}, ValueError, "chunk_size"),
        ((Q, K, V), {"chunk_size": 2.5}, TypeError, "chunk_size"),
        ((Q, K, V), {"algorithm": "scan"}, ValueError, "algorithm"),
        ((Q, K, V), {"square": 1}, TypeError, "square"),
        ((Q, K, V), {"normalize": None}, TypeError, "normalize"),
        ((Q, K, V), {"denominator_offset": float("nan")}, ValueError, "denominator_offset"),
        ((Q, K, V), {"eps": -1.0}, ValueError, "eps"),
        ((Q, K, V), {"key_padding_mask": torch.ones(2, 5)}, TypeError, "key_padding_mask"),
        ((Q, K, V), {"key_padding_mask": torch.ones(2, 4, dtype=torch.bool)}, ValueError,
         "key_padding_mask"),
        ((Q, K, V), {"key_padding_mask": torch.ones(3, 5, dtype=torch.bool)}, ValueError,
         "key_padding_mask"),
        ((Q, K, V), {"key_padding_mask": [True] * 5}, TypeError, "key_padding_mask"),
        ((Q, K, V), {"attn_mask": torch.ones(5, 5, dtype=torch.bool)}, ValueError,
         "only\\s+causal=True and key_padding_mask"),
        ((Q, K, V), {"initial_state": (torch.zeros(2, 3, 4), torch.zeros(2, 3))}, TypeError,
         "initial_state"),
        ((Q, K, V), {"initial_state": LinearAttentionState.zeros((2,), 3, 5)}, ValueError,
         "initial_state.numerator"),
        ((Q, K, V), {"initial_state": LinearAttentionState.zeros((2,), 3, 4, square=True)},
         ValueError, "initial_state.numerator"),
        ((Q, K, V), {"initial_state": BAD_DENOMINATOR}, ValueError, "initial_state.denominator"),
    ],
)  # fmt: skip
def test_linear_attention_bad_input(args, kwargs, exc, match):
    kwargs = {"causal": True, **kwargs}
    with pytest.raises(exc, match=match):
        linear_attention(*args, **kwargs)


def test_causal_must_be_bool_everywhere():
    for fn in (linear_attention, naive_linear_attention):
        with pytest.raises(TypeError, match="causal"):
            fn(Q, K, V, causal="yes")
    with pytest.raises(TypeError, match="causal"):
        softmax_attention(Q, K, V, causal=1)


def test_references_bad_input():
    with pytest.raises(ValueError, match="degree"):
        polynomial_attention(Q, K, V, degree=0, causal=True)
    with pytest.raises(TypeError, match="degree"):
        polynomial_attention(Q, K, V, degree=2.0, causal=True)
    with pytest.raises(ValueError, match="q and k"):
        softmax_attention(Q, K[..., :2], V, causal=False)
    with pytest.raises(TypeError, match="scale"):
        softmax_attention(Q, K, V, causal=False, scale="1")
    with pytest.raises(ValueError, match="key_padding_mask"):
        naive_linear_attention(Q, K, V, causal=False, key_padding_mask=torch.ones(5, 2).bool())


def test_square_cumsum_size_guard():
    q = torch.rand(1, 512, 64)
    with pytest.raises(ValueError, match="algorithm='chunked'"):
        linear_attention(q, q, q, causal=True, square=True, algorithm="cumsum")


def test_step_and_kernel_attention_bad_input():
    with pytest.raises(TypeError, match="initial_state"):
        linear_attention_step(Q, K, V, state="empty")
    fmap = features.create("elu", 3)
    with pytest.raises(TypeError, match="feature_map"):
        kernel_attention(Q, K, V, "elu", causal=True)
    with pytest.raises(ValueError, match="feature_map.dim"):
        kernel_attention(torch.rand(2, 5, 4), torch.rand(2, 5, 4), V, fmap, causal=True)
    with pytest.raises(TypeError, match="checkpoint"):
        kernel_attention(Q, K, V, fmap, causal=True, checkpoint="no")
    with pytest.raises(ValueError, match="attn_mask"):
        kernel_attention(Q, K, V, fmap, causal=False, attn_mask=torch.zeros(5, 5))
    with pytest.raises(ValueError, match="k and v"):
        kernel_attention(Q, K, V[:, :3], fmap, causal=False)


def test_a_lower_rank_key_mask_is_refused_even_when_batch_equals_heads():
    # Issue 22 item 3: with B == H a (B, Tk) mask on (B, H, Tk, D) keys used to broadcast
    # right-aligned as (H, Tk) and give a silently wrong output; it must name the fix.
    g = torch.Generator().manual_seed(0)
    q, k = (torch.rand(2, 2, 5, 4, generator=g) for _ in range(2))
    v = torch.randn(2, 2, 5, 3, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    for fn in (linear_attention, naive_linear_attention):
        with pytest.raises(ValueError, match=r"leading rank 3.*mask\[:, None\]"):
            fn(q, k, v, causal=True, key_padding_mask=mask)
    want = naive_linear_attention(q, k, v, causal=True, key_padding_mask=mask[:, None])
    got = linear_attention(q, k, v, causal=True, key_padding_mask=mask[:, None])
    # the chunked and the naive op sum the same products in other orders: each within the
    # first-order bound of the exact value (numerics.linear_attention_error_bound)
    masked_k = k * mask[:, None, :, None]  # masked keys add nothing to either sum
    bound = linear_attention_error_bound(q, masked_k, v, dtype=torch.float32)
    assert ((got - want).abs() <= 2 * bound).all()
    full = linear_attention(q, k, v, causal=True, key_padding_mask=mask[:, None].expand(2, 2, 5))
    assert torch.allclose(full, got, rtol=0, atol=0)
