"""Mixed local (exact) + global (feature) causal attention: fast path vs T×T reference."""

import pytest
import torch

from conftest import rel_err
from polysketch import features
from polysketch.ops.mixed import mixed_attention, naive_mixed_attention
from polysketch.ops.mixed_step import MixedAttentionState, mixed_attention_step
from polysketch.ops.naive import polynomial_attention
from polysketch.ops.pairs import compress

D, E, F = 5, 3, 6


def _inputs(T, *, lead=(2, 3), dtype=torch.float64, nonneg=True, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, T, D, generator=g, dtype=dtype)
    k = torch.randn(*lead, T, D, generator=g, dtype=dtype)
    v = torch.randn(*lead, T, E, generator=g, dtype=dtype)
    fq = torch.randn(*lead, T, F, generator=g, dtype=dtype)
    fk = torch.randn(*lead, T, F, generator=g, dtype=dtype)
    if nonneg:  # keep the normaliser away from zero so relative errors are meaningful
        fq, fk = fq.abs(), fk.abs()
    ts = [q, k, v, fq, fk]
    for t in ts:
        t.requires_grad_(requires_grad)
    return ts


@pytest.mark.parametrize("chunk", [1, 16])
@pytest.mark.parametrize("T_kind", ["1", "2", "c-1", "c", "c+1", "97"])
@pytest.mark.parametrize(
    "local,degree,square",
    [("polynomial", 4, False), ("polynomial", 2, True), ("relu", 2, False), ("none", 4, False),
     ("none", 2, True)],
)  # fmt: skip
def test_matches_naive_outputs_and_gradients(chunk, T_kind, local, degree, square):
    T = {"1": 1, "2": 2, "c-1": chunk - 1, "c": chunk, "c+1": chunk + 1, "97": 97}[T_kind]
    if T < 1:  # chunk - 1 == 0 for chunk 1: use the next awkward length instead
        T = 3
    kw = dict(chunk_size=chunk, local=local, degree=degree, square=square, denominator_offset=0.5)
    a = _inputs(T, requires_grad=True)
    b = [t.detach().clone().requires_grad_(True) for t in a]
    out_fast = mixed_attention(*a, **kw, scale=0.7)
    out_ref = naive_mixed_attention(*b, **kw, scale=0.7)
    assert out_fast.shape == (2, 3, T, E)
    assert rel_err(out_fast.detach(), out_ref.detach()) <= 1e-10
    w = torch.randn(out_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    (out_fast * w).sum().backward()
    (out_ref * w).sum().backward()
    for name, x, y in zip(["q", "k", "v", "phi_q", "phi_k"], a, b, strict=True):
        if local == "none" and name in ("q", "k"):  # no local scores: q, k unused
            assert x.grad is None and y.grad is None, name
            continue
        if x.grad is None:  # T <= chunk: no earlier block, the features are unused
            assert T <= chunk and name.startswith("phi") and not y.grad.any(), name
            continue
        assert rel_err(x.grad, y.grad) <= 1e-10, name


def test_any_leading_dims():
    for lead in [(), (4,), (2, 1, 2)]:
        ts = _inputs(21, lead=lead)
        out = mixed_attention(*ts, chunk_size=8)
        assert out.shape == (*lead, 21, E)
        assert rel_err(out, naive_mixed_attention(*ts, chunk_size=8)) <= 1e-12


def test_naive_reference_from_definition():
    """The reference itself, checked entry by entry against the formula in Python loops."""
    T, c = 7, 3
    q, k, v, fq, fk = (t[0, 0] for t in _inputs(T))
    out = naive_mixed_attention(q, k, v, fq, fk, chunk_size=c, degree=2, denominator_offset=1.0)
    for i in range(T):
        num, den = torch.zeros(E, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
        for j in range(i + 1):
            s = (q[i] @ k[j]) ** 2 if j // c == i // c else fq[i] @ fk[j]
            num, den = num + s * v[j], den + s
        assert rel_err(out[i], num / den) <= 1e-13


@pytest.mark.parametrize("p,square,local_degree", [(2, False, 2), (4, False, 4), (2, True, 4)])
@pytest.mark.parametrize("chunk", [1, 8, 200])
def test_exact_features_give_polynomial_attention(p, square, local_degree, chunk):
    """With exact features (tensor_power), global and local scores agree: Eq. 1 exactly."""
    T, d = 37, 3
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, T, d, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, T, 4, generator=g, dtype=torch.float64)
    fmap = features.create("tensor_power", d, degree=p)
    out = mixed_attention(
        q, k, v, fmap.query(q), fmap.key(k), chunk_size=chunk, degree=local_degree, square=square
    )
    ref = polynomial_attention(q, k, v, degree=local_degree, causal=True)
    assert rel_err(out, ref) <= 1e-10


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("t", [0, 6, 7, 8, 20])
def test_causality_bit_identical(square, t):
    T, c = 24, 8
    ts = _inputs(T, dtype=torch.float32)
    out = mixed_attention(*ts, chunk_size=c, square=square, degree=2)
    changed = []
    g = torch.Generator().manual_seed(5)
    for x in ts:
        y = x.clone()
        y[..., t + 1 :, :] = 1e3 * torch.rand(y[..., t + 1 :, :].shape, generator=g)
        changed.append(y)
    out2 = mixed_attention(*changed, chunk_size=c, square=square, degree=2)
    assert torch.equal(out[..., : t + 1, :], out2[..., : t + 1, :])
    if t + 1 < T:
        assert not torch.equal(out[..., t + 1 :, :], out2[..., t + 1 :, :])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_no_worse_than_naive(dtype):
    """Half inputs: fp32 internals; error vs fp64 within a few times the naive one's."""
    ts = _inputs(70)
    ref = naive_mixed_attention(*ts, chunk_size=16, degree=2)
    low = [t.to(dtype) for t in ts]
    out = mixed_attention(*low, chunk_size=16, degree=2)
    out_naive = naive_mixed_attention(*low, chunk_size=16, degree=2)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    err, err_naive = rel_err(out.double(), ref), rel_err(out_naive.double(), ref)
    assert err <= 2 * err_naive + 1e-3


def test_rejects_bad_input():
    q, k, v, fq, fk = _inputs(10)
    with pytest.raises(TypeError, match="q"):
        mixed_attention(q.numpy(), k, v, fq, fk)
    with pytest.raises(ValueError, match="k"):
        mixed_attention(q, k[..., :4], v, fq, fk)
    with pytest.raises(ValueError, match="v"):
        mixed_attention(q, k, v[..., :9, :], fq, fk)
    with pytest.raises(ValueError, match="phi_q"):
        mixed_attention(q, k, v, fq[..., :9, :], fk)
    with pytest.raises(ValueError, match="phi_k"):
        mixed_attention(q, k, v, fq, fk[..., :5])
    with pytest.raises(ValueError, match="phi_k"):
        mixed_attention(q, k, v, fq, fk.float())
    with pytest.raises(ValueError, match="chunk_size"):
        mixed_attention(q, k, v, fq, fk, chunk_size=0)
    with pytest.raises(ValueError, match="degree"):
        mixed_attention(q, k, v, fq, fk, degree=0)
    with pytest.raises(ValueError, match="local"):
        mixed_attention(q, k, v, fq, fk, local="softmax")
    with pytest.raises(TypeError, match="square"):
        mixed_attention(q, k, v, fq, fk, square=1)
    with pytest.raises(ValueError, match="denominator_offset"):
        naive_mixed_attention(q, k, v, fq, fk, denominator_offset=float("inf"))
    with pytest.raises(ValueError, match="eps"):
        mixed_attention(q, k, v, fq, fk, eps=-1.0)
    with pytest.raises(ValueError, match="scale"):
        mixed_attention(q, k, v, fq, fk, scale=float("nan"))
    with pytest.raises(ValueError, match="q"):
        mixed_attention(q[0, 0, 0], k, v, fq, fk)


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("local,degree", [("polynomial", 4), ("relu", 2), ("none", 4)])
@pytest.mark.parametrize("prefill,step", [(1, 1), (5, 1), (8, 3), (13, 2)])
def test_prefill_plus_steps_equal_naive_outputs_gradients_and_state(
    prefill, step, local, degree, square
):
    """mixed_attention_step: a prefill, then the rest ``step`` tokens at a time, equals
    naive_mixed_attention on the whole sequence (outputs and gradients); the state holds the
    completed blocks' Σ Ψ(φk)⊗[v 1] (pair layout) and the current block's tokens."""
    T, c = 21, 4
    kw = dict(chunk_size=c, local=local, degree=degree, square=square, denominator_offset=0.5,
              scale=0.7)  # fmt: skip
    a = _inputs(T, requires_grad=True)
    state, outs = None, []
    for start in [0, *range(prefill, T, step)]:
        stop = prefill if start == 0 else min(T, start + step)
        out, state = mixed_attention_step(*(x[..., start:stop, :] for x in a), state, **kw)
        outs.append(out)
    out = torch.cat(outs, dim=-2)
    b = [t.detach().clone().requires_grad_(True) for t in a]
    ref = naive_mixed_attention(*b, **kw)
    assert out.shape == ref.shape and rel_err(out.detach(), ref.detach()) <= 1e-10
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    grads = torch.autograd.grad((out * w).sum(), a, allow_unused=True)
    ref_grads = torch.autograd.grad((ref * w).sum(), b, allow_unused=True)
    for name, x, y in zip(["q", "k", "v", "phi_q", "phi_k"], grads, ref_grads, strict=True):
        if local == "none" and name in ("q", "k"):  # no local scores: q, k unused
            assert x is None and y is None, name
            continue
        assert rel_err(x, y) <= 1e-10, name
    full = (T // c) * c  # 20: five completed blocks, one token in the current block
    q, k, v, fq, fk = (x.detach() for x in a)
    vt = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)[..., :full, :]
    if square:
        want = compress(torch.einsum("...tf,...tg,...te->...fge", fk[..., :full, :],
                                     fk[..., :full, :], vt))  # fmt: skip
    else:
        want = fk[..., :full, :].transpose(-1, -2) @ vt
    assert state.length == T and state.summary.shape == want.shape
    assert rel_err(state.summary, want) <= 1e-12
    for buf, x in ((state.k, k), (state.phi_k, fk), (state.v, v)):
        assert torch.equal(buf, x[..., full:, :])


def test_mixed_step_refuses_a_state_that_does_not_fit():
    q, k, v, fq, fk = _inputs(10)
    _, state = mixed_attention_step(q, k, v, fq, fk, None, chunk_size=4)
    one = [x[..., :1, :] for x in (q, k, v, fq, fk)]
    with pytest.raises(ValueError, match="chunk_size"):
        mixed_attention_step(*one, state, chunk_size=3)
    with pytest.raises(ValueError, match="state.summary"):
        mixed_attention_step(*one, state, chunk_size=4, square=True)
    with pytest.raises(TypeError, match="MixedAttentionState"):
        mixed_attention_step(*one, (state.summary,), chunk_size=4)
    assert isinstance(state, MixedAttentionState) and state.length == 10


def test_local_none_reads_earlier_blocks_only():
    """local="none": row i is Σ_{j < start(i)} s_ij v_j / (offset + Σ s_ij), entry by entry;
    the first block's rows are 0 without an offset; eps=0 with no offset is refused."""
    T, c = 9, 4
    q, k, v, fq, fk = (t[0, 0] for t in _inputs(T))
    out = mixed_attention(q, k, v, fq, fk, chunk_size=c, local="none")
    for i in range(T):
        start = (i // c) * c
        if start == 0:
            assert not out[i].any()
            continue
        s = fq[i] @ fk[:start].T
        assert rel_err(out[i], (s @ v[:start]) / s.sum()) <= 1e-13
    with pytest.raises(ValueError, match="eps=0"):
        mixed_attention(q, k, v, fq, fk, chunk_size=c, local="none", eps=0.0)


@pytest.mark.parametrize("square", [False, True])
def test_far_token_keeps_raw_keys_and_equals_the_whole_sequence(square):
    """far_attention_token (local="none", the current block's raw keys featurized when it
    completes) after a prefill equals naive_mixed_attention(local="none") on the whole
    sequence; between block boundaries the state holds k and v but no features."""
    from polysketch.ops.mixed_step import far_attention_token, mixed_attention_state

    T, c, pre = 19, 4, 6
    fmap = features.create("hedgehog", D, num_features=F, seed=1).double()
    q, k, v = (t.detach() for t in _inputs(T)[:3])
    fq, fk = fmap.query(q), fmap.key(k)
    kw = dict(chunk_size=c, square=square, denominator_offset=0.5, eps=1e-6)
    ref = naive_mixed_attention(q, k, v, fq, fk, local="none", **kw)
    st = mixed_attention_state(k[..., :pre, :], fk[..., :pre, :], v[..., :pre, :], chunk_size=c,
                               square=square)  # fmt: skip
    st = MixedAttentionState(st.summary, st.k, None, st.v, st.length)
    outs = []
    for i in range(pre, T):
        one = [x[..., i : i + 1, :] for x in (fq, k, v)]
        out, st = far_attention_token(*one, st, key_features=fmap.key, **kw)
        outs.append(out)
        assert st.phi_k is None and (st.k is None) == ((i + 1) % c == 0)
    assert rel_err(torch.cat(outs, dim=-2), ref[..., pre:, :]) <= 1e-12
