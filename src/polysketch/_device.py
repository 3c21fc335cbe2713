"""The device kind that every CPU-versus-accelerator decision of the library reads.

The library takes a few branches by device: input checks read values on the host on the
CPU and use ``torch._assert_async`` elsewhere (``_checks.refuse_unless``,
``features.stability``, ``nn.transformer``'s id checks: ``checks_on_host``), and the
dispatcher picks layouts, operand dtypes and kernels (``ops.dispatch``). Each reads
``device_type(x.device)`` here and nothing else, so one switch presents them all a device
of another kind:

    with presented_device("cuda"):   # CPU tensors take exactly the branches CUDA takes
        loss = model(idx, idx)[1]

``presented_device`` is for tests: the CUDA path's dispatched operations can be counted on a
CPU (``tests/test_cuda_path_probe.py``: host synchronizations, ops per layer). It changes the
decisions only: tensors stay where they are, and set-up that must name the real device
(autocast, Triton's own device checks, ``torch.cuda`` queries) reads ``x.device`` itself.
It is process-wide (not per thread) and nests.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["DEVICE_KINDS", "checks_on_host", "device_type", "presented_device"]

DEVICE_KINDS = ("cpu", "cuda", "mps", "xpu", "hpu", "meta")
"""Kinds ``presented_device`` accepts."""

_PRESENTED: list[str] = []  # the innermost presented_device kind last


def device_type(device: torch.device | str) -> str:
    """The kind of ``device`` that decisions read: ``torch.device(device).type``, or the
    kind of the innermost ``presented_device``."""
    if _PRESENTED:
        return _PRESENTED[-1]
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def checks_on_host(x: torch.Tensor) -> bool:
    """Whether a check may read ``x``'s values on the host (``.item()``, ``bool()``): on the
    CPU outside ``torch.compile``. Elsewhere a read would synchronize with the device (or
    break the graph), and checks go through ``torch._assert_async``."""
    return device_type(x.device) == "cpu" and not torch.compiler.is_compiling()


@contextlib.contextmanager
def presented_device(kind: str = "cuda"):
    """Within the block, every device decision reads ``kind`` (module docstring; tests)."""
    if kind not in DEVICE_KINDS:
        raise ValueError(f"kind must be one of {list(DEVICE_KINDS)}, got {kind!r}")
    _PRESENTED.append(kind)
    try:
        yield
    finally:
        _PRESENTED.pop()
