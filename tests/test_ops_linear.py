"""chunked == cumsum == naive (outputs and gradients, fp64), gradcheck, non-causal shapes."""

import pytest
import torch

from conftest import rel_err
from polysketch.ops import (
    chunked,
    cumsum_lt_multiply,
    linear_attention,
    naive_linear_attention,
)
from polysketch.ops.dispatch import group_bytes_for
from polysketch.ops.pairs import compress, expand

F64 = torch.float64


def chunked_lt_multiply_with_sums(
    a, b, c, *, chunk_size=256, square=False, initial=None, initial_sums=None, group_bytes=None,
    final_state=True,
):  # fmt: skip
    """``ops.chunked.scan`` with dense states, so that its group scan can be checked against
    explicit products: out = lt((A Bᵀ)^{∘q}) C + Φ(A)·initial, the row sums, and the final
    state and key sums (..., F[, F], E) / (..., F[, F]). Square states go in through
    ``pairs.compress`` and come back through ``pairs.expand`` plus the antisymmetric part of
    ``initial``, which queries never read (x⊗x is symmetric)."""
    f = a.shape[-1]
    n0, z0 = initial, initial_sums
    if square:
        n0 = None if initial is None else compress(initial)
        z0 = None if initial_sums is None else compress(initial_sums, values=False)
    budget = group_bytes_for(a.device) if group_bytes is None else group_bytes
    out, rs, n, z = chunked.scan(
        a, b, c, chunk_size=chunk_size, square=square, initial=n0, initial_sums=z0,
        final_state=final_state, group_bytes=budget,
    )  # fmt: skip
    if square and n is not None:
        n, z = expand(n, f), expand(z, f, values=False)
        if initial is not None:
            n = n + (initial - initial.transpose(-2, -3)) / 2
        if initial_sums is not None:
            z = z + (initial_sums - initial_sums.transpose(-1, -2)) / 2
    return out, rs, n, z


def chunked_lt_multiply(a, b, c, **kwargs):
    """``chunked_lt_multiply_with_sums`` without the sums: (out, dense final state)."""
    out, _, state, _ = chunked_lt_multiply_with_sums(a, b, c, **kwargs)
    return out, state


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


# ---- the group scan of ops.chunked (bounded temporaries) and the decode fast path ----


def lt_reference(q, k, v, initial, square):
    """lt((A Bᵀ)^{∘q}) C + Φ(A)·initial and initial + Σ_j Φ(B_j)⊗C_j, explicitly (fp64)."""
    s = torch.tril(q @ k.transpose(-1, -2))
    if square:
        out = (s * s) @ v + torch.einsum("...tf,...tg,...fge->...te", q, q, initial)
        return out, initial + torch.einsum("...tf,...tg,...te->...fge", k, k, v)
    return s @ v + q @ initial, initial + k.transpose(-1, -2) @ v


# F = 3 <= E = 5 builds the pair features ψ (T = 70 >= SYMMETRIC_MIN_LENGTH, with a
# non-symmetric initial state); F = 7 > E contracts one factor at a time. 10 blocks of 7 rows;
# group_bytes 1 -> one block per group; 8000 -> 2+2+2+2+2 blocks (plain), 1 per group (square);
# 20000 -> 7+3 (plain), 4+4+2 (F = 3), 1 per group (F = 7); 60000 -> 10 (plain, F = 3),
# 2+2+2+2+2 (F = 7); None -> all 10 at once
@pytest.mark.parametrize("group_bytes", [1, 8000, 20000, 60000, None])
@pytest.mark.parametrize("square,f", [(False, 3), (True, 3), (True, 7)])
def test_group_scan_matches_explicit_product(square, f, group_bytes):
    q, k, v = make((2,), 70, 70, f, 5, positive=False, seed=f)
    g = torch.Generator().manual_seed(11)
    init = torch.randn(2, *((f, f) if square else (f,)), 5, generator=g, dtype=F64)
    inputs = tuple(x.detach().requires_grad_(True) for x in (q, k, v, init))

    def grads(fn):
        out, state = fn(*inputs)
        w = torch.linspace(-1, 1, out.numel(), dtype=F64).reshape(out.shape)
        ws = torch.linspace(1, 2, state.numel(), dtype=F64).reshape(state.shape)
        loss = (out * w).sum() + (state * ws).sum()
        return (out.detach(), state.detach(), *torch.autograd.grad(loss, inputs))

    def fast(q, k, v, init):
        return chunked_lt_multiply(
            q, k, v, chunk_size=7, square=square, initial=init, group_bytes=group_bytes
        )

    got = grads(fast)
    want = grads(lambda q, k, v, init: lt_reference(q, k, v, init, square))
    for x, y in zip(got, want, strict=True):
        assert close(x, y, 1e-12)


