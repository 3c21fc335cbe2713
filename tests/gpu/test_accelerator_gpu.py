"""CUDA-only checks of the accelerator path (``make test-gpu``; skipped without CUDA).

chunked_blocks in bf16 against the fp64 reference (flash-attention's rule), the dispatcher's
choice on CUDA, FlashAttention inside the model under bf16, inductor compilation at long T,
and linear growth of the training step's peak memory.
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import naive_lt_same_dtype
from polysketch import features, kernel_attention
from polysketch.nn import KernelAttention
from polysketch.ops import dispatch
from polysketch.ops.dispatch import resolve_algorithm

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA checks: run `make test-gpu` on a CUDA machine"
)
CUDA = torch.device("cuda")


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_blocks_half_within_twice_the_same_dtype_naive_error(dtype):
    fm = _map()
    q, k, v = _inputs(2048, dtype, h=4)
    phi_q, phi_k = fm.query(q), fm.key(k)
    exact = _naive(phi_q.double(), phi_k.double(), v.double())
    same = _naive(phi_q, phi_k, v)
    ours = kernel_attention(q, k, v, fm, causal=True, denominator_offset=1.0,
                            algorithm="chunked_blocks")  # fmt: skip
    assert ours.dtype == dtype
    assert _rel(ours, exact) <= 2 * _rel(same, exact)


def _naive(phi_q, phi_k, v):
    num, row_sums = naive_lt_same_dtype(phi_q, phi_k, v, square=True)
    return num / (row_sums.unsqueeze(-1) + 1)


def test_dispatch_on_cuda_picks_blocks_and_triton_only_when_switched_on(monkeypatch):
    q, k, v = _inputs(256, torch.bfloat16, h=2)
    phi = _map().query(q)
    monkeypatch.setattr(dispatch, "_TRITON_SWITCH", [False])  # the default: Triton is opt-in
    assert resolve_algorithm("chunked", phi, phi, v, square=True, with_state=False) == (
        "chunked_blocks"
    )
    dispatch.enable_triton()
    want = "triton" if dispatch.triton_backend() is not None else "chunked_blocks"
    assert resolve_algorithm("chunked", phi, phi, v, square=True, with_state=False) == want
    assert resolve_algorithm("chunked", phi, phi, v, square=True, with_state=True) == (
        "chunked_blocks"
    )  # no state in or out of the kernels: routed around
    assert dispatch.multiprocessor_count(q.device) >= 1


def test_model_softmax_runs_flash_attention_under_bf16():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layer = KernelAttention(768, 12, attention="softmax").to(CUDA)
    x = torch.randn(1, 1024, 768, device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = layer(x)  # raises "no available kernel" if q/k/v reached SDPA as fp32
    assert out.dtype == torch.bfloat16


def test_kernel_attention_compiles_with_inductor_at_8k():
    fm = _map()
    q, k, v = (x.requires_grad_(True) for x in _inputs(8192, torch.bfloat16))

    def fn(q, k, v):
        return kernel_attention(q, k, v, fm, causal=True, denominator_offset=1.0,
                                algorithm="chunked_blocks")  # fmt: skip

    out = torch.compile(fn, fullgraph=True)(q, k, v)
    out.float().pow(2).sum().backward()
    assert _rel(out.detach(), fn(q.detach(), k.detach(), v.detach())) < 2e-2


def test_training_step_memory_grows_linearly():
    fm = _map()
    peaks = {}
    for t in (16384, 65536):
        q, k, v = (x.requires_grad_(True) for x in _inputs(t, torch.bfloat16))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = kernel_attention(q, k, v, fm, causal=True, denominator_offset=1.0)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        peaks[t] = torch.cuda.max_memory_allocated() - base
        del q, k, v, out
    assert peaks[65536] <= 4.5 * peaks[16384]


@pytest.mark.parametrize("use_triton", [False, True])
def test_decode_steps_on_cuda_equal_the_full_forward(use_triton, monkeypatch):
    """linear_attention_step (the PyTorch step, or the fused Triton step when switched on):
    prefill + one-token steps equal the causal forward."""
    from polysketch.ops import linear_attention, linear_attention_step

    if use_triton and dispatch.triton_backend() is None:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(dispatch, "_TRITON_SWITCH", [use_triton])
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
