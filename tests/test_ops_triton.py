"""Triton kernels of causal linear attention (polysketch.ops.triton) under the interpreter.

Without CUDA, conftest sets TRITON_INTERPRET=1 and the kernels run on CPU (slow: small
shapes). References: ``naive_linear_attention(..., normalize=False)`` in fp64 on the same
inputs (row sums: the numerator of a ones column); half precision is judged against the
error of a naive reference computed entirely in the same half dtype (flash-attention's rule).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import polysketch  # noqa: E402
from conftest import naive_lt_same_dtype, rel_err  # noqa: E402
from numerics import gamma  # noqa: E402
from polysketch.ops import LinearAttentionState, linear_attention, linear_attention_step  # noqa: E402
from polysketch.ops.naive import naive_linear_attention  # noqa: E402
from polysketch.ops.pairs import compress  # noqa: E402
from polysketch.ops.triton import (  # noqa: E402
    available,
    decode_unsupported_reason,
    triton_decode_step,
    triton_lt_multiply_with_sums,
    unsupported_reason,
)
from polysketch.ops.triton.function import lt_multiply_with_sums  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(lead, t, f, e, dtype=torch.float32, *, square):
    a, b, c = (torch.randn(*lead, t, x, device=DEVICE) for x in (f, f, e))
    if square:  # keep (A·B)² of order one
        a, b = a * f**-0.5 * 2, b * f**-0.5 * 2
    return tuple(x.to(dtype) for x in (a, b, c))


def _tol(f: int, t: int, square: bool) -> float:
    """Normwise fp32 bound of an output row Σ_j s_ij c_j over t keys with F (F(F+1)/2 pair)
    features: gamma(F' + t) (``numerics``; rows of random inputs do not cancel normwise)."""
    return gamma((f * (f + 1) // 2 if square else f) + t, torch.float32)


# a state update N' = N + φk ⊗ v: one product and one sum per entry on each side
STATE_TOL = gamma(16, torch.float32)


def _naive64(a, b, c, square):
    a, b, c = (x.double() for x in (a, b, c))
    num = naive_linear_attention(a, b, c, causal=True, square=square, normalize=False)
    ones = torch.ones_like(c[..., :1])
    rs = naive_linear_attention(a, b, ones, causal=True, square=square, normalize=False)
    return num, rs[..., 0]


def _naive_same_dtype(a, b, c, square):
    return naive_lt_same_dtype(a, b, c, square=square)


def _kernel(a, b, c, square, groups=None, **kw):
    """The public op, or with ``groups`` the square state's slices split over that many
    programs (on a GPU chosen from the SM count; always 1 on CPU)."""
    if groups is not None:
        return lt_multiply_with_sums(a, b, c, square=square, groups=groups, **kw)
    return triton_lt_multiply_with_sums(a, b, c, square=square, **kw)


def _values_and_grads(fn, a, b, c, square, wn, wr, dtype, **kw):
    """(num, row_sums, da, db, dc) of the loss Σ wn∘num + Σ wr∘row_sums, inputs in dtype."""
    a, b, c = (x.detach().to(dtype).requires_grad_() for x in (a, b, c))
    num, rs = fn(a, b, c, square, **kw)
    loss = (num * wn.to(num.dtype)).sum() + (rs * wr.to(rs.dtype)).sum()
    loss.backward()
    return [num.detach(), rs.detach(), a.grad, b.grad, c.grad]


NAMES = ("num", "row_sums", "da", "db", "dc")

FP32_CASES = [  # (square, F, E, T, lead, chunk_size, slice groups)
    *[(False, 16, 32, t, (2, 3), 64, None) for t in (1, 17, 64, 65, 130)],
    (False, 64, 64, 65, (2, 3), 64, None),
    (False, 64, 32, 97, (2,), 16, None),  # 7 blocks of 16: the carried state over many blocks
    (False, 128, 128, 33, (2,), 64, None),  # two value tiles: partial dA, dB summed
    *[(True, 16, 32, t, (2, 3), 64, None) for t in (1, 17, 64, 65, 130)],
    (True, 32, 64, 65, (2,), 64, None),
    (True, 32, 32, 50, (2,), 16, 4),  # slices split over 4 programs: partials summed
    (True, 16, 128, 40, (2,), 16, 2),  # two value tiles and two slice groups
]


@pytest.mark.parametrize("square,f,e,t,lead,chunk,groups", FP32_CASES)
def test_fp32_outputs_and_gradients_match_naive(square, f, e, t, lead, chunk, groups):
    a, b, c = _inputs(lead, t, f, e, square=square)
    wn, wr = torch.randn(*lead, t, e, device=DEVICE), torch.randn(*lead, t, device=DEVICE)
    kw = {"chunk_size": chunk, "groups": groups}
    got = _values_and_grads(_kernel, a, b, c, square, wn, wr, torch.float32, **kw)
    ref = _values_and_grads(_naive64, a, b, c, square, wn, wr, torch.float64)
    assert got[0].dtype == got[1].dtype == torch.float32
    assert got[0].shape == (*lead, t, e) and got[1].shape == (*lead, t)
    for name, x, y in zip(NAMES, got, ref, strict=True):
        assert rel_err(x.double(), y) <= 1e-4, name


HALF_CASES = [(False, 16, 32, 65), (True, 16, 32, 130), (True, 32, 64, 65), (False, 64, 64, 130)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("square,f,e,t", HALF_CASES)
def test_half_precision_within_twice_the_same_dtype_naive_error(dtype, square, f, e, t):
    # the same inputs for all three: rounded to the half dtype first
    a, b, c = (x.to(torch.float32) for x in _inputs((2,), t, f, e, dtype, square=square))
    wn = torch.randn(2, t, e, device=DEVICE).to(dtype).float()
    wr = torch.randn(2, t, device=DEVICE).to(dtype).float()
    got = _values_and_grads(_kernel, a, b, c, square, wn, wr, dtype)
    half = _values_and_grads(_naive_same_dtype, a, b, c, square, wn, wr, dtype)
    ref = _values_and_grads(_naive64, a, b, c, square, wn, wr, torch.float64)
    for name, x, h, y in zip(NAMES, got, half, ref, strict=True):
        if name.startswith("d"):
            assert x.dtype == dtype, name
        assert torch.isfinite(x).all(), name
        assert rel_err(x.double(), y) <= 2 * rel_err(h.double(), y), name


def test_fp16_inputs_of_layer_normed_features_run_in_fp32():
    """fp16 features of LayerNorm'd q, k (psf_random's map, D = 64): the squared in-block
    scores and the carried square state exceed fp16's 65504 (a half kernel casts both to fp16
    for ``tl.dot``), so fp16 inputs run the fp32 kernels. Judged on the normalized output
    num / (1 + row_sums) (the unnormalized sums and their gradients, ~1e10, are beyond fp16
    whatever computes them): against fp64 on the same fp16 inputs, fp32 rounding (≤ 1e-4,
    the fp32 rule); gradients come back in fp16 (≤ one fp16 rounding, 2⁻¹¹, more)."""
    from polysketch import features

    g = torch.Generator().manual_seed(0)
    t, d = 40, 64
    q, k = (torch.nn.functional.layer_norm(torch.randn(1, t, d, generator=g), (d,))
            for _ in range(2))  # fmt: skip
    fm = features.create("polysketch", d, degree=2, num_features=32, nonnegative=True, seed=0)
    a, b = (x.to(torch.float16) for x in (fm.query(q), fm.key(k)))
    c = torch.randn(1, t, 64, generator=g).to(torch.float16)
    assert float((a.float() @ b.float().mT).square().max()) > 65504  # beyond fp16's range
    w = torch.randn(1, t, 64, generator=g)

    def normalized(fn, dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in (a, b, c)]
        num, rs = fn(*xs, True)
        out = num / (rs.unsqueeze(-1) + 1)
        (out * w.to(out.dtype)).sum().backward()
        return [out.detach(), *(x.grad for x in xs)]

    got = normalized(lambda *x: _kernel(*x, chunk_size=16), torch.float16)
    ref = normalized(_naive64, torch.float64)
    for name, x, y in zip(("out", "da", "db", "dc"), got, ref, strict=True):
        assert torch.isfinite(x).all(), name
        assert rel_err(x.double(), y) <= 1e-4 + (2.0**-11 if name != "out" else 0), name


@pytest.mark.parametrize("square,groups", [(False, None), (True, None), (True, 2)])
def test_causal_outputs_before_t_are_bit_identical(square, groups):
    t, cut = 130, 70  # cut inside the second block: the masked local part and the states
    a, b, c = _inputs((2,), t, 16, 32, square=square)
    num, rs = _kernel(a, b, c, square, groups)
    a2, b2, c2 = (x.clone() for x in (a, b, c))
    for x in (a2, b2, c2):
        x[..., cut + 1 :, :] = torch.randn_like(x[..., cut + 1 :, :]) * 50
    num2, rs2 = _kernel(a2, b2, c2, square, groups)
    assert torch.equal(num[..., : cut + 1, :], num2[..., : cut + 1, :])
    assert torch.equal(rs[..., : cut + 1], rs2[..., : cut + 1])
    assert not torch.equal(num[..., cut + 1 :, :], num2[..., cut + 1 :, :])


def test_leading_dims_and_non_contiguous_inputs():
    a, b, c = _inputs((3, 2), 40, 16, 32, square=True)
    at, bt, ct = (x.transpose(0, 1) for x in (a, b, c))  # (2, 3, T, ·), not contiguous
    num, rs = _kernel(at, bt, ct, True)
    ref_num, ref_rs = _naive64(at, bt, ct, True)
    assert num.shape == (2, 3, 40, 32) and rs.shape == (2, 3, 40)
    tol = _tol(16, 40, True)
    assert rel_err(num.double(), ref_num) <= tol and rel_err(rs.double(), ref_rs) <= tol


def test_backward_saves_only_the_inputs():
    a, b, c = (x.requires_grad_() for x in _inputs((2,), 65, 32, 32, square=True))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        _kernel(a, b, c, True)
    assert sum(x.numel() for x in saved) == a.numel() + b.numel() + c.numel()


@pytest.mark.parametrize("square,f,e", [(False, 16, 32), (True, 16, 32), (True, 32, 64)])
def test_decode_step_matches_full_computation(square, f, e):
    t = 21
    q, k, v = _inputs((2, 3), t, f, e, square=square)
    _, prefix = linear_attention(
        q[..., :-1, :], k[..., :-1, :], v[..., :-1, :], causal=True, square=square,
        normalize=False, return_state=True,
    )  # fmt: skip
    assert isinstance(prefix, LinearAttentionState)
    last = (x[..., -1:, :] for x in (q, k, v))
    num, den, n2, z2 = triton_decode_step(
        *last, prefix.numerator, prefix.denominator, square=square
    )
    ref_num, ref_rs = _naive64(q, k, v, square)
    assert num.shape == (2, 3, 1, e) and den.shape == (2, 3, 1)
    tol = _tol(f, t, square)
    assert rel_err(num.double(), ref_num[..., -1:, :]) <= tol
    assert rel_err(den.double(), ref_rs[..., -1:]) <= tol
    step_out, state = linear_attention_step(
        q[..., -1:, :], k[..., -1:, :], v[..., -1:, :], prefix, square=square, normalize=False
    )
    assert rel_err(num, step_out) <= 2 * tol
    assert rel_err(n2, state.numerator) <= STATE_TOL and rel_err(z2, state.denominator) <= STATE_TOL
    assert not torch.equal(n2, prefix.numerator)  # a new tensor, the input untouched


def test_decode_step_half_inputs_and_fp32_state():
    q, k, v = _inputs((2,), 1, 16, 32, torch.bfloat16, square=True)
    n, z = torch.randn(2, 16, 16, 32, device=DEVICE), torch.randn(2, 16, 16, device=DEVICE)
    n, z = (n + n.transpose(1, 2)) / 2, (z + z.transpose(1, 2)) / 2  # a state is symmetric
    pn, pz = compress(n), compress(z, values=False)  # the pair layout of LinearAttentionState
    num, den, n2, z2 = triton_decode_step(q, k, v, pn, pz, square=True)
    qf, kf, vf = (x.float()[:, 0] for x in (q, k, v))
    ref_n = n + torch.einsum("bf,bg,be->bfge", kf, kf, vf)
    assert n2.dtype == torch.float32 and rel_err(n2, compress(ref_n)) <= STATE_TOL
    tol = 2 * gamma(16 * 16 + 2, torch.float32)  # a read of the F x F state, both sides fp32
    assert rel_err(num[:, 0], torch.einsum("bf,bg,bfge->be", qf, qf, ref_n)) <= tol
    ref_z = z + torch.einsum("bf,bg->bfg", kf, kf)
    assert rel_err(z2, compress(ref_z, values=False)) <= STATE_TOL
    assert rel_err(den[:, 0], torch.einsum("bf,bg,bfg->b", qf, qf, ref_z)) <= tol


def test_available_and_supported_inputs():
    assert available()
    a, b, c = _inputs((2,), 8, 16, 32, square=True)
    assert unsupported_reason(a, b, c, square=True) is None
    a64, b64, c32 = _inputs((2,), 8, 128, 32, square=False)
    assert unsupported_reason(a64, b64, c32, square=False) is None
    reason = unsupported_reason(a64, b64, c32, square=True)
    assert "F" in reason and "square=True" in reason


@pytest.mark.parametrize(
    "change,kind,words",
    [
        (lambda a, b, c: (a[..., :24], b[..., :24], c), ValueError, "feature dim F"),
        (lambda a, b, c: (a, b, c[..., :48]), ValueError, "c must have a value dim E"),
        (lambda a, b, c: (a, b[..., :4, :], c), ValueError, "a and b must have the same shape"),
        (lambda a, b, c: (a, b, c[..., :4, :]), ValueError, "c must have shape"),
        (lambda a, b, c: (a.double(), b.double(), c.double()), TypeError, "a must be float32"),
        (lambda a, b, c: (a, b.half(), c), TypeError, "share one dtype"),
        (lambda a, b, c: (a[0, 0], b, c), ValueError, "a must have shape"),
        (lambda a, b, c: (a.numpy(), b, c), TypeError, "a must be a torch.Tensor"),
    ],
)
def test_bad_inputs_name_the_argument(change, kind, words):
    a, b, c = _inputs((2,), 8, 32, 64, square=True)
    with pytest.raises(kind, match=words):
        _kernel(*change(a, b, c), True)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: CPU tensors are refused regardless of the interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    a, b, c = _inputs((2,), 8, 16, 32, square=False)
    with pytest.raises(ValueError, match="a must be on a CUDA device"):
        _kernel(a, b, c, False)
    assert "CUDA" in unsupported_reason(a, b, c, square=False)


def test_bad_arguments_of_the_op_and_the_decode_step():
    a, b, c = _inputs((2,), 8, 16, 32, square=True)
    with pytest.raises(TypeError, match="square must be a bool"):
        triton_lt_multiply_with_sums(a, b, c, square=1)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        triton_lt_multiply_with_sums(a, b, c, square=True, chunk_size=0)
    with pytest.raises(ValueError, match="groups must divide F=16"):
        lt_multiply_with_sums(a, b, c, square=True, groups=3)
    q, k, v = (x[..., :1, :] for x in (a, b, c))
    n, z = torch.zeros(2, 144, 32, device=DEVICE), torch.zeros(2, 144, device=DEVICE)  # F' = 144
    with pytest.raises(ValueError, match="phi_q requires grad"):
        triton_decode_step(q.requires_grad_(), k, v, n, z, square=True)
    with pytest.raises(ValueError, match="numerator must have shape"):
        triton_decode_step(q.detach(), k, v, n[..., :8, :], z, square=True)
    with pytest.raises(ValueError, match=r"numerator must have shape \(2, 144, 32\)"):
        dense = torch.zeros(2, 16, 16, 32, device=DEVICE)  # the dense layout of old releases
        triton_decode_step(q.detach(), k, v, dense, z, square=True)
    with pytest.raises(TypeError, match="denominator must be float32"):
        triton_decode_step(q.detach(), k, v, n, z.double(), square=True)
    with pytest.raises(ValueError, match=r"phi_k must have shape \(\.\.\., 1, dim\)"):
        triton_decode_step(q.detach(), b, v, n, z, square=True)
    assert decode_unsupported_reason(q.detach(), k, v, n, z, square=True) is None
    assert "F in (16, 32, 64)" in decode_unsupported_reason(
        q[..., :8].detach(), k[..., :8], v, n, z, square=True
    )


def test_package_imports_and_refuses_cleanly_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` fail
        "import torch, polysketch.ops.triton as t\n"
        "x = torch.zeros(1, 4, 16)\n"
        "assert not t.available()\n"
        "assert 'pip install polysketch[triton]' in t.unsupported_reason(x, x, x, square=False)\n"
    )
    src = str(Path(polysketch.__file__).parents[1])  # this checkout's package, not another
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr


# The split layout (``_layout``): segment states in parallel, a prefix sum over segments, then
# the sequential pass per segment from its prefix. Small segments (L = 32, 64) keep it fast.
SPLIT_CASES = [  # (square, F, E, T, chunk_size, segment_length, slice groups)
    (False, 16, 32, 150, 16, 32, None),  # T not a multiple of L or BT: masked last block
    (False, 128, 128, 100, 16, 48, None),  # L of three blocks; four value tiles (fp32)
    (True, 16, 32, 150, 16, 32, None),
    (True, 32, 32, 130, 16, 64, 2),  # two slice groups per segment
    (True, 16, 128, 97, 32, 32, None),  # four value tiles (fp32 BE = 32): partials summed
    (False, 16, 32, 20, 16, 64, None),  # T < L: one segment, the sequential pass
    (True, 16, 32, 20, 16, 64, None),
]


@pytest.mark.parametrize("square,f,e,t,chunk,seg,groups", SPLIT_CASES)
def test_split_layout_matches_sequential_and_naive(square, f, e, t, chunk, seg, groups):
    a, b, c = _inputs((2,), t, f, e, square=square)
    b[:, 40:47] = 0  # padded keys (as the dispatcher's key padding mask leaves them)
    wn, wr = torch.randn(2, t, e, device=DEVICE), torch.randn(2, t, device=DEVICE)
    kw = {"chunk_size": chunk, "groups": groups, "segment_length": seg}
    split = _values_and_grads(_kernel, a, b, c, square, wn, wr, torch.float32, layout="split", **kw)
    seq = _values_and_grads(
        _kernel, a, b, c, square, wn, wr, torch.float32, layout="sequential", **kw
    )
    ref = _values_and_grads(_naive64, a, b, c, square, wn, wr, torch.float64)
    for name, x, y, r in zip(NAMES, split, seq, ref, strict=True):
        assert rel_err(x.double(), r) <= 1e-4, name
        assert rel_err(x, y) <= 2 * _tol(f, t, square), name  # two fp32 orders
        if t <= seg:  # one segment: exactly the sequential pass
            assert torch.equal(x, y), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("square", [False, True])
def test_split_layout_half_precision_within_twice_the_same_dtype_naive_error(dtype, square):
    t, f, e = 150, 16, 32
    a, b, c = (x.to(torch.float32) for x in _inputs((2,), t, f, e, dtype, square=square))
    wn = torch.randn(2, t, e, device=DEVICE).to(dtype).float()
    wr = torch.randn(2, t, device=DEVICE).to(dtype).float()
    kw = {"layout": "split", "segment_length": 64, "chunk_size": 16}
    got = _values_and_grads(_kernel, a, b, c, square, wn, wr, dtype, **kw)
    half = _values_and_grads(_naive_same_dtype, a, b, c, square, wn, wr, dtype)
    ref = _values_and_grads(_naive64, a, b, c, square, wn, wr, torch.float64)
    for name, x, h, y in zip(NAMES, got, half, ref, strict=True):
        assert torch.isfinite(x).all(), name
        assert rel_err(x.double(), y) <= 2 * rel_err(h.double(), y), name


@pytest.mark.parametrize("square", [False, True])
def test_split_layout_causal_outputs_before_t_are_bit_identical(square):
    t, cut = 130, 70  # cut inside the third segment of 32
    a, b, c = _inputs((2,), t, 16, 32, square=square)
    kw = {"layout": "split", "segment_length": 32, "chunk_size": 16}
    num, rs = _kernel(a, b, c, square, **kw)
    a2, b2, c2 = (x.clone() for x in (a, b, c))
    for x in (a2, b2, c2):
        x[..., cut + 1 :, :] = torch.randn_like(x[..., cut + 1 :, :]) * 50
    num2, rs2 = _kernel(a2, b2, c2, square, **kw)
    assert torch.equal(num[..., : cut + 1, :], num2[..., : cut + 1, :])
    assert torch.equal(rs[..., : cut + 1], rs2[..., : cut + 1])


def test_layout_choice_and_segment_length():
    from polysketch.ops.triton._config import SEGMENT_BYTES, segment_length, slice_groups
    from polysketch.ops.triton._layout import choose_segment

    kw = dict(bh=2, t=5000, f=16, e=32, bt=64, grid=2, square=True, sms=None)
    assert choose_segment("auto", **kw) is None  # never split without a GPU unless forced
    assert choose_segment("sequential", **kw) is None
    assert choose_segment("split", **kw) == 1024
    assert choose_segment("split", **kw, requested=100) == 128  # a multiple of BT
    assert choose_segment("split", **{**kw, "t": 1024}) is None  # one segment
    with pytest.raises(ValueError, match="layout must be one of"):
        choose_segment("chunked", **kw)
    # with a GPU's multiprocessor count (the dispatcher's): split when the grid leaves SMs idle
    assert choose_segment("auto", **{**kw, "sms": 132}) == 1024
    assert choose_segment("auto", **{**kw, "sms": 132, "grid": 132}) is None
    assert choose_segment("auto", **{**kw, "sms": 132, "t": 2047}) is None  # T < 2L
    # slice groups of the square state grow until B·H·NS covers the SMs (at most 8)
    sg = dict(square=True, element_size=2)
    assert slice_groups(12, 1024, 32, 64, 132, **sg) == 8
    assert slice_groups(12, 1024, 32, 64, 48, **sg) == 4
    assert slice_groups(12, 1024, 32, 64, None, **sg) == 1  # no GPU: one group
    assert slice_groups(12, 1024, 32, 64, 132, square=False, element_size=2) == 1
    # F = E = 64 square, 12 heads, T = 32k: 12.8 MB per segment -> L = 2048 (16 segments)
    seg = segment_length(12, 32768, 64, 64, 64, square=True)
    assert seg == 2048 and -(-32768 // seg) * 12 * 64 * 64 * 65 * 4 <= SEGMENT_BYTES
    assert segment_length(10**4, 4096, 64, 128, 64, square=True) >= 4096  # none fits: sequential


def test_bad_layout_arguments():
    a, b, c = _inputs((2,), 8, 16, 32, square=True)
    with pytest.raises(ValueError, match="layout must be one of"):
        triton_lt_multiply_with_sums(a, b, c, square=True, layout="parallel")
    with pytest.raises(ValueError, match="segment_length must be a positive int"):
        triton_lt_multiply_with_sums(a, b, c, square=True, segment_length=0)


def test_autotune_configs_from_the_environment(monkeypatch):
    from polysketch.ops.triton._config import CONFIGS_ENV, autotune_configs

    monkeypatch.delenv(CONFIGS_ENV, raising=False)
    assert autotune_configs() == [(4, 1), (4, 2), (8, 1), (8, 2)]
    monkeypatch.setenv(CONFIGS_ENV, "4x1")
    assert autotune_configs() == [(4, 1)]
    monkeypatch.setenv(CONFIGS_ENV, " 4x2, 8X1 ")
    assert autotune_configs() == [(4, 2), (8, 1)]
    for bad in ("4", "3x1", "4x0", "x", "4x1,,"):
        monkeypatch.setenv(CONFIGS_ENV, bad)
        with pytest.raises(ValueError, match=CONFIGS_ENV):
            autotune_configs()
