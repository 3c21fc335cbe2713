"""The Triton kernels as torch custom ops (``polysketch.ops.triton.custom_ops``, issue 41 item 4):
schema, fake implementations and autograd (``torch.library.opcheck``); their dense CPU
reference (``cpu_reference()``) meets the kernels' own tests; ``torch.compile(fullgraph=True)``
captures a ``TransformerLM`` training step that runs them, forward and backward, with no graph
break (on a CPU: the reference behind the same ops; the kernels themselves are tested under the
interpreter by ``tests/test_ops_triton.py``, through the same ops)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import test_ops_triton as kernels  # noqa: E402  (its tests, rerun on the reference)
from conftest import rel_err  # noqa: E402
from numerics import gamma  # noqa: E402
from polysketch._device import presented_device  # noqa: E402
from polysketch.nn import TransformerConfig, TransformerLM  # noqa: E402
from polysketch.ops import dispatch  # noqa: E402
from polysketch.ops.triton import cpu_reference, custom_ops  # noqa: E402

OPS = torch.ops.polysketch


@pytest.mark.parametrize("square", [False, True])
def test_opcheck_schema_fake_and_autograd(square):
    g = torch.Generator().manual_seed(0)
    bh, t, f, e = 2, 20, 16, 32
    a, b, c = (torch.randn(bh, t, x, generator=g) for x in (f, f, e))
    dnum, drow = torch.randn(bh, t, e, generator=g), torch.randn(bh, t, generator=g)
    fs = f * (f // 2 + 1) if square else f
    n, z = torch.randn(bh, fs, e, generator=g), torch.randn(bh, fs, generator=g)
    with cpu_reference():
        torch.library.opcheck(OPS.lt_multiply_with_sums.default, (a, b, c, square, 16, 1, None))
        torch.library.opcheck(OPS.lt_multiply_with_sums_backward.default,
                              (a, b, c, dnum, drow, square, 16, 1, None))  # fmt: skip
        torch.library.opcheck(OPS.triton_decode_step.default,
                              (a[:, 0], b[:, 0], c[:, 0], n, z, square))  # fmt: skip


@pytest.mark.parametrize("square,f,e,t,lead,chunk,groups", kernels.FP32_CASES[::2])
def test_reference_meets_the_kernels_fp32_tests(square, f, e, t, lead, chunk, groups):
    with cpu_reference():
        kernels.test_fp32_outputs_and_gradients_match_naive(square, f, e, t, lead, chunk, groups)


@pytest.mark.parametrize("square,f,e", [(False, 16, 32), (True, 32, 64)])
def test_reference_meets_the_kernels_decode_tests(square, f, e):
    with cpu_reference():
        kernels.test_decode_step_matches_full_computation(square, f, e)
        kernels.test_decode_step_half_inputs_and_fp32_state()
        kernels.test_backward_saves_only_the_inputs()


# ----- the whole step, compiled -------------------------------------------------------------
def _model(n_layer: int, dtype=torch.float32):
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=64, n_layer=n_layer, n_head=2, n_embd=64,
                               chunk_size=32, attention="psf_random")  # fmt: skip
    return TransformerLM(config).to(dtype)


def _step(model, idx):
    """(logits, loss, parameter gradients) of one forward + backward."""
    model.zero_grad()
    logits, loss = model(idx, idx)
    loss.backward()
    return logits.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def triton_on_cuda_path(monkeypatch):
    """The CUDA path (``presented_device``) with the Triton mode "on" and fp32 among the
    dtypes it takes (so that the comparison below is at fp32's precision), the custom ops
    running their CPU reference."""
    monkeypatch.setattr(dispatch, "_TRITON_SWITCH", ["on"])
    monkeypatch.setattr(dispatch, "TRITON_DEFAULT_DTYPES", (torch.bfloat16, torch.float32))
    torch._dynamo.reset()
    with presented_device("cuda"), cpu_reference():
        yield
    torch._dynamo.reset()


def test_compiled_training_step_captures_the_kernels_and_matches_eager(triton_on_cuda_path):
    """aot_eager traces forward and backward (AOTAutograd): the forward graph holds the
    forward op, the backward graph the backward op, with ``fullgraph=True``. Tolerances: the
    compiled, eager and ``chunked_blocks`` steps compute the same sums in other orders (n <=
    T + F' = 80 + 544 terms, γ_n in fp32 = 3.7e-5), amplified by at most 100 for logits and
    loss and 10³ for gradients (the conditions ``tests/test_nn_golden.py`` estimates for such
    models at init)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, example_inputs):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    model = _model(2)
    idx = torch.randint(0, 64, (2, 80), generator=torch.Generator().manual_seed(1))
    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got = _step(compiled, idx)
    assert len(graphs) == 2  # one forward, one backward: no graph break
    assert graphs[0].count("polysketch.lt_multiply_with_sums.default") == 2  # one per layer
    assert graphs[1].count("polysketch.lt_multiply_with_sums_backward.default") == 2
    eager = _step(model, idx)
    dispatch._TRITON_SWITCH[:] = ["off"]
    blocks = _step(model, idx)  # chunked_blocks, the default path
    tol = gamma(80 + 544, torch.float32)
    for ref in (eager, blocks):
        assert rel_err(got[0], ref[0]) <= 100 * tol and rel_err(got[1], ref[1]) <= 100 * tol
        for g, r in zip(got[2], ref[2], strict=True):
            assert rel_err(g, r) <= 1e3 * tol


def test_bf16_autocast_step_is_one_graph_with_the_kernels(triton_on_cuda_path):
    """The realistic dtype: bf16 under autocast picks the kernels in mode "on"; Dynamo
    captures the step as one graph holding the op (backend "eager": capture only)."""
    graphs = []

    def capture(gm, example_inputs):  # with the subgraphs (the recomputed attention's body)
        graphs.append(gm.print_readable(print_output=False))
        return gm.forward

    model = _model(1)
    idx = torch.randint(0, 64, (2, 80), generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(model, fullgraph=True, backend=capture)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = compiled(idx, idx)
    loss.backward()
    assert len(graphs) == 1 and "polysketch.lt_multiply_with_sums" in graphs[0]
    assert torch.isfinite(loss)


def test_compile_keeps_chunked_blocks_in_auto_mode(monkeypatch):
    """ "auto" picks the kernels from ``TRITON_MIN_LENGTH`` tokens eagerly, but under
    ``torch.compile`` only in mode "on" (the compiled step was not timed both ways)."""
    monkeypatch.setattr(dispatch, "_TRITON_SWITCH", ["auto"])
    monkeypatch.setattr(dispatch, "TRITON_MIN_LENGTH", 16)
    a = torch.randn(1, 2, 40, 32, dtype=torch.bfloat16)
    c = torch.randn(1, 2, 40, 32, dtype=torch.bfloat16)
    seen = []

    def resolve(a, c):
        seen.append(dispatch.resolve_algorithm("chunked", a, a, c, square=True, with_state=False))
        return a

    torch._dynamo.reset()
    with presented_device("cuda"), cpu_reference():
        resolve(a, c)
        torch.compile(resolve, fullgraph=True, backend="eager")(a, c)
        dispatch._TRITON_SWITCH[:] = ["on"]
        torch._dynamo.reset()
        torch.compile(resolve, fullgraph=True, backend="eager")(a, c)
    torch._dynamo.reset()
    assert seen == ["triton", "chunked_blocks", "triton"]


def test_ops_are_registered_with_the_torch_library():
    for name in custom_ops.__all__:  # torch.ops.polysketch.<name>
        assert hasattr(OPS, name), name
