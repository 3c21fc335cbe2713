"""linear_attention(..., algorithm="triton") through the dispatcher, on CPU under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA): normalizer, offset and
key padding around the fused kernels, gradients, and the refusals that name the reason."""

import pytest
import torch

from conftest import rel_err
from polysketch.ops import linear_attention, naive_linear_attention
from polysketch.ops.dispatch import resolve_algorithm, triton_backend

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    triton_backend() is None, reason="the Triton kernels cannot run here (no CUDA, no interpreter)"
)


def _inputs(t, f, e, square, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (0.5 * torch.randn(2, t, f, generator=g) for _ in range(2))
    if not square:
        q, k = q.exp(), k.exp()
    return q, k, torch.randn(2, t, e, generator=g)


@pytest.mark.parametrize("square", [False, True])
def test_forced_triton_matches_naive_with_offset_and_padding(square):
    q, k, v = _inputs(70, 16, 32, square)
    keep = torch.rand(2, 70, generator=torch.Generator().manual_seed(1)) > 0.2
    kw = dict(causal=True, square=square, denominator_offset=1.0, key_padding_mask=keep)
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = linear_attention(*xs, algorithm="triton", chunk_size=16, **kw)
    ref_xs = [x.double().requires_grad_(True) for x in (q, k, v)]
    ref = naive_linear_attention(*ref_xs, **kw)
    assert out.dtype == torch.float32
    assert rel_err(out.double(), ref) < 1e-4
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((out.double() * w).sum(), xs)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_xs)
    for g, rg in zip(grads, ref_grads, strict=True):
        assert rel_err(g.double(), rg) < 1e-4


def test_forced_triton_refusals_name_the_reason():
    q, k, v = _inputs(20, 16, 32, True)
    with pytest.raises(ValueError, match="return_state"):
        linear_attention(q, k, v, causal=True, square=True, algorithm="triton", return_state=True)
    q5, k5 = q[..., :5], k[..., :5]
    with pytest.raises(ValueError, match='algorithm="triton" cannot run'):
        linear_attention(q5, k5, v, causal=True, square=True, algorithm="triton")
    # "chunked" never picks the kernels on CPU (CUDA: tests/test_ops_dispatch_default.py)
    assert resolve_algorithm("chunked", q, k, v, square=True, with_state=False) == "chunked_scan"
