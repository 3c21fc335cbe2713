"""chunked == cumsum == naive (outputs and gradients, fp64), gradcheck, non-causal shapes."""

import pytest
import torch

from conftest import rel_err
from polysketch.ops import (
    chunked_lt_multiply,
    cumsum_lt_multiply,
    linear_attention,
    naive_linear_attention,
)

F64 = torch.float64


def make(lead, tq, tk, f, e, *, positive, seed=0, dtype=F64):
    """Random features (exp of scaled normals when ``positive``) and values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, tq, f, generator=g, dtype=F64)
    k = torch.randn(*lead, tk, f, generator=g, dtype=F64)
    v = torch.randn(*lead, tk, e, generator=g, dtype=F64)
    if positive:
        q, k = (0.5 * q).exp(), (0.5 * k).exp()
    return q.to(dtype), k.to(dtype), v.to(dtype)


def outputs_and_grads(fn, q, k, v):
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    return out.detach(), grads


def close(a, b, tol=1e-10):
    """||a - b|| <= tol·max(||b||, 1): relative, with a floor for exactly-zero references
    (e.g. the gradient w.r.t. φq at T = 1, where out = v does not depend on φq)."""
    return float((a - b).norm()) <= tol * max(float(b.norm()), 1.0)


def assert_same(fn, ref, q, k, v, tol=1e-10):
    out, grads = outputs_and_grads(fn, q, k, v)
    rout, rgrads = outputs_and_grads(ref, q, k, v)
    assert close(out, rout, tol)
    for g, rg in zip(grads, rgrads, strict=True):
        assert close(g, rg, tol)


# (T, chunk_size): T in {1, 2, chunk - 1, chunk, chunk + 1, 97} for chunk sizes 1, 16, 256
CASES = [(1, 1), (2, 1), (97, 1), (1, 16), (15, 16), (16, 16), (17, 16), (97, 16)]
CASES += [(2, 256), (255, 256), (256, 256), (257, 256)]


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("t,chunk", CASES)
def test_causal_algorithms_match_naive(t, chunk, offset, square):
    # odd F and E; positive features for plain scores so the normalizer is bounded away from 0
    q, k, v = make((2,), t, t, 3, 5, positive=not square, seed=t + chunk)

    def ref(q, k, v):
        return naive_linear_attention(
            q, k, v, causal=True, square=square, denominator_offset=offset
        )

    for algorithm in ("chunked", "cumsum"):

        def fast(q, k, v, algorithm=algorithm):
            return linear_attention(
                q, k, v, causal=True, square=square, chunk_size=chunk,
                denominator_offset=offset, algorithm=algorithm,
            )  # fmt: skip

        assert_same(fast, ref, q, k, v)


@pytest.mark.parametrize("square", [False, True])
def test_long_sequence_1025(square):
    q, k, v = make((1,), 1025, 1025, 2, 3, positive=not square, seed=5)

    def ref(q, k, v):
        return naive_linear_attention(q, k, v, causal=True, square=square, denominator_offset=1.0)

    for chunk, algorithm in ((16, "chunked"), (256, "chunked"), (1, "chunked"), (256, "cumsum")):

        def fast(q, k, v, chunk=chunk, algorithm=algorithm):
            return linear_attention(
                q, k, v, causal=True, square=square, chunk_size=chunk,
                denominator_offset=1.0, algorithm=algorithm,
            )  # fmt: skip

        assert_same(fast, ref, q, k, v)


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("tq,tk", [(1, 9), (7, 3), (13, 13), (33, 20)])
def test_noncausal_any_lengths(tq, tk, square):
    q, k, v = make((2, 2), tq, tk, 5, 3, positive=not square, seed=tq * tk)
    for offset in (0.0, 0.5):

        def ref(q, k, v, offset=offset):
            return naive_linear_attention(
                q, k, v, causal=False, square=square, denominator_offset=offset
            )

        def fast(q, k, v, offset=offset):
            return linear_attention(q, k, v, causal=False, square=square, denominator_offset=offset)

        assert_same(fast, ref, q, k, v)


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_unnormalized_signed_features(causal, square):
    # normalize=False has no denominator, so signed features are fine: numerators must match
    q, k, v = make((3,), 40, 40, 4, 3, positive=False, seed=1)
    for algorithm in ("chunked", "cumsum"):

        def fast(q, k, v, algorithm=algorithm):
            return linear_attention(
                q, k, v, causal=causal, square=square, chunk_size=16, normalize=False,
                algorithm=algorithm,
            )  # fmt: skip

        def ref(q, k, v):
            return naive_linear_attention(q, k, v, causal=causal, square=square, normalize=False)

        assert_same(fast, ref, q, k, v)


def test_numerator_is_lt_times_v_exactly():
    # the core computes lt(A Bᵀ) C, checked against an explicit lower-triangular product
    q, k, v = make((), 37, 37, 4, 6, positive=False, seed=3)
    lt = torch.tril(q @ k.T)
    out, state = chunked_lt_multiply(q, k, v, chunk_size=8)
    assert rel_err(out, lt @ v) <= 1e-12
    assert rel_err(state, k.T @ v) <= 1e-12
    out2, state2 = cumsum_lt_multiply(q, k, v)
    assert rel_err(out2, lt @ v) <= 1e-12
    assert rel_err(state2, k.T @ v) <= 1e-12
    sq, ssq = chunked_lt_multiply(q, k, v, chunk_size=8, square=True)
    assert rel_err(sq, (lt * lt) @ v) <= 1e-12
    assert rel_err(ssq, torch.einsum("tf,tg,te->fge", k, k, v)) <= 1e-12


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_contiguous_and_strided(causal, square):
    g = torch.Generator().manual_seed(7)
    # non-contiguous: transposed (T and head dims swapped) and sliced inputs
    q = torch.randn(6, 2, 3, generator=g, dtype=F64)
    k = torch.randn(2, 6, 6, generator=g, dtype=F64)
    v = torch.randn(2, 6, 3, generator=g, dtype=F64)
    if not square:
        q, k = q.exp(), k.exp()
    q, k = q.transpose(0, 1), k[..., ::2]  # (2, 6, 3) transposed and sliced views
    assert not q.is_contiguous() and not k.is_contiguous()
    for algorithm in ("chunked", "cumsum"):

        def fn(q, k, v, algorithm=algorithm):
            return linear_attention(
                q, k, v, causal=causal, square=square, chunk_size=4, denominator_offset=0.5,
                algorithm=algorithm,
            )  # fmt: skip

        inputs = tuple(x.detach().requires_grad_(True) for x in (q, k, v))
        assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)
        contiguous = tuple(x.detach().contiguous().requires_grad_(True) for x in (q, k, v))
        assert torch.autograd.gradcheck(fn, contiguous, fast_mode=True)
        assert rel_err(fn(*inputs).detach(), fn(*contiguous).detach()) <= 1e-13


def test_fp64_stays_fp64_and_fp32_stays_fp32():
    for dtype in (torch.float32, F64):
        q, k, v = make((1,), 10, 10, 3, 2, positive=True, dtype=dtype)
        out, state = linear_attention(q, k, v, causal=True, return_state=True)
        assert out.dtype == dtype and state.numerator.dtype == dtype
