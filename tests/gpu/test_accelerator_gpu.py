"""CUDA-only checks of the accelerator path (``make test-gpu``, ``make gpu-check``; skipped
without CUDA).

Every path the default dispatch can pick on CUDA, outputs and gradients against fp64:
``chunked_blocks`` in fp32, bf16 (one group and several) and fp16, the Triton kernels at the
bench's shape from ``TRITON_MIN_LENGTH`` tokens, and the block function under mixed attention
(psf_mixed's exact local blocks, soft_hash_far's reads of earlier blocks only). Rules: fp32
≤ 1e-4 relative (fp32 rounding over sums of ~10⁴ terms); bf16 ≤ 2× the error of the naive
reference computed in bf16 (flash-attention's rule); fp16 ≤ 2× the error of the best an fp16
result can be, the fp32 naive on the same inputs rounded to fp16 (the fp16 naive itself
overflows: degree-4 row sums of LayerNorm'd q, k reach ~10¹⁰ > 65504). Then the dispatcher's
choices, FlashAttention inside the model under bf16, inductor at 8k and linear memory growth.
Shapes are as small as each property needs: the kernels' compilation, not their run, is what
these tests spend.
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import naive_lt_same_dtype
from polysketch import features, kernel_attention
from polysketch.nn import KernelAttention
from polysketch.ops import dispatch, linear_attention, mixed_attention
from polysketch.ops.dispatch import resolve_algorithm

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA checks: run `make test-gpu` on a CUDA machine"
)
CUDA = torch.device("cuda")
F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _inputs(t, dtype, h=12, d=64, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    q, k = (F.layer_norm(torch.randn(1, h, t, d, device=CUDA, generator=g), (d,)) for _ in "qk")
    v = torch.randn(1, h, t, d, device=CUDA, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _map(d=64):
    return features.create("polysketch", d, degree=2, num_features=32, nonnegative=True,
                           seed=0).to(CUDA)  # fmt: skip


def _features(t, dtype, h=12):
    """psf_random's features (computed in fp32, then cast) of LayerNorm'd q, k, and values."""
    fm = _map()
    q, k, v = _inputs(t, F32, h=h)
    return fm.query(q).to(dtype), fm.key(k).to(dtype), v.to(dtype)


def _normalized_naive(phi_q, phi_k, v):
    num, rs = naive_lt_same_dtype(phi_q, phi_k, v, square=True)
    return num / (rs.unsqueeze(-1) + 1)


def _out_and_grads(fn, xs, w, dtype):
    """fn's output and the gradients of Σ w∘out w.r.t. the inputs xs, computed in ``dtype``."""
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in xs]
    out = fn(*leaves)
    (out * w.to(out.dtype)).sum().backward()
    return [out.detach(), *(x.grad for x in leaves)]


def _check(got, xs, w, dtype, reference, heads):
    """``got`` (output, gradients) against fp64 by the rule of ``dtype`` (module docstring),
    on the given heads (the reference materialises T×T scores per head)."""
    names = ("out", "dq", "dk", "dv")
    for h in heads:
        sub = [x[:, h : h + 1] for x in xs]
        wh = w[:, h : h + 1]
        exact = _out_and_grads(reference, sub, wh, F64)
        if dtype == F32:
            for name, x, y in zip(names, got, exact, strict=True):
                assert _rel(x[:, h : h + 1], y) <= 1e-4, (name, h)
            continue
        if dtype == BF16:
            same = _out_and_grads(reference, sub, wh, BF16)
        else:  # fp16: the fp32 naive on the same inputs, rounded to fp16
            same = [x.to(F16) for x in _out_and_grads(reference, sub, wh, F32)]
        for name, x, s, y in zip(names, got, same, exact, strict=True):
            assert bool(torch.isfinite(x).all()), (name, h)
            assert _rel(x[:, h : h + 1], y) <= 2 * _rel(s, y), (name, h)


def _weights(like, dtype):
    """Random output weights of the loss, rounded to ``dtype`` (exact in every reference)."""
    g = torch.Generator(CUDA).manual_seed(1)
    return torch.randn(like.shape, device=CUDA, generator=g).to(dtype)


def _spy(monkeypatch):
    seen, real = [], dispatch.plan

    def plan(*args, **kwargs):
        p = real(*args, **kwargs)
        seen.append(p.name)
        return p

    from polysketch.ops import kernel

    monkeypatch.setattr(kernel, "plan", plan)
    return seen


