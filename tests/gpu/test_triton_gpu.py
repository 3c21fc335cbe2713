"""Triton kernels of causal linear attention on a CUDA GPU at realistic sizes.

The same checks as tests/test_ops_triton.py (which runs them under the CPU interpreter at
small shapes), here compiled by the real Triton compiler: fp32 against fp64 naive, bf16
against twice the error of a bf16 naive, causality, decode, and the memory of a 16k call;
the split layout against the sequential pass (``layout="auto"`` picks split for the few
heads of most of these calls). The half-precision checks share F = 32, E = 64 and B·H <= 4 (8
slice groups), so their kernels compile once (``tests/conftest.py``: one launch
configuration); the default dispatch's own shape (B·H = 12 at 16k: two slice groups) is in
test_accelerator_gpu.py. Skipped without CUDA.
"""

import pytest
import torch

from conftest import naive_lt_same_dtype

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from polysketch.ops import linear_attention  # noqa: E402
from polysketch.ops.dispatch import multiprocessor_count  # noqa: E402
from polysketch.ops.naive import naive_linear_attention  # noqa: E402
from polysketch.ops.triton import (  # noqa: E402
    triton_decode_step,
    triton_lt_multiply_with_sums,
)
from polysketch.ops.triton._config import PARTIAL_BYTES  # noqa: E402

NAMES = ("num", "row_sums", "da", "db", "dc")


