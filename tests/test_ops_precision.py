"""bf16 / fp16: fp32 accumulation, errors vs a same-dtype naive reference, no NaN/Inf to T = 16k."""

import pytest
import torch
import torch.nn.functional as nnf

from conftest import rel_err
from polysketch.ops import linear_attention, naive_linear_attention


def features(t, scale, square, dtype, seed=0):
    """Non-negative scores: elu(x)+1 features, or raw signed features with square=True."""
    g = torch.Generator().manual_seed(seed)
    q, k = (scale * torch.randn(1, t, 4, generator=g) for _ in range(2))
    v = torch.randn(1, t, 4, generator=g)
    if not square:
        q, k = nnf.elu(q) + 1, nnf.elu(k) + 1
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_accuracy_and_range(dtype):
    for square in (False, True):
        for scale in (1.0, 10.0):
            # accuracy at T = 2048, judged against the same-dtype naive reference's error
            q, k, v = features(2048, scale, square, dtype)
            truth = naive_linear_attention(
                q.double(), k.double(), v.double(), causal=True, square=square
            )
            naive = naive_linear_attention(q, k, v, causal=True, square=square)
            err_naive = rel_err(naive.double(), truth)
            for algorithm in ("chunked", "cumsum"):
                out = linear_attention(q, k, v, causal=True, square=square, algorithm=algorithm)
                assert out.dtype == dtype
                assert rel_err(out.double(), truth) <= 4 * err_naive + 1e-4
            if scale == 10.0:  # non-causal once per (dtype, square)
                out = linear_attention(q, k, v, causal=False, square=square)
                truth = naive_linear_attention(
                    q.double(), k.double(), v.double(), causal=False, square=square
                )
                naive = naive_linear_attention(q, k, v, causal=False, square=square)
                assert rel_err(out.double(), truth) <= 4 * rel_err(naive.double(), truth) + 1e-4
            # finiteness at T = 16k (too long for the naive reference)
            q, k, v = features(16384, scale, square, dtype, seed=1)
            out, state = linear_attention(q, k, v, causal=True, square=square, return_state=True)
            assert bool(torch.isfinite(out).all())
            assert state.numerator.dtype == torch.float32
            assert bool(
                torch.isfinite(state.numerator).all() and torch.isfinite(state.denominator).all()
            )
