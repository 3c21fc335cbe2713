"""Packed sequences (``polysketch.ops.varlen``): the pad-to-batch fast path equals the loop of
naive references over the documents (outputs and gradients, fp64 to 1e-10), resets the
state at every boundary, continues the initial state in the first document, returns the last
document's state, and refuses boundaries it cannot honour."""

from __future__ import annotations

import pytest
import torch

from conftest import rel_err
from polysketch.ops import LinearAttentionState, dispatch, linear_attention
from polysketch.ops.pairs import state_dim
from polysketch.ops.varlen import (
    check_cu_seqlens,
    document_starts,
    naive_varlen_linear_attention,
    varlen_linear_attention,
)

PACKINGS = [
    [0, 37],
    [0, 5, 5, 20, 37],  # an empty document
    [0, 1, 2, 37],  # one-token documents first
    [0, 30, 36, 37],  # a one-token document last
    [0, 8, 16, 24, 32, 37],  # boundaries on the block grid
    [0, 7, 9, 17, 25, 37],  # and off it
]


def _inputs(t, square, *, seed=0, dtype=torch.float64, f=5, e=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, t, f, generator=g, dtype=dtype)
    k = torch.randn(2, 3, t, f, generator=g, dtype=dtype)
    v = torch.randn(2, 3, t, e, generator=g, dtype=dtype)
    if not square:  # positive features keep the plain normalizer away from zero
        q, k = q.exp(), k.exp()
    return q, k, v


def _assert_same(out, ref, leaves):
    """Outputs and the gradients of (out·w).sum() for the ``leaves`` to 1e-10 relative."""
    assert rel_err(out, ref) < 1e-10
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out * w).sum(), leaves, retain_graph=True)
    want = torch.autograd.grad((ref * w).sum(), leaves, retain_graph=True)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("cu", PACKINGS, ids=str)
@pytest.mark.parametrize("algorithm", ["chunked", "chunked_scan", "chunked_blocks", "cumsum"])
def test_fast_path_equals_the_loop_of_naive_references(square, cu, algorithm):
    q, k, v = (x.requires_grad_() for x in _inputs(37, square))
    kw = {"square": square, "denominator_offset": 1.0}
    out = varlen_linear_attention(q, k, v, cu, chunk_size=8, algorithm=algorithm, **kw)
    ref = naive_varlen_linear_attention(q, k, v, cu, **kw)
    _assert_same(out, ref, (q, k, v))


@pytest.mark.parametrize("square", [False, True])
def test_key_padding_and_unnormalized_outputs(square):
    q, k, v = (x.requires_grad_() for x in _inputs(29, square, seed=1))
    keep = torch.rand(2, 1, 29, generator=torch.Generator().manual_seed(2)) > 0.3
    keep[..., [0, 11]] = True
    cu = [0, 11, 20, 29]
    for normalize in (True, False):
        kw = {"square": square, "key_padding_mask": keep, "normalize": normalize}
        out = varlen_linear_attention(q, k, v, cu, chunk_size=4, **kw)
        ref = naive_varlen_linear_attention(q, k, v, cu, **kw)
        _assert_same(out, ref, (q, k, v))


@pytest.mark.parametrize("square", [False, True])
def test_documents_do_not_see_each_other(square):
    """Changing (and scaling up) every token of one document leaves the others'
    outputs bit-identical."""
    q, k, v = _inputs(40, square, seed=3)
    cu = [0, 13, 26, 40]
    out = varlen_linear_attention(q, k, v, cu, square=square, chunk_size=8)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[..., 13:26, :] = 10 * x[..., 13:26, :].flip(-2)
    out2 = varlen_linear_attention(q2, k2, v2, cu, square=square, chunk_size=8)
    assert torch.equal(out[..., :13, :], out2[..., :13, :])
    assert torch.equal(out[..., 26:, :], out2[..., 26:, :])
    assert not torch.equal(out[..., 13:26, :], out2[..., 13:26, :])


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("cu", [[0, 12, 20, 27], [0, 27]], ids=str)
def test_initial_state_continues_the_first_document_and_the_last_state_is_returned(square, cu):
    q, k, v = (x.requires_grad_() for x in _inputs(37, square, seed=4))
    pre = 10  # the first 10 tokens were an earlier piece of the first document
    _, st = linear_attention(q[..., :pre, :], k[..., :pre, :], v[..., :pre, :], causal=True,
                             square=square, return_state=True)  # fmt: skip
    n0, z0 = st.numerator.detach().requires_grad_(), st.denominator.detach().requires_grad_()
    st = LinearAttentionState(n0, z0, st.length)
    tail = [x[..., pre:, :] for x in (q, k, v)]
    out, last = varlen_linear_attention(*tail, cu, square=square, chunk_size=4,
                                        initial_state=st, return_state=True)  # fmt: skip
    # the first document's outputs are those of the whole prefix + document from scratch
    end0 = pre + cu[1]
    first = linear_attention(q[..., :end0, :], k[..., :end0, :], v[..., :end0, :], causal=True,
                             square=square)[..., pre:, :]  # fmt: skip
    assert rel_err(out[..., : cu[1], :], first) < 1e-10
    # reference: each document alone, the first one from the initial state
    docs = [
        linear_attention(*(x[..., a:b, :] for x in tail), causal=True, square=square,
                         initial_state=st if a == 0 else None, return_state=True)
        for a, b in zip(cu, cu[1:], strict=False)
    ]  # fmt: skip
    ref_out, ref_last = torch.cat([d[0] for d in docs], dim=-2), docs[-1][1]
    assert rel_err(out, ref_out) < 1e-10
    assert rel_err(last.numerator, ref_last.numerator) < 1e-10
    assert rel_err(last.denominator, ref_last.denominator) < 1e-10
    assert last.length == (pre + 27 if len(cu) == 2 else cu[-1] - cu[-2])
    w, wn, wz = torch.randn_like(out), torch.randn_like(n0), torch.randn_like(z0)
    leaves = (q, k, v, n0, z0)

    def loss(o, s):
        return (o * w).sum() + (s.numerator * wn).sum() + (s.denominator * wz).sum()

    got = torch.autograd.grad(loss(out, last), leaves, retain_graph=True)
    want = torch.autograd.grad(loss(ref_out, ref_last), leaves)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-10


