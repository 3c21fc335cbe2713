"""``polysketch.ops.state_read.read_state``: Ψq(A) P, the read of a carried state (the initial
state of packed documents, the prefix of earlier ranks), equals the product with the explicit
features, in slices, with a recomputing backward that matches autograd."""

from __future__ import annotations

import pytest
import torch

from conftest import rel_err
from polysketch.ops import state_read
from polysketch.ops.pairs import PairFeatures, state_dim
from polysketch.ops.state_read import read_state


def _explicit(a, p, square):
    return (PairFeatures(a.shape[-1], a).queries(a) if square else a) @ p


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("f", [1, 4, 5])
@pytest.mark.parametrize("slice_rows", [3, 2048])
def test_read_equals_the_explicit_features_with_gradients(square, f, slice_rows, monkeypatch):
    monkeypatch.setattr(state_read, "READ_TOKENS", slice_rows)
    g = torch.Generator().manual_seed(f)
    a = torch.randn(2, 3, 11, f, generator=g, dtype=torch.float64, requires_grad=True)
    p = torch.randn(2, 3, state_dim(f, square), 6, generator=g, dtype=torch.float64,
                    requires_grad=True)  # fmt: skip
    out, ref = read_state(a, p, square=square), _explicit(a, p, square)
    assert rel_err(out, ref) < 1e-13
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out * w).sum(), (a, p))
    want = torch.autograd.grad((ref * w).sum(), (a, p))
    for x, y in zip(got, want, strict=True):
        assert rel_err(x, y) < 1e-12
    assert torch.autograd.gradcheck(lambda a, p: read_state(a, p, square=square), (a, p))


def test_empty_rows_give_an_empty_read_and_zero_state_gradient():
    a = torch.randn(2, 0, 4, dtype=torch.float64, requires_grad=True)
    p = torch.randn(2, state_dim(4, True), 3, dtype=torch.float64, requires_grad=True)
    out = read_state(a, p, square=True)
    assert out.shape == (2, 0, 3)
    (dp,) = torch.autograd.grad(out.sum(), p)
    assert dp.shape == p.shape and float(dp.abs().max()) == 0


def test_half_operands_return_the_state_dtype():
    a = torch.randn(7, 4).bfloat16()
    p = torch.randn(state_dim(4, True), 3)
    out = read_state(a, p, square=True)
    assert out.dtype == torch.float32
    ref = _explicit(a.float(), p, True)
    assert rel_err(out, ref) < 2e-2
