"""The Triton kernels as torch custom ops (``torch.library``): ``torch.compile(fullgraph=True)``
captures a step that calls them (no graph break: Dynamo sees one op, not Triton's Python
launcher), and CUDA graphs can record them.

    polysketch::lt_multiply_with_sums(a, b, c, square, bt, ns, segment) -> (num, row_sums)
    polysketch::lt_multiply_with_sums_backward(a, b, c, dnum, drow, square, bt, ns, segment)
        -> (da, db, dc)
    polysketch::triton_decode_step(q, k, v, n, z, square) -> (num, den, n2, z2)

Arguments are those of ``_forward.forward``, ``_backward.backward`` and ``_decode.decode``:
contiguous flattened A, B (BH, T, F), C (BH, T, E) of one dtype (fp32 or bf16; fp16 is cast
by ``function``), BT, the slice groups NS and the split layout's segment (None: sequential).
Outputs are fp32 and alias no input (at most a view of the op's own buffer, which
``torch.library.opcheck`` accepts). Each op has a fake (meta) implementation giving those
shapes and dtypes; the forward op has autograd (``register_autograd``: it saves A, B, C and
the backward op recomputes, as the kernels do).

Implementations: the kernels on CUDA tensors and, under ``TRITON_INTERPRET=1``, on CPU ones;
on CPU tensors inside ``cpu_reference()`` the dense reference (``_reference``), so a compiled
step with these ops runs on a CPU in seconds. Triton is imported by the kernels' modules when
an op first runs them, not here.
"""

from typing import Optional

import torch

from . import _reference
from ._validate import reference_on_cpu

__all__ = ["lt_multiply_with_sums", "lt_multiply_with_sums_backward", "triton_decode_step"]

_F32 = torch.float32


def _reference_for(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and reference_on_cpu()


@torch.library.custom_op("polysketch::lt_multiply_with_sums", mutates_args=())
def lt_multiply_with_sums(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, square: bool, bt: int, ns: int,
    segment: Optional[int],  # noqa: UP045 (torch.library reads the annotation)
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """num = lt((A Bᵀ)^{∘q}) C (BH, T, E) and row_sums = lt((A Bᵀ)^{∘q}) 1 (BH, T), fp32."""
    if _reference_for(a):
        return _reference.lt_multiply_with_sums(a, b, c, square=square)
    from ._forward import forward

    return forward(a, b, c, square=square, bt=bt, ns=ns, segment=segment)


@lt_multiply_with_sums.register_fake
def _(a, b, c, square, bt, ns, segment):
    bh, t, _ = a.shape
    return a.new_empty(bh, t, c.shape[-1], dtype=_F32), a.new_empty(bh, t, dtype=_F32)


@torch.library.custom_op("polysketch::lt_multiply_with_sums_backward", mutates_args=())
def lt_multiply_with_sums_backward(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dnum: torch.Tensor, drow: torch.Tensor,
    square: bool, bt: int, ns: int,
    segment: Optional[int],  # noqa: UP045 (torch.library reads the annotation)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """dA, dB (BH, T, F) and dC (BH, T, E), fp32, recomputed from A, B, C."""
    if _reference_for(a):
        return _reference.lt_multiply_with_sums_backward(a, b, c, dnum, drow, square=square)
    from ._backward import backward

    return backward(a, b, c, dnum, drow, square=square, bt=bt, ns=ns, segment=segment)


@lt_multiply_with_sums_backward.register_fake
def _(a, b, c, dnum, drow, square, bt, ns, segment):
    return (a.new_empty(a.shape, dtype=_F32), b.new_empty(b.shape, dtype=_F32),
            c.new_empty(c.shape, dtype=_F32))  # fmt: skip


def _setup_context(ctx, inputs, output):
    a, b, c, square, bt, ns, segment = inputs
    ctx.save_for_backward(a, b, c)
    ctx.config = (square, bt, ns, segment)


def _backward(ctx, dnum, drow):
    a, b, c = ctx.saved_tensors
    if dnum is None:
        dnum = a.new_zeros(*a.shape[:-1], c.shape[-1], dtype=_F32)
    if drow is None:
        drow = a.new_zeros(a.shape[:-1], dtype=_F32)
    da, db, dc = lt_multiply_with_sums_backward(a, b, c, dnum, drow, *ctx.config)
    return da.to(a.dtype), db.to(b.dtype), dc.to(c.dtype), None, None, None, None


lt_multiply_with_sums.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("polysketch::triton_decode_step", mutates_args=())
def triton_decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: torch.Tensor, z: torch.Tensor,
    square: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """num (BH, E), den (BH,), N' (BH, F', E), Z' (BH, F'), fp32, for q, k (BH, F), v (BH, E),
    N (BH, F', E), Z (BH, F') fp32 (the inputs are not modified)."""
    if _reference_for(q):
        return _reference.decode_step(q, k, v, n, z, square=square)
    from ._decode import decode

    return decode(q, k, v, n, z, square=square)


@triton_decode_step.register_fake
def _(q, k, v, n, z, square):
    bh, e = v.shape
    return (q.new_empty(bh, e, dtype=_F32), q.new_empty(bh, dtype=_F32),
            torch.empty_like(n), torch.empty_like(z))  # fmt: skip