def _rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _inputs(lead, t, f, e, *, square, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b, c = (torch.randn(*lead, t, x, device="cuda", generator=g) for x in (f, f, e))
    if square:
        a, b = a * f**-0.5 * 2, b * f**-0.5 * 2
    return tuple(x.to(dtype) for x in (a, b, c))


def _naive(a, b, c, square):
    num = naive_linear_attention(a, b, c, causal=True, square=square, normalize=False)
    ones = torch.ones_like(c[..., :1])
    rs = naive_linear_attention(a, b, ones, causal=True, square=square, normalize=False)
    return num, rs[..., 0]


def _naive_same_dtype(a, b, c, square):
    return naive_lt_same_dtype(a, b, c, square=square)


def _kernel(a, b, c, square):  # with the SM count, as the dispatcher calls it
    return triton_lt_multiply_with_sums(a, b, c, square=square, sms=multiprocessor_count(a.device))


def _values_and_grads(fn, a, b, c, square, wn, wr, dtype):
    a, b, c = (x.detach().to(dtype).requires_grad_() for x in (a, b, c))
    num, rs = fn(a, b, c, square)
    ((num * wn.to(num.dtype)).sum() + (rs * wr.to(rs.dtype)).sum()).backward()
    return [num.detach(), rs.detach(), a.grad, b.grad, c.grad]


@pytest.mark.parametrize(
    "square,f,e,t", [(True, 32, 64, 2049), (True, 64, 128, 1000), (False, 256, 128, 1500)]
)
def test_fp32_matches_fp64_naive(square, f, e, t):
    a, b, c = _inputs((1, 2), t, f, e, square=square)
    wn, wr = torch.randn(1, 2, t, e, device="cuda"), torch.randn(1, 2, t, device="cuda")
    got = _values_and_grads(_kernel, a, b, c, square, wn, wr, torch.float32)
    ref = _values_and_grads(_naive, a, b, c, square, wn, wr, torch.float64)
    for name, x, y in zip(NAMES, got, ref, strict=True):
        assert _rel_err(x, y) <= 1e-4, name


@pytest.mark.parametrize("square,f,e,t", [(True, 32, 64, 8192), (False, 32, 64, 8191)])
def test_bf16_within_twice_the_bf16_naive_error(square, f, e, t):
    a, b, c = (x.float() for x in _inputs((1, 2), t, f, e, square=square, dtype=torch.bfloat16))
    wn = torch.randn(1, 2, t, e, device="cuda").bfloat16().float()
    wr = torch.randn(1, 2, t, device="cuda").bfloat16().float()
    got = _values_and_grads(_kernel, a, b, c, square, wn, wr, torch.bfloat16)
    half = _values_and_grads(_naive_same_dtype, a, b, c, square, wn, wr, torch.bfloat16)
    ref = _values_and_grads(_naive, a, b, c, square, wn, wr, torch.float64)
    for name, x, h, y in zip(NAMES, got, half, ref, strict=True):
        assert torch.isfinite(x).all(), name
        assert _rel_err(x, y) <= 2 * _rel_err(h, y), name


def _layout(name, segment=1024):
    def fn(a, b, c, square):
        kw = dict(square=square, layout=name, segment_length=segment,
                  sms=multiprocessor_count(a.device))  # fmt: skip
        return triton_lt_multiply_with_sums(a, b, c, **kw)

    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("square", [True, False])
def test_split_and_sequential_layouts_agree(square, dtype):
    t, f, e = 5000, 32, 64  # segments of 1024: four full, one partial (masked last block)
    a, b, c = (x.float() for x in _inputs((1, 2), t, f, e, square=square, dtype=dtype))
    b[..., 3000:3100, :] = 0  # padded keys
    wn = torch.randn(1, 2, t, e, device="cuda").to(dtype).float()
    wr = torch.randn(1, 2, t, device="cuda").to(dtype).float()
    split = _values_and_grads(_layout("split"), a, b, c, square, wn, wr, dtype)
    seq = _values_and_grads(_layout("sequential"), a, b, c, square, wn, wr, dtype)
    if dtype == torch.float32:
        for name, x, y in zip(NAMES, split, seq, strict=True):
            assert _rel_err(x, y) <= 1e-5, name
        return
    half = _values_and_grads(_naive_same_dtype, a, b, c, square, wn, wr, dtype)
    ref = _values_and_grads(
        _naive, a.double(), b.double(), c.double(), square, wn, wr, torch.float64
    )
    for name, x, y, h, r in zip(NAMES, split, seq, half, ref, strict=True):
        assert _rel_err(x, r) <= 2 * _rel_err(h, r), name
        assert _rel_err(y, r) <= 2 * _rel_err(h, r), name


@pytest.mark.parametrize("square", [False, True])
def test_causality_bit_identical(square):
    t, cut = 4096, 2500
    a, b, c = _inputs((1, 4), t, 32, 64, square=square, dtype=torch.bfloat16)
    num, rs = _kernel(a, b, c, square)
    a2, b2, c2 = (x.clone() for x in (a, b, c))
    for x in (a2, b2, c2):
        x[..., cut + 1 :, :] = torch.randn_like(x[..., cut + 1 :, :]) * 50
    num2, rs2 = _kernel(a2, b2, c2, square)
    assert torch.equal(num[..., : cut + 1, :], num2[..., : cut + 1, :])
    assert torch.equal(rs[..., : cut + 1], rs2[..., : cut + 1])


@pytest.mark.parametrize("square,f", [(False, 64), (True, 32)])
def test_decode_step_matches_full_computation(square, f):
    t, e = 1025, 64
    q, k, v = _inputs((2, 6), t, f, e, square=square)
    _, state = linear_attention(
        q[..., :-1, :], k[..., :-1, :], v[..., :-1, :], causal=True, square=square,
        normalize=False, return_state=True,
    )  # fmt: skip
    last = (x[..., -1:, :] for x in (q, k, v))
    num, den, _, _ = triton_decode_step(*last, state.numerator, state.denominator, square=square)
    ref_num, ref_rs = _naive(*(x.double() for x in (q, k, v)), square)
    assert _rel_err(num, ref_num[..., -1:, :]) <= 1e-4
    assert _rel_err(den, ref_rs[..., -1:]) <= 1e-4


def test_peak_memory_at_16k_is_a_few_times_the_inputs():
    t, f, e = 16384, 32, 64
    a, b, c = (
        x.requires_grad_() for x in _inputs((1, 12), t, f, e, square=True, dtype=torch.bfloat16)
    )
    inputs = sum(x.numel() * x.element_size() for x in (a, b, c))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    num, rs = _kernel(a, b, c, True)
    (num.sum() + rs.sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # fp32 outputs, gradients and casts: about 5x the bf16 inputs, plus the fp32 partials of
    # the slice groups (at most PARTIAL_BYTES); the T×T scores alone would be
    # 12·16k²·4 bytes = 12 GiB (250x the inputs)
    assert peak <= 8 * inputs + PARTIAL_BYTES, (peak, inputs)
