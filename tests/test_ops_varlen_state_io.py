"""``polysketch.ops.state_io``: reading a carried state, Ψq(A) P (the initial state of packed
documents), and summing keys into one, (Σ Ψ(B)ᵀ C, Σ Ψ(B)) (a shard's state for context
parallelism), equal the products with the explicit features, in slices, with recomputing
backwards that match autograd."""

from __future__ import annotations

import pytest
import torch

from conftest import rel_err
from polysketch.ops import state_io
from polysketch.ops.pairs import PairFeatures, key_state, state_dim
from polysketch.ops.state_io import read_state, sum_state


def _explicit(a, p, square):
    return (PairFeatures(a.shape[-1], a).queries(a) if square else a) @ p


def _check_grads(out, ref, leaves):
    w = torch.randn_like(ref) if isinstance(ref, torch.Tensor) else None
    if w is None:
        ws = [torch.randn_like(r) for r in ref]
        got = torch.autograd.grad(sum((o * x).sum() for o, x in zip(out, ws, strict=True)), leaves)
        want = torch.autograd.grad(sum((r * x).sum() for r, x in zip(ref, ws, strict=True)), leaves)
    else:
        got = torch.autograd.grad((out * w).sum(), leaves)
        want = torch.autograd.grad((ref * w).sum(), leaves)
    for x, y in zip(got, want, strict=True):
        assert rel_err(x, y) < 1e-12


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("f", [1, 4, 5])
@pytest.mark.parametrize("slice_rows", [3, 2048])
def test_read_equals_the_explicit_features_with_gradients(square, f, slice_rows, monkeypatch):
    monkeypatch.setattr(state_io, "STATE_IO_TOKENS", slice_rows)
    g = torch.Generator().manual_seed(f)
    a = torch.randn(2, 3, 11, f, generator=g, dtype=torch.float64, requires_grad=True)
    p = torch.randn(2, 3, state_dim(f, square), 6, generator=g, dtype=torch.float64,
                    requires_grad=True)  # fmt: skip
    out, ref = read_state(a, p, square=square), _explicit(a, p, square)
    assert rel_err(out, ref) < 1e-13
    _check_grads(out, ref, (a, p))


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("f", [1, 4, 5])
@pytest.mark.parametrize("slice_rows", [3, 2048])
def test_sum_equals_the_key_state_with_gradients(square, f, slice_rows, monkeypatch):
    monkeypatch.setattr(state_io, "STATE_IO_TOKENS", slice_rows)
    g = torch.Generator().manual_seed(10 + f)
    b = torch.randn(2, 3, 11, f, generator=g, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 3, 11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    out, ref = sum_state(b, c, square=square), key_state(b, c, square=square)
    for x, y in zip(out, ref, strict=True):
        assert rel_err(x, y) < 1e-13
    _check_grads(out, ref, (b, c))


def test_gradcheck_of_the_squared_read_and_sum(monkeypatch):
    monkeypatch.setattr(state_io, "STATE_IO_TOKENS", 2)
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    p = torch.randn(2, state_dim(3, True), 2, generator=g, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, p: read_state(a, p, square=True), (a, p))
    assert torch.autograd.gradcheck(lambda b, c: sum_state(b, c, square=True), (a, c))


def test_empty_rows_give_empty_reads_zero_sums_and_zero_gradients():
    a = torch.randn(2, 0, 4, dtype=torch.float64, requires_grad=True)
    p = torch.randn(2, state_dim(4, True), 3, dtype=torch.float64, requires_grad=True)
    out = read_state(a, p, square=True)
    assert out.shape == (2, 0, 3)
    (dp,) = torch.autograd.grad(out.sum(), p)
    assert dp.shape == p.shape and float(dp.abs().max()) == 0
    c = torch.randn(2, 0, 3, dtype=torch.float64, requires_grad=True)
    n, z = sum_state(a, c, square=True)
    assert n.shape == (2, state_dim(4, True), 3) and z.shape == (2, state_dim(4, True))
    assert float(n.detach().abs().max()) == 0 and n.requires_grad


def test_half_operands_return_the_state_dtype():
    a = torch.randn(7, 4).bfloat16()
    p = torch.randn(state_dim(4, True), 3)
    out = read_state(a, p, square=True)
    assert out.dtype == torch.float32
    assert rel_err(out, _explicit(a.float(), p, True)) < 2e-2
