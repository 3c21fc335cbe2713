"""The dispatcher's CUDA decisions on CPU (``dispatch.device_type`` presents CPU tensors as
CUDA ones to the decisions alone; the Triton kernels' checks accept CPU tensors under the
interpreter, which tests/conftest.py sets without CUDA): Triton by default where measured
faster (bf16, squared F = 32, T >= TRITON_MIN_LENGTH), ``POLYSKETCH_TRITON`` on and off,
chunked_blocks everywhere else; and fp16 through the accelerator policy on CPU."""

import pytest
import torch

from conftest import naive_lt_same_dtype, rel_err
from polysketch import features, kernel_attention
from polysketch.ops import dispatch
from polysketch.ops.triton._validate import interpreting

pytestmark = pytest.mark.skipif(
    not interpreting() or dispatch.triton_backend() is None,
    reason="needs triton under TRITON_INTERPRET=1 (CPU tensors as the kernels' inputs)",
)
BF16 = torch.bfloat16
LONG = dispatch.TRITON_MIN_LENGTH


@pytest.fixture
def cuda(monkeypatch):
    """Every decision sees a CUDA device; the Triton mode starts from the environment."""
    monkeypatch.setattr(dispatch, "device_type", lambda device: "cuda")
    monkeypatch.setattr(dispatch, "_TRITON_SWITCH", [])
    monkeypatch.delenv("POLYSKETCH_TRITON", raising=False)
    return monkeypatch


def _args(t, f=32, e=64, dtype=BF16, lead=(1, 12)):
    """Features (..., T, F) and values (..., T, E) as stride-0 views: no T-sized memory."""
    a = torch.zeros(1, 1, 1, f, dtype=dtype).expand(*lead, t, f)
    return a, a, torch.zeros(1, 1, 1, e, dtype=dtype).expand(*lead, t, e)


def _pick(*args, square=True, with_state=False):
    return dispatch.resolve_algorithm("chunked", *args, square=square, with_state=with_state)


