"""Fused Triton kernels for causal (polynomial-sketch) linear attention (optional).

``triton_lt_multiply_with_sums`` computes, for A, B (..., T, F) and C (..., T, E),

    num = lt((A Bᵀ)^{∘q}) C   (..., T, E),      row_sums = lt((A Bᵀ)^{∘q}) 1   (..., T),

q = 2 if ``square`` else 1, lt the causal lower triangle including the diagonal, by
PolySketchFormer's block lower-triangular multiplication (Theorem 3.1) in fused kernels that
never write the self-tensored features Φ(x) = x⊗x or scores to HBM (``_forward``,
``_backward``); states are carried on chip over the blocks, or with ``layout="split"``
stored once per segment of L tokens and prefix-summed (``_layout``). ``triton_decode_step``
is the fused one-token state update and read (``_decode``). Importable without triton:
``available()`` says whether the kernels can run, ``unsupported_reason`` whether they handle
given inputs. On CPU they run under Triton's interpreter when ``TRITON_INTERPRET=1`` (slow;
used by the tests). The kernels are torch custom ops (``custom_ops``: fake implementations and
autograd), so ``torch.compile(fullgraph=True)`` captures them; inside ``cpu_reference()`` those
ops run a dense PyTorch reference on CPU tensors (compiling and tracing without a GPU).
"""

from __future__ import annotations

import torch

from ._validate import (
    check_decode_inputs,
    check_inputs,
    cpu_reference,
    interpreting,
    reference_on_cpu,
)

__all__ = [
    "lt_multiply",
    "available",
    "cpu_reference",
    "unsupported_reason",
    "decode_unsupported_reason",
    "triton_lt_multiply_with_sums",
    "triton_decode_step",
]


_IMPORTABLE: list[bool] = []


@torch.compiler.assume_constant_result  # traced code reads the answer, not the import
def _triton_importable() -> bool:
    """Whether ``import triton`` works (tried once, on first use: not at package import)."""
    if not _IMPORTABLE:
        try:
            import triton  # noqa: F401
        except ImportError:
            _IMPORTABLE.append(False)
        else:
            _IMPORTABLE.append(True)
    return _IMPORTABLE[0]


def available() -> bool:
    """True when triton is importable and kernels can run (CUDA, or ``TRITON_INTERPRET=1``,
    or their reference inside ``cpu_reference()``)."""
    return _triton_importable() and (
        torch.cuda.is_available() or interpreting() or reference_on_cpu()
    )


def unsupported_reason(a, b, c, *, square: bool) -> str | None:
    """``None`` if the kernels handle A, B (..., T, F), C (..., T, E) with this ``square``,
    else a sentence naming the argument and the limit (F in (16, 32, 64) squared, up to 256
    plain; E in (32, 64, 128); fp32/bf16/fp16; one CUDA device, or CPU under the
    interpreter; triton installed)."""
    if not _triton_importable():
        return "the Triton kernels need the triton package (pip install polysketch[triton])"
    problem = check_inputs(a, b, c, square=square)
    return None if problem is None else problem[1]


def decode_unsupported_reason(phi_q, phi_k, v, numerator, denominator, *, square: bool):
    """``None`` if ``triton_decode_step`` handles these arguments, else a sentence naming the
    argument (one token, F and E as ``unsupported_reason``, fp32 state of the
    ``LinearAttentionState`` layout, no input requiring grad, one CUDA device)."""
    if not _triton_importable():
        return "the Triton kernels need the triton package (pip install polysketch[triton])"
    problem = check_decode_inputs(phi_q, phi_k, v, numerator, denominator, square=square)
    return None if problem is None else problem[1]


