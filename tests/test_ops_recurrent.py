"""Decoding: prefill + steps == full causal forward; the state's content; Tq < Tk alignment."""

import pytest
import torch

from conftest import rel_err
from numerics import linear_attention_error_bound
from polysketch.ops import (
    LinearAttentionState,
    dense_to_pair_state,
    linear_attention,
    linear_attention_step,
    naive_linear_attention,
    pair_to_dense_state,
)
from polysketch.ops.pairs import PairFeatures, compress

F64 = torch.float64


def make(lead, t, f, e, *, positive, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, t, f, generator=g, dtype=F64)
    k = torch.randn(*lead, t, f, generator=g, dtype=F64)
    v = torch.randn(*lead, t, e, generator=g, dtype=F64)
    if positive:
        q, k = (0.5 * q).exp(), (0.5 * k).exp()
    return q, k, v


def decode(q, k, v, *, prefill, step, square, offset, algorithm="chunked"):
    """Prefill the first ``prefill`` tokens, then feed the rest ``step`` tokens at a time."""
    kw = {"square": square, "denominator_offset": offset}
    outs = []
    state = None
    if prefill:
        out, state = linear_attention(
            q[..., :prefill, :], k[..., :prefill, :], v[..., :prefill, :], causal=True,
            return_state=True, chunk_size=4, algorithm=algorithm, **kw,
        )  # fmt: skip
        outs.append(out)
    for s in range(prefill, q.shape[-2], step):
        sl = slice(s, s + step)
        out, state = linear_attention_step(q[..., sl, :], k[..., sl, :], v[..., sl, :], state, **kw)
        outs.append(out)
    return torch.cat(outs, dim=-2), state