DEFAULT_PATHS = [  # (dtype, T, heads, Triton mode, the backend "chunked" must pick)
    (F32, 2048, 4, "auto", "chunked_blocks"),
    (F16, 2048, 4, "auto", "chunked_blocks"),
    (BF16, dispatch.TRITON_MIN_LENGTH // 2, 4, "auto", "chunked_blocks"),  # below the threshold
    (BF16, 8192, 12, "off", "chunked_blocks"),  # several groups (ACCELERATOR_GROUP_BYTES)
    (BF16, dispatch.TRITON_MIN_LENGTH, 4, "auto", "triton"),  # the shortest Triton call
    (BF16, 16384, 12, "auto", "triton"),  # the bench's shape: split layout
]


@pytest.mark.parametrize("dtype,t,h,mode,backend", DEFAULT_PATHS)
def test_default_dispatch_outputs_and_gradients(dtype, t, h, mode, backend, monkeypatch):
    monkeypatch.setattr(dispatch, "_TRITON_SWITCH", [mode])
    if backend == "triton" and dispatch.triton_backend() is None:
        pytest.skip("triton is not installed")
    xs = _features(t, dtype, h=h)  # rounded to dtype: the same inputs for every reference
    w = _weights(xs[2], dtype)
    seen = _spy(monkeypatch)

    def ours(phi_q, phi_k, v):
        return linear_attention(phi_q, phi_k, v, causal=True, square=True,
                                denominator_offset=1.0)  # fmt: skip

    got = _out_and_grads(ours, xs, w, dtype)
    assert seen == [backend]
    assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[1:])
    _check(got, xs, w, dtype, _normalized_naive, heads=(0, h - 1))


def _mixed_naive(local):
    """Mixed attention in the inputs' dtype (psf_mixed: exact (q·k)⁴ in the block of
    ``CHUNK`` rows; local="none": the earlier blocks only), T×T scores materialised."""

    def fn(q, k, v, phi_q, phi_k):
        t = q.shape[-2]
        pos = torch.arange(t, device=q.device)
        blk = pos // CHUNK
        same = (blk[:, None] == blk[None, :]) & (pos[None, :] <= pos[:, None])
        earlier = blk[None, :] < blk[:, None]
        feat = (phi_q @ phi_k.mT).square()
        exact = (q @ k.mT) ** 4 if local == "polynomial" else torch.zeros_like(feat)
        s = torch.where(same, exact, torch.where(earlier, feat, feat.new_zeros(())))
        return (s @ v) / (s.sum(-1, keepdim=True) + 1)

    return fn


CHUNK = 256


@pytest.mark.parametrize("local", ["polynomial", "none"])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_mixed_attention_block_function(local, dtype):
    """psf_mixed (local="polynomial") and soft_hash_far (local="none") run the block function
    of ``chunked_blocks`` on CUDA: outputs and gradients of q, k, v and the features."""
    fm = _map()
    q, k, v = _inputs(1024, F32, h=2)
    xs = [x.to(dtype) for x in (q, k, v, fm.query(q), fm.key(k))]
    w = _weights(v, dtype)

    def ours(q, k, v, phi_q, phi_k):
        return mixed_attention(q, k, v, phi_q, phi_k, chunk_size=CHUNK, local=local, degree=4,
                               square=True, denominator_offset=1.0)  # fmt: skip

    got = _out_and_grads(ours, xs, w, dtype)
    names = ("out", "dq", "dk", "dv", "dphi_q", "dphi_k")
    exact = _out_and_grads(_mixed_naive(local), xs, w, F64)
    if dtype == BF16:
        same = _out_and_grads(_mixed_naive(local), xs, w, BF16)
    else:
        same = [None if x is None else x.to(F16)
                for x in _out_and_grads(_mixed_naive(local), xs, w, F32)]  # fmt: skip
    for name, x, s, y in zip(names, got, same, exact, strict=True):
        if local == "none" and name in ("dq", "dk"):
            assert x is None or float(x.abs().max()) == 0.0, name  # no in-block scores
            continue
        assert bool(torch.isfinite(x).all()), name
        assert _rel(x, y) <= 2 * _rel(s, y), name


