"""Small constant tensors built once per (shape, dtype, device), not at every call.

The causal mask of a block and the pair weights ω of squared scores (``ops.pairs``) depend on
sizes only, yet each costs a few launches to build (ω: nine aten ops; the mask: two), in the
forward and again in the backward of every layer. ``constant(key, build)`` keeps what
``build()`` returns under ``key``. It builds afresh, keeping nothing, while ``torch.compile``
traces (the traced graph holds its own constant; a traced value must not outlive the trace)
and whenever ``build()`` returns anything but a plain tensor (fake or functional tensors of
other tracers). Constants are built outside inference mode, so autograd may save them, and
must never be written in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["constant", "lower_triangle"]

_CONSTANTS: dict = {}


def constant(key: tuple, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The tensor ``build()`` kept under ``key`` (module docstring)."""
    if torch.compiler.is_compiling():
        return build()
    value = _CONSTANTS.get(key)
    if value is None:
        with torch.inference_mode(False):
            value = build()
        if type(value) is not torch.Tensor:  # a tracer's tensor: never kept
            return value
        value = _CONSTANTS.setdefault(key, value)
    return value


def lower_triangle(n: int, device: torch.device) -> torch.Tensor:
    """The (n, n) bool mask of j <= i (the causal mask of a block), kept per (n, device)."""
    device = torch.device(device)
    return constant(
        ("lower_triangle", n, device),
        lambda: torch.ones(n, n, dtype=torch.bool, device=device).tril(),
    )