def triton_lt_multiply_with_sums(
    a, b, c, *, square: bool, chunk_size: int = 64, layout: str = "auto",
    segment_length: int | None = None, sms: int | None = None,
):  # fmt: skip
    """num = lt((A Bᵀ)^{∘q}) C and row_sums = lt((A Bᵀ)^{∘q}) 1, q = 2 if ``square`` else 1.

    Shapes: a, b (..., T, F), c (..., T, E), any leading dims, one dtype (fp32, bf16, fp16)
    and device (non-contiguous inputs are copied) -> num (..., T, E) fp32, row_sums (..., T)
    fp32. Any T >= 1 (the last block is masked). Differentiable w.r.t. a, b, c: the backward
    recomputes from the inputs (memory O(T·(F + E)) plus one F²·E fp32 scratch state per
    batch·head when square, or the segment states of the split layout).

    Kernels: one sequential pass over blocks per (batch·head, value tile[, slice group]),
    state carried on chip (see ``_forward``, ``_backward``); with ``layout="split"`` T is cut
    into segments of ``segment_length`` tokens L whose states are computed in parallel, summed
    over the earlier segments (a prefix sum), and each segment then runs that pass from its
    prefix (``_layout``). ``"auto"`` (default) splits only given the GPU's multiprocessor
    count ``sms`` (``polysketch.ops.dispatch.multiprocessor_count``, which the dispatcher
    passes), when the sequential grid BH·(E/BE)·NS is below it and T >= 2·L; ``"sequential"``
    never. ``sms`` also sizes NS (``_config.slice_groups``); None (the default, and under the
    interpreter): NS = 1 and no automatic split. L defaults to
    the smallest 1024·2^k whose fp32 segment states stay within 256 MiB; a given
    ``segment_length`` is rounded up to a multiple of BT; T <= L runs the sequential pass.
    Both layouts were timed on an H100 (``benchmarks/triton_layouts.py``; ``docs/gpu.md``).

    fp16 inputs run the fp32 kernels: the in-block scores (A·B)² and the carried states that
    the half kernels feed back into ``tl.dot`` as half operands exceed fp16's 65504 for
    LayerNorm'd q, k (bf16 has fp32's range); gradients are returned in fp16.

    ``chunk_size`` is the block length BT of Theorem 3.1, rounded to the largest power of two
    <= chunk_size in [16, 64] (32 for fp32 inputs: register budget) and no longer than T
    rounded up to a power of two.
    Warps (4, 8) and pipeline stages (1, 2) are autotuned on the GPU; BT is not (it is the
    caller's chunk_size). Errors: TypeError/ValueError naming the argument (see
    ``unsupported_reason``).
    """
    from .function import lt_multiply_with_sums

    return lt_multiply_with_sums(
        a, b, c, square=square, chunk_size=chunk_size, layout=layout,
        segment_length=segment_length, sms=sms,
    )  # fmt: skip


def lt_multiply(
    a, b, c, *, square: bool, chunk_size: int, initial=None, return_state: bool = False,
    group_bytes=None, sms: int | None = None,
):  # fmt: skip
    """The backend contract (``polysketch.ops.dispatch``): (num, den, None).

    The fused kernels neither take nor return a state (the backend table declares it, so the
    dispatcher never passes one): ``initial`` must be ``None`` and ``return_state`` False.
    ``group_bytes`` is unused; ``sms`` the GPU's multiprocessor count (the dispatcher's). See
    ``triton_lt_multiply_with_sums``.
    """
    if initial is not None or return_state:
        raise ValueError("the Triton kernels take no initial state and return none")
    num, den = triton_lt_multiply_with_sums(a, b, c, square=square, chunk_size=chunk_size, sms=sms)
    return num, den, None


def triton_decode_step(phi_q, phi_k, v, numerator, denominator, *, square: bool):
    """One decoding step: N' = N + Ψ(k)⊗v, Z' = Z + Ψ(k), num = Ψq(q)·N', den = Ψq(q)·Z'.

    Ψ = Ψq = identity, or with ``square`` the pair features ψ and ω ⊙ ψ (``ops.pairs``, never
    formed in memory). Shapes: phi_q, phi_k (..., 1, F), v (..., 1, E); numerator N (..., F', E),
    denominator Z (..., F') fp32 with F' = F, or F(⌊F/2⌋+1) with ``square`` (the
    ``LinearAttentionState`` layout) -> num (..., 1, E), den (..., 1),
    N', Z' (new fp32 tensors; the inputs are not modified). The new token sees itself, as in
    ``linear_attention_step(..., normalize=False)``. No autograd: inputs that require grad
    are refused (ValueError).
    """
    from .function import decode_step

    return decode_step(phi_q, phi_k, v, numerator, denominator, square=square)