def test_dispatch_on_cuda(monkeypatch):
    """The default ("auto"): Triton for the measured case from TRITON_MIN_LENGTH on,
    chunked_blocks elsewhere; POLYSKETCH_TRITON=0 (off) never; =1 (on) every bf16 call."""
    long = dispatch.TRITON_MIN_LENGTH
    args = {t: _features(t, BF16, h=1) for t in (256, long)}

    def pick(t, with_state=False):
        return resolve_algorithm("chunked", *args[t], square=True, with_state=with_state)

    has_triton = dispatch.triton_backend() is not None
    monkeypatch.setattr(dispatch, "_TRITON_SWITCH", ["auto"])
    assert pick(long) == ("triton" if has_triton else "chunked_blocks")
    assert pick(256) == "chunked_blocks"
    assert pick(long, with_state=True) == "chunked_blocks"  # no state in or out of the kernels
    dispatch.enable_triton(False)
    assert pick(long) == "chunked_blocks"
    dispatch.enable_triton(True)
    assert pick(256) == ("triton" if has_triton else "chunked_blocks")
    assert dispatch.multiprocessor_count(CUDA) >= 1


def test_model_softmax_runs_flash_attention_under_bf16():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layer = KernelAttention(768, 12, attention="softmax").to(CUDA)
    x = torch.randn(1, 1024, 768, device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = layer(x)  # raises "no available kernel" if q/k/v reached SDPA as fp32
    assert out.dtype == torch.bfloat16


def test_kernel_attention_compiles_with_inductor_at_8k():
    """8k tokens at B·H = 12: chunked_blocks runs two groups, a Python loop dynamo unrolls."""
    fm = _map()
    q, k, v = (x.requires_grad_(True) for x in _inputs(8192, torch.bfloat16))

    def fn(q, k, v):
        return kernel_attention(q, k, v, fm, causal=True, denominator_offset=1.0,
                                algorithm="chunked_blocks")  # fmt: skip

    out = torch.compile(fn, fullgraph=True)(q, k, v)
    out.float().pow(2).sum().backward()
    assert _rel(out.detach(), fn(q.detach(), k.detach(), v.detach())) < 2e-2


@pytest.mark.parametrize("algorithm", ["chunked", "chunked_blocks"])
def test_training_step_memory_grows_linearly(algorithm, monkeypatch):
    """The default (Triton at these lengths) and chunked_blocks: peak memory of forward +
    backward at 64k within 4.5× that at 16k (linear: 4×; T² would be 16×)."""
    monkeypatch.setattr(dispatch, "_TRITON_SWITCH", ["auto"])
    fm = _map()
    peaks = {}
    for t in (16384, 65536):
        q, k, v = (x.requires_grad_(True) for x in _inputs(t, torch.bfloat16))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = kernel_attention(q, k, v, fm, causal=True, denominator_offset=1.0,
                               algorithm=algorithm)  # fmt: skip
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        peaks[t] = torch.cuda.max_memory_allocated() - base
        del q, k, v, out
    assert peaks[65536] <= 4.5 * peaks[16384]


@pytest.mark.parametrize("use_triton", [False, True])
def test_decode_steps_on_cuda_equal_the_full_forward(use_triton, monkeypatch):
    """linear_attention_step (the PyTorch step, or the fused Triton step when switched on):
    prefill + one-token steps equal the causal forward."""
    from polysketch.ops import linear_attention_step

    if use_triton and dispatch.triton_backend() is None:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(dispatch, "_TRITON_SWITCH", ["on" if use_triton else "auto"])
    fm = _map()
    q, k, v = _inputs(300, torch.float32, h=4)
    phi_q, phi_k = fm.query(q), fm.key(k)
    full = linear_attention(phi_q, phi_k, v, causal=True, square=True, denominator_offset=1.0)
    _, state = linear_attention(phi_q[..., :200, :], phi_k[..., :200, :], v[..., :200, :],
                                causal=True, square=True, return_state=True)  # fmt: skip
    outs = []
    for i in range(200, 300):
        out, state = linear_attention_step(
            phi_q[..., i : i + 1, :], phi_k[..., i : i + 1, :], v[..., i : i + 1, :], state,
            square=True, denominator_offset=1.0,
        )  # fmt: skip
        outs.append(out)
    assert state.length == 300
    assert _rel(torch.cat(outs, dim=-2), full[..., 200:, :]) < 1e-4