@pytest.mark.parametrize("square", [False, True])
def test_fp32_decoding_is_within_rounding_of_fp64_however_the_normalizer_cancels(square):
    """Decoding sums the keys into a state (N, Z) and reads φq·N / (offset + φq·Z); the full
    forward scores the keys of each block directly (s_ij = φq_i·φk_j) and reads the earlier
    blocks from the state: the same products in other orders. Signed features (llops,
    TensorSketch, unsquared sketches) make the normalizer 1 + Σ_j s_ij cancel, and both fp32
    paths then err by up to κ_i γ_n, κ_i = Σ_j |s_ij| / |1 + Σ_j s_ij| (``numerics``): each
    must stay within that first-order bound of the fp64 result on the same features."""
    g = torch.Generator().manual_seed(11)
    t, f, e = 40, 6, 5
    q, k = (torch.randn(2, t, f, generator=g) * 1.5 for _ in range(2))  # signed: cancels
    v = torch.randn(2, t, e, generator=g)
    exact = naive_linear_attention(q.double(), k.double(), v.double(), causal=True,
                                   square=square, denominator_offset=1.0, eps=0.0)  # fmt: skip
    bound = linear_attention_error_bound(q, k, v, dtype=torch.float32, square=square,
                                         denominator_offset=1.0)  # fmt: skip
    s = q.double() @ k.double().transpose(-1, -2)
    s = (s * s if square else s).tril()
    kappa = (1 + s.abs().sum(-1)) / (1 + s.sum(-1)).abs()
    assert square or kappa.max() > 100  # the ill-conditioned case is exercised
    full = linear_attention(q, k, v, causal=True, square=square, denominator_offset=1.0,
                            chunk_size=8)  # fmt: skip
    for prefill, step in ((0, 1), (5, 1), (9, 3)):
        out, _ = decode(q, k, v, prefill=prefill, step=step, square=square, offset=1.0)
        assert ((out.double() - exact).abs() <= bound).all(), (prefill, step)
    assert ((full.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("prefill,step", [(0, 1), (7, 1), (5, 3), (13, 2)])
def test_prefill_plus_steps_equals_full_forward(prefill, step, offset, square):
    q, k, v = make((2, 2), 21, 3, 5, positive=not square, seed=prefill + step)
    full = linear_attention(q, k, v, causal=True, square=square, denominator_offset=offset)
    ref = naive_linear_attention(q, k, v, causal=True, square=square, denominator_offset=offset)
    for algorithm in ("chunked", "cumsum"):
        out, state = decode(
            q, k, v, prefill=prefill, step=step, square=square, offset=offset, algorithm=algorithm
        )
        assert rel_err(out, full) <= 1e-12
        assert rel_err(out, ref) <= 1e-10
        assert state.length == 21


@pytest.mark.parametrize("square", [False, True])
def test_state_content(square):
    q, k, v = make((2,), 9, 3, 4, positive=False, seed=1)
    _, state = linear_attention(
        q, k, v, causal=True, square=square, return_state=True, chunk_size=4
    )
    if square:  # the pair layout (ops.state) of the dense Σ k⊗k⊗v, Σ k⊗k
        dense_num = torch.einsum("btf,btg,bte->bfge", k, k, v)
        dense_den = torch.einsum("btf,btg->bfg", k, k)
        num, den = compress(dense_num), compress(dense_den, values=False)
        assert num.shape == (2, 3 * (3 // 2 + 1), 4)
        dense = pair_to_dense_state(state, 3)
        assert rel_err(dense.numerator, dense_num) <= 1e-12
        assert rel_err(dense.denominator, dense_den) <= 1e-12
        back = dense_to_pair_state(dense)
        assert torch.equal(back.numerator, state.numerator) and back.length == state.length
    else:
        num, den = k.transpose(-1, -2) @ v, k.sum(-2)
    assert state.numerator.shape == num.shape and state.denominator.shape == den.shape
    assert rel_err(state.numerator, num) <= 1e-12
    assert rel_err(state.denominator, den) <= 1e-12
    # same state from the non-causal pass and from the cumsum algorithm
    for kw in ({"causal": False}, {"causal": True, "algorithm": "cumsum"}):
        _, other = linear_attention(q, k, v, square=square, return_state=True, **kw)
        assert rel_err(other.numerator, num) <= 1e-12
        assert rel_err(other.denominator, den) <= 1e-12


def test_zero_state_equals_no_state_and_normalize_false_step():
    q, k, v = make((3,), 6, 4, 2, positive=True, seed=2)
    zero = LinearAttentionState.zeros((3,), 4, 2, dtype=F64)
    a, sa = linear_attention_step(q, k, v, None)
    b, sb = linear_attention_step(q, k, v, zero)
    assert rel_err(a, b) <= 1e-15 and rel_err(sa.numerator, sb.numerator) <= 1e-15
    # unnormalized steps still carry a denominator state
    c, sc = linear_attention_step(q, k, v, None, normalize=False)
    assert rel_err(c, naive_linear_attention(q, k, v, causal=True, normalize=False)) <= 1e-12
    assert rel_err(sc.denominator, k.sum(-2)) <= 1e-12


@pytest.mark.parametrize("square", [False, True])
def test_gradients_through_prefill_and_steps(square):
    q, k, v = make((2,), 11, 3, 2, positive=not square, seed=3)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, _ = decode(*leaves, prefill=6, step=2, square=square, offset=1.0)
    g1 = torch.autograd.grad(out.sin().sum(), leaves)
    leaves2 = [x.clone().requires_grad_(True) for x in (q, k, v)]
    full = naive_linear_attention(*leaves2, causal=True, square=square, denominator_offset=1.0)
    g2 = torch.autograd.grad(full.sin().sum(), leaves2)
    for a, b in zip(g1, g2, strict=True):
        assert rel_err(a, b) <= 1e-10


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("algorithm", ["chunked", "cumsum"])
def test_causal_queries_aligned_with_last_keys(algorithm, square):
    # Tq < Tk: query i sits at position Tk - Tq + i, equal to the tail of the full forward
    q, k, v = make((2,), 12, 3, 4, positive=not square, seed=4)
    full = naive_linear_attention(q, k, v, causal=True, square=square)
    tail = linear_attention(
        q[..., 7:, :], k, v, causal=True, square=square, algorithm=algorithm, chunk_size=2
    )
    assert rel_err(tail, full[..., 7:, :]) <= 1e-12
    naive_tail = naive_linear_attention(q[..., 7:, :], k, v, causal=True, square=square)
    assert rel_err(naive_tail, full[..., 7:, :]) <= 1e-12


def test_noncausal_initial_state_adds_earlier_keys():
    q, k, v = make((2,), 10, 3, 4, positive=True, seed=5)
    _, state = linear_attention(q, k[..., :4, :], v[..., :4, :], causal=False, return_state=True)
    out = linear_attention(q, k[..., 4:, :], v[..., 4:, :], causal=False, initial_state=state)
    assert rel_err(out, naive_linear_attention(q, k, v, causal=False)) <= 1e-12


def test_state_helpers_and_half_precision_state_is_fp32():
    q, k, v = make((1,), 5, 2, 3, positive=True)
    q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    out, state = linear_attention(q, k, v, causal=True, return_state=True)
    assert out.dtype == torch.bfloat16 and state.numerator.dtype == torch.float32
    assert state.to(F64).denominator.dtype == F64 and state.length == 5
    leaf = torch.zeros(1, 2, 3, requires_grad=True)
    s = LinearAttentionState(leaf * 2, torch.zeros(1, 2), 0)
    assert s.numerator.requires_grad and not s.detach().numerator.requires_grad


@pytest.mark.parametrize("square", [False, True])
def test_one_token_step_is_one_fused_update_matching_naive(square, monkeypatch):
    """Token by token from an empty state, with key padding: outputs, gradients and the
    state equal the naive reference and the prefill's state; a one-token step never runs the
    chunked machinery of linear_attention (N += Ψ(k)⊗v, Z += Ψ(k) and one read)."""
    from polysketch.ops import recurrent

    q, k, v = make((2, 2), 12, 3, 5, positive=not square, seed=6)
    keep = torch.rand(2, 1, 12, generator=torch.Generator().manual_seed(7)) > 0.3
    keep[..., 0] = True
    v = torch.where(keep.unsqueeze(-1), v, float("nan"))  # padded values must never leak
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]

    def refuse(*args, **kwargs):
        raise AssertionError("a one-token step ran linear_attention")

    monkeypatch.setattr(recurrent, "linear_attention", refuse)
    state, outs = None, []
    for i in range(12):
        sl = slice(i, i + 1)
        out, state = linear_attention_step(
            *(x[..., sl, :] for x in leaves), state, square=square, denominator_offset=0.5,
            key_padding_mask=keep[..., sl],
        )  # fmt: skip
        outs.append(out)
    monkeypatch.undo()
    out = torch.cat(outs, dim=-2)
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = naive_linear_attention(*ref_leaves, causal=True, square=square, denominator_offset=0.5,
                                 key_padding_mask=keep)  # fmt: skip
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-10
    w = torch.linspace(-1, 1, ref.numel(), dtype=F64).reshape(ref.shape)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_leaves)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(a).all() and rel_err(a, b) <= 1e-10
    _, whole = linear_attention(q, k, v, causal=True, square=square, return_state=True,
                                key_padding_mask=keep)  # fmt: skip
    assert state.length == 12 and state.numerator.shape == whole.numerator.shape
    assert rel_err(state.numerator, whole.numerator) <= 1e-12
    assert rel_err(state.denominator, whole.denominator) <= 1e-12


@pytest.mark.parametrize("square", [False, True])
def test_one_token_step_computes_in_the_compute_dtype_whatever_the_state_dtype(square):
    """A state handed over in another dtype (bf16, fp64) is taken in the compute dtype of the
    features (fp32 for bf16 features, as linear_attention keeps it): the step equals the one
    from that state converted first, and returns an fp32 state."""
    q, k, v = make((2,), 6, 3, 4, positive=not square, seed=11)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    _, state = linear_attention(q[..., :5, :], k[..., :5, :], v[..., :5, :], causal=True,
                                square=square, return_state=True)  # fmt: skip
    one = (x[..., 5:, :] for x in (q, k, v))
    want_out, want = linear_attention_step(*one, state, square=square)
    for dtype in (torch.bfloat16, F64):
        other = LinearAttentionState(state.numerator.to(dtype), state.denominator.to(dtype), 5)
        fp32 = LinearAttentionState(other.numerator.float(), other.denominator.float(), 5)
        ref_out, ref = linear_attention_step(*(x[..., 5:, :] for x in (q, k, v)), fp32,
                                             square=square)  # fmt: skip
        out, new = linear_attention_step(*(x[..., 5:, :] for x in (q, k, v)), other,
                                         square=square)  # fmt: skip
        assert new.numerator.dtype == new.denominator.dtype == torch.float32
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref_out)
        assert torch.equal(new.numerator, ref.numerator) and new.length == 6
    assert want.numerator.dtype == torch.float32 and want_out.dtype == torch.bfloat16


def test_cached_pair_features_are_built_once_per_size_dtype_and_device():
    x = torch.randn(2, 6)
    a, b = PairFeatures.cached(6, x), PairFeatures.cached(6, x)
    assert a is b
    assert PairFeatures.cached(6, x.double()) is not a
    torch.testing.assert_close(a.omega, PairFeatures(6, x).omega, rtol=0, atol=0)
    torch.testing.assert_close(a.queries(x), PairFeatures(6, x).queries(x), rtol=0, atol=0)
