"""Which implementation of causal ``linear_attention`` runs: ``algorithm=`` and the device.

    "chunked"         -> "triton" on CUDA for bf16/fp16 when the fused kernels are importable
                         and support the call (no initial/returned state, supported F and E,
                         not inside torch.compile), else
                         "chunked_blocks" on any accelerator, "chunked_scan" on CPU
    "chunked_scan"    the CPU layout: groups of blocks under a byte budget (``ops.chunked``);
                      with gradients, the recomputing ``ops.blocks`` function over the same groups
    "chunked_blocks"  the accelerator layout: all blocks at once (``ops.blocks``), in a few
                      large groups past ``ops.blocks.ACCELERATOR_GROUP_BYTES`` of temporaries
    "triton"          fused Triton kernels (``ops.triton``, the optional ``triton`` extra)
    "cumsum"          Performer prefix sums (``ops.cumsum``; memory O(T·F'·E))

Every name can be forced on any device (``"triton"`` on CPU needs ``TRITON_INTERPRET=1``);
nothing above the op knows which one ran.
"""

from __future__ import annotations

import torch

from .._checks import check_choice

__all__ = ["ALGORITHMS", "resolve_algorithm", "triton_backend"]

ALGORITHMS = ("chunked", "chunked_scan", "chunked_blocks", "triton", "cumsum")


_BACKEND: list = []  # [module or None], decided once per process (not per call)


def triton_backend():
    """The ``polysketch.ops.triton`` module when its kernels can run here, else ``None``.

    Decided on first use and cached (triton importable, and CUDA or ``TRITON_INTERPRET=1``),
    so dispatch does no import or probing per call.
    """
    if not _BACKEND:
        try:
            from . import triton as backend
        except ImportError:
            backend = None
        _BACKEND.append(backend if backend is not None and backend.available() else None)
    return _BACKEND[0]


def resolve_algorithm(
    algorithm: str,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    square: bool,
    with_state: bool,
) -> str:
    """The implementation for ``algorithm`` on these operands (features a, b, values c).

    ``with_state``: an initial state is read or the final state returned (the fused kernels
    do neither). A forced ``"triton"`` that cannot run raises ValueError saying why.
    """
    check_choice(algorithm, "algorithm", ALGORITHMS)
    if algorithm == "triton":
        backend = triton_backend()
        if backend is None:
            raise ValueError(
                'algorithm="triton" needs the triton package (pip install polysketch[triton]) '
                "and a CUDA device (or TRITON_INTERPRET=1 to run the kernels on CPU)"
            )
        if with_state:
            raise ValueError(
                'algorithm="triton" does not take initial_state, return_state or Tq < Tk '
                '(keys before the first query); use algorithm="chunked_blocks"'
            )
        reason = backend.unsupported_reason(a, b, c, square=square)
        if reason is not None:
            raise ValueError(f'algorithm="triton" cannot run this call: {reason}')
        return "triton"
    if algorithm != "chunked":
        return algorithm
    if a.device.type == "cpu":
        return "chunked_scan"
    half = a.dtype in (torch.bfloat16, torch.float16)  # fp32 kernels spill registers
    if a.device.type == "cuda" and half and not with_state and not torch.compiler.is_compiling():
        # eager calls take the fused kernels; a compiled graph takes chunked_blocks, which
        # inductor fuses itself (no opaque kernel in the graph)
        backend = triton_backend()
        if backend is not None and backend.unsupported_reason(a, b, c, square=square) is None:
            return "triton"
    return "chunked_blocks"