def test_default_picks_triton_only_where_measured_faster(cuda):
    assert dispatch.triton_mode() == "auto"
    assert _pick(*_args(LONG)) == "triton"
    assert _pick(*_args(4 * LONG)) == "triton"
    assert _pick(*_args(LONG, lead=(3, 4))) == "triton"  # any batch and heads
    assert _pick(*_args(LONG - 1)) == "chunked_blocks"  # shorter: not measured faster
    assert _pick(*_args(LONG // 2)) == "chunked_blocks"
    assert _pick(*_args(LONG, dtype=torch.float16)) == "chunked_blocks"  # fp32 kernels
    assert _pick(*_args(LONG, dtype=torch.float32)) == "chunked_blocks"
    assert _pick(*_args(LONG), square=False) == "chunked_blocks"  # plain maps: unmeasured
    assert _pick(*_args(LONG, f=64)) == "chunked_blocks"  # other F: unmeasured
    assert _pick(*_args(LONG), with_state=True) == "chunked_blocks"  # no state in the kernels
    assert _pick(*_args(LONG, e=48)) == "chunked_blocks"  # a shape the kernels refuse
    p = dispatch.plan("chunked", *_args(LONG), square=True, with_state=False, needs_grad=True)
    assert p.name == "triton" and p.backend is dispatch.BACKENDS["triton"]
    assert p.operand_dtype == BF16 and p.accumulate_dtype == torch.float32
    cuda.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _pick(*_args(LONG)) == "chunked_blocks"  # inductor fuses chunked_blocks itself


def test_threshold_is_the_named_constant(cuda):
    cuda.setattr(dispatch, "TRITON_MIN_LENGTH", 4096)
    assert _pick(*_args(4096)) == "triton"
    assert _pick(*_args(4095)) == "chunked_blocks"


def test_environment_switches_triton_off_and_on(cuda):
    cuda.setenv("POLYSKETCH_TRITON", "0")
    assert _pick(*_args(4 * LONG)) == "chunked_blocks"
    cuda.setattr(dispatch, "_TRITON_SWITCH", [])
    cuda.setenv("POLYSKETCH_TRITON", "1")  # on: every bf16 call the kernels support
    assert _pick(*_args(256)) == "triton"
    assert _pick(*_args(256, f=64), square=False) == "triton"
    assert _pick(*_args(256, dtype=torch.float16)) == "chunked_blocks"
    dispatch.enable_triton(None)  # back to the default
    assert _pick(*_args(256)) == "chunked_blocks" and _pick(*_args(LONG)) == "triton"
    dispatch.enable_triton(False)
    assert _pick(*_args(LONG)) == "chunked_blocks"
    # a named backend is never overridden by the mode
    assert dispatch.resolve_algorithm("triton", *_args(256), square=True,
                                      with_state=False) == "triton"  # fmt: skip


def test_without_the_triton_package_the_default_is_chunked_blocks(cuda):
    cuda.setattr(dispatch, "_BACKEND", [None])
    assert _pick(*_args(LONG)) == "chunked_blocks"


def test_fused_decode_step_only_when_switched_on(cuda):
    q = torch.zeros(1, 4, 1, 32)
    v = torch.zeros(1, 4, 1, 64)
    n, z = torch.zeros(1, 4, 544, 64), torch.zeros(1, 4, 544)

    def pick():
        return dispatch.decode_backend(q, q, v, n, z, square=True, key_padding_mask=None)

    assert pick() is None  # "auto": the PyTorch step (the fused step is not timed)
    dispatch.enable_triton()
    assert pick() is dispatch.triton_backend()
    keep = torch.ones(1, 4, 1, dtype=torch.bool)
    assert dispatch.decode_backend(q, q, v, n, z, square=True, key_padding_mask=keep) is None
    dispatch.enable_triton(False)
    assert pick() is None


def test_fp16_through_the_accelerator_policy(cuda):
    """kernel_attention on fp16 inputs with every decision an accelerator's (half operands,
    chunked_blocks): finite, and within twice the error of the best an fp16 output can be
    (the fp32 naive on the same fp16 inputs, rounded to fp16) against fp64. The fp16 naive
    itself overflows (row sums ~1e10 > 65504), so it cannot be the reference here."""
    g = torch.Generator().manual_seed(0)
    t, d = 512, 64
    q, k = (torch.nn.functional.layer_norm(torch.randn(1, 2, t, d, generator=g), (d,))
            for _ in range(2))  # fmt: skip
    v = torch.randn(1, 2, t, d, generator=g)
    q, k, v = (x.to(torch.float16) for x in (q, k, v))
    fm = features.create("polysketch", d, degree=2, num_features=32, nonnegative=True, seed=0)
    p = dispatch.plan("chunked", fm.query(q), fm.key(k), v, square=True, with_state=False,
                      needs_grad=False)  # fmt: skip
    assert p.name == "chunked_blocks" and p.operand_dtype == torch.float16

    def naive(phi_q, phi_k, v):
        num, rs = naive_lt_same_dtype(phi_q, phi_k, v, square=True)
        return num / (rs.unsqueeze(-1) + 1)

    phi_q, phi_k = fm.query(q), fm.key(k)
    exact = naive(phi_q.double(), phi_k.double(), v.double())
    best = naive(phi_q.float(), phi_k.float(), v.float()).to(torch.float16)
    assert not bool(torch.isfinite(naive(phi_q, phi_k, v)).all())  # fp16 arithmetic overflows
    ours = kernel_attention(q, k, v, fm, causal=True, denominator_offset=1.0, chunk_size=128)
    assert ours.dtype == torch.float16 and bool(torch.isfinite(ours).all())
    assert rel_err(ours.double(), exact) <= 2 * rel_err(best.double(), exact)
