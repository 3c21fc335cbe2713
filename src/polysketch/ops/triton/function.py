"""The Triton kernels behind their Python entry points: lt((A Bᵀ)^{∘q}) C and its row sums,
and the decode step: argument checks, the launch configuration, then the custom ops of
``custom_ops`` (autograd, fake implementations: ``torch.compile`` captures them).

Imported lazily by ``polysketch.ops.triton`` (it imports triton and defines the kernels).
"""

from __future__ import annotations

import torch

from ..pairs import state_dim
from . import custom_ops
from ._config import block_e, block_t, slice_groups
from ._layout import LAYOUTS, choose_segment
from ._validate import check_decode_inputs, check_inputs

__all__ = ["lt_multiply_with_sums", "decode_step"]


def _raise(problem) -> None:
    if problem is not None:
        kind, sentence = problem
        raise kind(sentence)


def lt_multiply_with_sums(
    a, b, c, *, square: bool, chunk_size: int = 64, layout: str = "auto",
    segment_length: int | None = None, groups: int | None = None, sms: int | None = None,
):  # fmt: skip
    """See ``polysketch.ops.triton.triton_lt_multiply_with_sums``; ``groups`` overrides the
    number of slice groups NS of the square state (``_config.slice_groups``; tests); ``sms``
    the GPU's multiprocessor count (None: no GPU, as under the interpreter)."""
    _raise(check_inputs(a, b, c, square=square))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    lead, t, f, e = a.shape[:-2], a.shape[-2], a.shape[-1], c.shape[-1]
    if a.dtype == torch.float16:  # fp16's range cannot hold the scores and states: fp32
        a, b, c = (x.float() for x in (a, b, c))  # kernels (gradients come back as fp16)
    flat = [x.reshape(-1, t, x.shape[-1]).contiguous() for x in (a, b, c)]
    bh = flat[0].shape[0]
    if groups is None:
        groups = slice_groups(bh, t, f, e, sms, square=square, element_size=a.element_size())
    elif not (square and isinstance(groups, int) and groups >= 1 and f % groups == 0):
        raise ValueError(f"groups must divide F={f} (square only), got {groups!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if segment_length is not None and (
        isinstance(segment_length, bool)
        or not isinstance(segment_length, int)
        or segment_length < 1
    ):
        raise ValueError(f"segment_length must be a positive int or None, got {segment_length!r}")
    bt = block_t(chunk_size, t, f, a.element_size())
    be = block_e(f, e, square=square, element_size=a.element_size())
    segment = choose_segment(
        layout, bh=bh, t=t, f=f, e=e, bt=bt, grid=bh * -(-e // be) * groups, square=square,
        sms=sms, requested=segment_length,
    )  # fmt: skip
    num, rs = custom_ops.lt_multiply_with_sums(*flat, square, bt, groups, segment)
    return num.reshape(*lead, t, e), rs.reshape(*lead, t)


def decode_step(phi_q, phi_k, v, numerator, denominator, *, square: bool):
    """See ``polysketch.ops.triton.triton_decode_step``."""
    _raise(check_decode_inputs(phi_q, phi_k, v, numerator, denominator, square=square))
    lead, f, e = phi_q.shape[:-2], phi_q.shape[-1], v.shape[-1]
    fs = state_dim(f, square)
    q, k = (x.reshape(-1, f).contiguous() for x in (phi_q, phi_k))
    vv = v.reshape(-1, e).contiguous()
    n = numerator.reshape(-1, fs, e).contiguous()
    z = denominator.reshape(-1, fs).contiguous()
    num, den, n2, z2 = custom_ops.triton_decode_step(q, k, vv, n, z, square)
    return (
        num.reshape(*lead, 1, e),
        den.reshape(*lead, 1),
        n2.reshape(*lead, fs, e),
        z2.reshape(*lead, fs),
    )
