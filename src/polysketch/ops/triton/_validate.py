"""Input checks of the Triton kernels (no triton import: usable on CPU-only installs).

``check_inputs`` returns ``None`` or ``(exception class, sentence)``; the sentence names the
argument and the limit, so the dispatcher can show it when a user forces
``algorithm="triton"`` and the kernels refuse the inputs.
"""

from __future__ import annotations

import contextlib
import os

import torch

from ..pairs import state_dim

__all__ = [
    "SQUARE_FEATURE_DIMS",
    "PLAIN_FEATURE_DIMS",
    "VALUE_DIMS",
    "DTYPES",
    "interpreting",
    "cpu_reference",
    "reference_on_cpu",
    "check_inputs",
    "check_decode_inputs",
]

SQUARE_FEATURE_DIMS = (16, 32, 64)
"""F supported with ``square=True`` (the state slices (F, E) stay in registers)."""
PLAIN_FEATURE_DIMS = (16, 32, 64, 128, 256)
"""F supported with ``square=False``."""
VALUE_DIMS = (32, 64, 128)
"""E supported (tile widths of the value/state columns)."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_REFERENCE: list[bool] = []  # non-empty inside ``cpu_reference()``


@contextlib.contextmanager
def cpu_reference():
    """Within the block, the custom ops of the kernels (``custom_ops``) run their dense
    PyTorch reference (``_reference``) on CPU tensors instead of the Triton interpreter, and
    CPU tensors are accepted without ``TRITON_INTERPRET``: tracing and ``torch.compile`` of a
    whole step with the kernels' ops on a machine without a GPU, where the interpreter takes
    tens of seconds per call. CUDA tensors always run the kernels."""
    _REFERENCE.append(True)
    try:
        yield
    finally:
        _REFERENCE.pop()


def reference_on_cpu() -> bool:
    """True inside ``cpu_reference()``."""
    return bool(_REFERENCE)


def _device_ok(x: torch.Tensor) -> bool:
    return x.is_cuda or (x.device.type == "cpu" and (interpreting() or reference_on_cpu()))


def _device_sentence(name: str) -> str:
    return f"{name} must be on a CUDA device (or set TRITON_INTERPRET=1 to run the kernels on CPU)"


def check_inputs(a, b, c, *, square) -> tuple[type[Exception], str] | None:
    """Validate A, B (..., T, F), C (..., T, E) for ``triton_lt_multiply_with_sums``."""
    if not isinstance(square, bool):
        return TypeError, f"square must be a bool, got {type(square).__name__}"
    for name, x in (("a", a), ("b", b), ("c", c)):
        if not isinstance(x, torch.Tensor):
            return TypeError, f"{name} must be a torch.Tensor, got {type(x).__name__}"
        if x.dim() < 2:
            return ValueError, f"{name} must have shape (..., T, dim), got {tuple(x.shape)}"
    if a.shape != b.shape:
        return ValueError, (
            f"a and b must have the same shape (..., T, F), got {tuple(a.shape)} and "
            f"{tuple(b.shape)}"
        )
    if c.shape[:-1] != a.shape[:-1]:
        return ValueError, (
            f"c must have shape (..., T, E) with the leading dims and T of a "
            f"{tuple(a.shape[:-1])}, got {tuple(c.shape)}"
        )
    if a.shape[-2] < 1:
        return ValueError, f"a must have T >= 1 rows, got shape {tuple(a.shape)}"
    for name, x in (("a", a), ("b", b), ("c", c)):
        if x.dtype not in DTYPES:
            return TypeError, f"{name} must be float32, bfloat16 or float16, got {x.dtype}"
    if not (a.dtype == b.dtype == c.dtype):
        return TypeError, f"a, b and c must share one dtype, got {a.dtype}, {b.dtype}, {c.dtype}"
    for name, x in (("a", a), ("b", b), ("c", c)):
        if not _device_ok(x):
            return ValueError, _device_sentence(name)
    if not (a.device == b.device == c.device):
        got = f"{a.device}, {b.device}, {c.device}"
        return ValueError, f"a, b and c must be on one device, got {got}"
    f, e = a.shape[-1], c.shape[-1]
    dims = SQUARE_FEATURE_DIMS if square else PLAIN_FEATURE_DIMS
    if f not in dims:
        return ValueError, (
            f"a and b must have a feature dim F in {dims} for the Triton kernels with "
            f"square={square}, got F={f}"
        )
    if e not in VALUE_DIMS:
        return ValueError, (
            f"c must have a value dim E in {VALUE_DIMS} for the Triton kernels, got E={e}"
        )
    return None


def check_decode_inputs(phi_q, phi_k, v, numerator, denominator, *, square):
    """Validate the arguments of ``triton_decode_step``; ``None`` or (exception, sentence)."""
    if not isinstance(square, bool):
        return TypeError, f"square must be a bool, got {type(square).__name__}"
    named = (
        ("phi_q", phi_q), ("phi_k", phi_k), ("v", v),
        ("numerator", numerator), ("denominator", denominator),
    )  # fmt: skip
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            return TypeError, f"{name} must be a torch.Tensor, got {type(x).__name__}"
        if x.requires_grad:
            return ValueError, (
                f"{name} requires grad: triton_decode_step has no backward (decode under "
                "torch.no_grad() or detach the inputs)"
            )
        if not _device_ok(x):
            return ValueError, _device_sentence(name)
    for name, x in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        if x.dim() < 2 or x.shape[-2] != 1:
            return ValueError, f"{name} must have shape (..., 1, dim), got {tuple(x.shape)}"
        if x.dtype not in DTYPES:
            return TypeError, f"{name} must be float32, bfloat16 or float16, got {x.dtype}"
    if phi_q.shape != phi_k.shape:
        return ValueError, (
            f"phi_q and phi_k must have the same shape, got {tuple(phi_q.shape)} and "
            f"{tuple(phi_k.shape)}"
        )
    lead, f, e = tuple(phi_q.shape[:-2]), phi_q.shape[-1], v.shape[-1]
    if tuple(v.shape[:-2]) != lead:
        got = tuple(v.shape)
        return ValueError, f"v must have shape (..., 1, E) with leading dims {lead}, got {got}"
    dims = SQUARE_FEATURE_DIMS if square else PLAIN_FEATURE_DIMS
    if f not in dims:
        return ValueError, f"phi_q must have a feature dim F in {dims} (square={square}), got F={f}"
    if e not in VALUE_DIMS:
        return ValueError, f"v must have a value dim E in {VALUE_DIMS}, got E={e}"
    fs = state_dim(f, square)
    for name, x, want in (
        ("numerator", numerator, (*lead, fs, e)),
        ("denominator", denominator, (*lead, fs)),
    ):
        if x.dtype != torch.float32:
            return TypeError, f"{name} must be float32 (the state dtype), got {x.dtype}"
        if tuple(x.shape) != want:
            return ValueError, (
                f"{name} must have shape {want} (square={square}), got {tuple(x.shape)}"
            )
    devices = {x.device for _, x in named}
    if len(devices) != 1:
        got = sorted(map(str, devices))
        return ValueError, f"phi_q, ..., denominator must be on one device, got {got}"
    return None