@pytest.mark.parametrize("group_bytes", [1, 8000, 20000, 60000, None])
@pytest.mark.parametrize("square,f", [(False, 3), (True, 3), (True, 7)])
def test_group_scan_is_bitwise_causal(square, f, group_bytes):
    q, k, v = make((2,), 70, 70, f, 5, positive=False, seed=5, dtype=torch.float32)
    kw = {"chunk_size": 7, "square": square, "group_bytes": group_bytes}
    base, _ = chunked_lt_multiply(q, k, v, **kw)
    g = torch.Generator().manual_seed(1)
    for t in (0, 3, 6, 7, 20, 41, 68):  # inside, at the end of, and across blocks and groups
        q2, k2, v2 = (x.clone() for x in (q, k, v))
        for x in (q2, k2, v2):
            x[..., t + 1 :, :] = 1e3 * torch.randn(x[..., t + 1 :, :].shape, generator=g)
        out, _ = chunked_lt_multiply(q2, k2, v2, **kw)
        assert torch.equal(out[..., : t + 1, :], base[..., : t + 1, :])
        assert not torch.equal(out, base)


@pytest.mark.parametrize("group_bytes", [1, 8000, 20000, 60000, None])
@pytest.mark.parametrize("square,f", [(False, 3), (True, 3), (True, 7)])
def test_with_sums_equals_product_with_ones_column(square, f, group_bytes):
    # row sums / key sums beside the product == the [C 1] product of PolySketchFormer §4, for
    # the plain, pair-feature (F <= E, T >= 64) and one-factor-at-a-time (F > E) paths, with a
    # non-symmetric initial state; outputs, final states and gradients
    q, k, v = make((2,), 70, 70, f, 5, positive=False, seed=f + 1)
    g = torch.Generator().manual_seed(12)
    fshape = (f, f) if square else (f,)
    init = torch.randn(2, *fshape, 5, generator=g, dtype=F64)
    init_z = torch.randn(2, *fshape, generator=g, dtype=F64)
    inputs = tuple(x.detach().requires_grad_(True) for x in (q, k, v, init, init_z))
    kw = dict(chunk_size=7, square=square, group_bytes=group_bytes)

    def with_sums(q, k, v, init, init_z):
        return chunked_lt_multiply_with_sums(q, k, v, initial=init, initial_sums=init_z, **kw)

    def with_ones(q, k, v, init, init_z):
        c = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        out, state = chunked_lt_multiply(
            q, k, c, initial=torch.cat([init, init_z.unsqueeze(-1)], dim=-1), **kw
        )
        return out[..., :5], out[..., 5], state[..., :5], state[..., 5]

    def grads(fn):
        parts = fn(*inputs)
        loss = sum((p * torch.linspace(-1, 2, p.numel(), dtype=F64).reshape(p.shape)).sum()
                   for p in parts)  # fmt: skip
        return (*(p.detach() for p in parts), *torch.autograd.grad(loss, inputs))

    for x, y in zip(grads(with_sums), grads(with_ones), strict=True):
        assert close(x, y, 1e-12)
    out, rs, state, z = chunked_lt_multiply_with_sums(
        q, k, v, initial=init, initial_sums=init_z, final_state=False, **kw
    )
    assert state is None and z is None
    assert torch.equal(out, with_sums(q, k, v, init, init_z)[0])
    assert torch.equal(rs, with_sums(q, k, v, init, init_z)[1])


def test_group_bytes_is_validated():
    q, k, v = make((), 5, 5, 2, 3, positive=True)
    with pytest.raises(ValueError, match="group_bytes"):
        chunked_lt_multiply(q, k, v, group_bytes=0)


@pytest.mark.parametrize("square", [False, True])
def test_decode_state_is_used_without_copy_and_steps_match_forward(square):
    from polysketch.ops import LinearAttentionState, linear_attention_step
    from polysketch.ops.state import unpack_state

    q, k, v = make((2,), 9, 9, 3, 4, positive=True, seed=4)
    full = linear_attention(q, k, v, causal=True, square=square)
    with torch.no_grad():
        _, state = linear_attention(
            q[..., :6, :], k[..., :6, :], v[..., :6, :], causal=True, square=square,
            return_state=True,
        )  # fmt: skip
        kw = dict(leading=(2,), feature_dim=3, value_dim=4, square=square, dtype=F64)
        kw.update(device=q.device)
        num, den = unpack_state(state, with_denominator=True, **kw)
        assert num is state.numerator and den is state.denominator  # same dtype: no copy
        num, den = unpack_state(state, with_denominator=False, **kw)
        assert num is state.numerator and den is None
        num32, den32 = unpack_state(state, with_denominator=True, **{**kw, "dtype": torch.float32})
        assert num32.dtype == den32.dtype == torch.float32
        assert unpack_state(None, with_denominator=True, **kw) == (None, None)
        assert isinstance(state, LinearAttentionState)
        outs = []
        for i in range(6, 9):
            sl = slice(i, i + 1)
            o, state = linear_attention_step(
                q[..., sl, :], k[..., sl, :], v[..., sl, :], state, square=square
            )
            outs.append(o)
    assert rel_err(torch.cat(outs, dim=-2), full[..., 6:, :]) <= 1e-12
    assert state.length == 9
