"""The launch cuts of issue 41 change no result: constants built once, the denominator guard's
one-op backward, and the block function without a zero initial state or an unused final one.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from polysketch.ops import _constants
from polysketch.ops.blocks import blocks_lt_multiply
from polysketch.ops.naive import _guard, stabilize_denominator
from polysketch.ops.pairs import PairFeatures


def _plain_guard_grad(den, eps):
    x = den.detach().clone().requires_grad_()
    _guard(x, eps).backward(torch.arange(1.0, x.numel() + 1).reshape(x.shape))
    return x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_guard_values_and_gradients_equal_the_where_clamp_graph(dtype):
    eps = 1e-3
    den = torch.tensor([-1.0, -eps, -5e-4, -0.0, 0.0, 5e-4, eps, 2.0, float("inf"),
                        float("-inf"), float("nan")], dtype=dtype)  # fmt: skip
    x = den.clone().requires_grad_()
    out = stabilize_denominator(x, eps)
    assert torch.equal(out.detach().isnan(), den.isnan())
    same = ~den.isnan()
    assert torch.equal(out.detach()[same], _guard(den, eps)[same])
    out.backward(torch.arange(1.0, den.numel() + 1, dtype=dtype))
    ref = _plain_guard_grad(den, eps)
    assert torch.equal(x.grad, ref), (x.grad, ref)
    assert x.grad[6] != 0 and x.grad[1] != 0 and x.grad[4] == 0  # ±eps pass, 0 does not


def test_constants_are_kept_once_and_never_while_tracing():
    built = []

    def build():
        built.append(1)
        return torch.arange(3)

    key = ("test-constant", id(build))
    with torch.inference_mode():
        first = _constants.constant(key, build)
    assert not first.is_inference()  # autograd may save it later
    assert _constants.constant(key, build) is first and len(built) == 1
    with FakeTensorMode():  # another tracer's tensor is returned, never kept
        fake_key = ("test-fake", id(build))
        _constants.constant(fake_key, lambda: torch.ones(2))
    assert fake_key not in _constants._CONSTANTS

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x):
        return x + _constants.constant(("test-traced", 5), lambda: torch.ones(5))

    torch._dynamo.reset()
    assert torch.equal(traced(torch.zeros(5)), torch.ones(5))
    assert ("test-traced", 5) not in _constants._CONSTANTS


def test_pair_weights_are_shared_and_exact():
    a = PairFeatures(6, torch.zeros(1))
    b = PairFeatures(6, torch.zeros(3, 2))
    assert a.omega is b.omega
    assert a.omega.tolist() == [1.0, 2.0, 2.0, 1.0] * 6  # ω_d for F = 6: d = 0, 1, 2, 3


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("group_bytes", [None, 1])  # all blocks at once; one block per group
def test_block_function_without_initial_or_final_state_is_bit_identical(square, group_bytes):
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(2, 3, 45, 8, generator=g, dtype=torch.float64) for _ in range(2))
    c = torch.randn(2, 3, 45, 5, generator=g, dtype=torch.float64)
    fs = 8 * 5 if square else 8
    zero = torch.zeros(2, 3, fs, 5, dtype=torch.float64)
    w = torch.randn(2, 3, 45, 5, generator=g, dtype=torch.float64)
    results = []
    for initial, want_state in ((zero, True), (None, True), (None, False)):
        x, y, z = (t.clone().requires_grad_() for t in (a, b, c))
        out, state = blocks_lt_multiply(
            x,
            y,
            z,
            square=square,
            chunk_size=16,
            initial=initial,
            group_bytes=group_bytes,
            return_state=want_state,
        )
        assert (state is None) == (not want_state)
        (out * w).sum().backward()
        results.append((out.detach(), state, x.grad, y.grad, z.grad))
    for other in results[1:]:
        for got, ref in zip(other, results[0], strict=True):
            if got is not None:
                assert torch.equal(got, ref)


def test_final_state_gradient_without_output_gradient():
    """Only the final state used: the output's gradient is None inside the backward."""
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(1, 40, 4, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))  # fmt: skip
    c = torch.randn(1, 40, 3, generator=g, dtype=torch.float64, requires_grad=True)
    _, state = blocks_lt_multiply(a, b, c, square=False, chunk_size=16)
    state.sum().backward()
    assert torch.allclose(c.grad, b.sum(-1, keepdim=True).expand_as(c).detach())  # Σ_f b_tf
    assert torch.allclose(b.grad, c.sum(-1, keepdim=True).expand_as(b).detach())
    assert torch.count_nonzero(a.grad) == 0