def test_linear_attention_takes_cu_seqlens():
    q, k, v = _inputs(21, True, seed=5)
    cu = torch.tensor([0, 6, 21])
    out = linear_attention(q, k, v, causal=True, square=True, cu_seqlens=cu, chunk_size=4)
    assert rel_err(out, naive_varlen_linear_attention(q, k, v, cu, square=True)) < 1e-10
    with pytest.raises(ValueError, match="cu_seqlens.*causal=True"):
        linear_attention(q, k, v, causal=False, cu_seqlens=cu)


def test_bfloat16_within_the_naive_reference_error():
    q, k, v = _inputs(45, False, seed=6, dtype=torch.float64)
    cu = [0, 9, 30, 45]
    truth = naive_varlen_linear_attention(q, k, v, cu)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    out = varlen_linear_attention(qb, kb, vb, cu, chunk_size=8)
    assert out.dtype == torch.bfloat16
    naive = naive_varlen_linear_attention(qb, kb, vb, cu)
    assert rel_err(out.double(), truth) <= 2 * rel_err(naive.double(), truth) + 1e-6


def test_empty_row_and_empty_documents():
    q, k, v = _inputs(0, False)
    out, st = varlen_linear_attention(q, k, v, [0], return_state=True)
    assert out.shape == (2, 3, 0, 4) and st.length == 0
    assert st.numerator.shape == (2, 3, 5, 4) and float(st.numerator.abs().max()) == 0
    q, k, v = _inputs(6, True)
    out = varlen_linear_attention(q, k, v, [0, 0, 3, 3, 6, 6], square=True)
    ref = naive_varlen_linear_attention(q, k, v, [0, 3, 6], square=True)
    assert rel_err(out, ref) < 1e-12


def test_document_starts_of_a_shard():
    cu = [0, 3, 10, 12, 37]
    assert document_starts(cu, 0, 37) == [3, 10, 12]
    assert document_starts(cu, 10, 19) == [0, 2]  # a shard that begins a document
    assert document_starts(cu, 19, 28) == []
    assert document_starts([0, 0, 5, 5], 0, 5) == []  # boundaries at 0 and T are not starts


def test_refusals_name_cu_seqlens():
    q, k, v = _inputs(10, False)
    for bad, match in (
        ([1, 10], "start at 0"),
        ([0, 9], "end at the sequence length 10"),
        ([0, 6, 4, 10], "non-decreasing"),
        (torch.tensor([0.0, 10.0]), "integer"),
        (torch.tensor([[0, 10]]), "1-D"),
        ("0,10", "sequence of ints"),
        ([0, 5.0, 10], "sequence of ints"),
    ):
        with pytest.raises((ValueError, TypeError), match=f"cu_seqlens.*{match}|{match}"):
            varlen_linear_attention(q, k, v, bad)
    with pytest.raises(ValueError, match="same length"):
        varlen_linear_attention(q[..., :4, :], k, v, [0, 10])
    fs = state_dim(5, False)
    wrong = LinearAttentionState(torch.zeros(2, 3, fs + 1, 4), torch.zeros(2, 3, fs + 1), 0)
    with pytest.raises(ValueError, match="initial_state"):
        varlen_linear_attention(q, k, v, [0, 10], initial_state=wrong.to(torch.float64))
    assert check_cu_seqlens((0, 4, 10), 10) == [0, 4, 10]


@pytest.mark.parametrize("budget", [1, 200_000])
@pytest.mark.parametrize("square", [False, True])
def test_many_batches_under_a_small_group_budget(budget, square, monkeypatch):
    """A tight budget cuts the documents into several padded batches (one document each at
    budget=1); the result is the same."""
    monkeypatch.setattr(dispatch, "CPU_GROUP_BYTES", budget)
    q, k, v = (x.requires_grad_() for x in _inputs(37, square, seed=7))
    keep = torch.rand(2, 1, 37, generator=torch.Generator().manual_seed(8)) > 0.2
    cu = [0, 3, 10, 11, 20, 26, 30, 37]
    kw = {"square": square, "key_padding_mask": keep, "denominator_offset": 1.0}
    out = varlen_linear_attention(q, k, v, cu, chunk_size=4, **kw)
    ref = naive_varlen_linear_attention(q, k, v, cu, **kw)
    _assert_same(out, ref, (q, k, v))
