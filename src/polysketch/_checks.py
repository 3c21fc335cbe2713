"""Input validation for the public boundary.

Every check raises ``ValueError`` or ``TypeError`` whose message names the offending
argument, so that a user sees *which* input is wrong and why. No bare ``assert``.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Sequence

import torch

from ._device import checks_on_host

__all__ = [
    "parse_key_values",
    "check_int",
    "check_positive_int",
    "check_float",
    "check_choice",
    "check_tensor",
    "check_feature_input",
    "check_same_dtype_device",
    "check_finite",
    "compute_dtype",
    "as_dtype",
    "refuse_unless",
    "assert_on_device",
    "device_assert_message",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)

# torch._assert_async copies its message into a fixed buffer and refuses a longer one before it
# checks anything ("Message length must be smaller than 255" on CUDA, < 250 bytes on MPS; bytes of
# UTF-8): every device assertion's message is clipped to this many bytes.
DEVICE_ASSERT_MESSAGE_BYTES = 249


def parse_key_values(items: Sequence[str] | None, name: str) -> dict:
    """``["num_features=32", "projection=gaussian"]`` -> ``{"num_features": 32, ...}``.

    Values are Python literals when they parse as one (numbers, True/False/None, tuples),
    else strings. Raises ValueError naming ``name`` for an item without ``key=``.
    """
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{name} expects key=value, got {item!r}")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def check_int(value, name: str, *, minimum: int | None = None) -> int:
    """Return ``value`` as an ``int``; raise ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        # numpy / torch integer scalars are accepted when they are integral
        if hasattr(value, "__index__") and not isinstance(value, bool):
            value = value.__index__()
        else:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_positive_int(value, name: str) -> int:
    """Return ``value`` as an ``int`` >= 1; raise naming ``name`` otherwise."""
    return check_int(value, name, minimum=1)


def check_float(
    value,
    name: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    strict_minimum: bool = False,
) -> float:
    """Return ``value`` as a finite ``float`` within bounds; raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        else:
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None:
        if strict_minimum and value <= minimum:
            raise ValueError(f"{name} must be > {minimum}, got {value}")
        if not strict_minimum and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_choice(value, name: str, choices: Sequence[str]) -> str:
    """Return ``value`` if it is one of ``choices``; raise naming ``name`` otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, one of {list(choices)}, got {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_tensor(
    x,
    name: str,
    *,
    min_dim: int = 1,
    last_dim: int | None = None,
    floating: bool = True,
) -> torch.Tensor:
    """Validate a tensor argument.

    Args:
        x: the value to check.
        name: the argument name used in error messages.
        min_dim: the least number of dimensions ``x`` must have.
        last_dim: if given, the required size of ``x.shape[-1]``.
        floating: require a floating-point dtype.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(
            f"{name} must have at least {min_dim} dimension(s), got shape {tuple(x.shape)}"
        )
    if last_dim is not None and x.shape[-1] != last_dim:
        raise ValueError(f"{name} must have last dimension {last_dim}, got shape {tuple(x.shape)}")
    return x


def check_feature_input(x, dim: int, name: str = "x") -> torch.Tensor:
    """Validate the input of a feature map: a floating tensor of shape (..., dim)."""
    return check_tensor(x, name, min_dim=1, last_dim=dim)


def check_same_dtype_device(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Raise ``ValueError`` if two tensors differ in dtype or device."""
    if a.dtype != b.dtype:
        raise ValueError(
            f"{name_a} and {name_b} must have the same dtype, got {a.dtype} and {b.dtype}"
        )
    if a.device != b.device:
        raise ValueError(
            f"{name_a} and {name_b} must be on the same device, got {a.device} and {b.device}"
        )


def check_finite(x: torch.Tensor, name: str) -> torch.Tensor:
    """Raise ``ValueError`` if ``x`` holds NaN or Inf."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf values")
    return x


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in for inputs of ``dtype``: fp32 for bf16/fp16, else ``dtype``.

    This is the library-wide precision policy: half-precision inputs are computed with fp32
    internals wherever overflow or cancellation threatens, and results are cast back.
    """
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, skipping the call when x already has ``dtype`` (``.to`` then returns x
    itself anyway, but its dispatch costs time a decoding step of a small model feels:
    ``docs/results/implementation_choices.md``)."""
    return x if x.dtype == dtype else x.to(dtype)


def refuse_unless(ok: torch.Tensor, message: str, *, asynchronous: bool | None = None) -> None:
    """Refuse (``message``) unless every element of the boolean tensor ``ok`` is True.

    ``asynchronous=None`` decides by device (``_device.checks_on_host``): on the CPU a
    ValueError is raised (a host read is free there); on accelerators, and inside
    ``torch.compile`` (where a host read would break the graph),
    ``torch._assert_async(ok.all(), message)`` checks without a host synchronization.
    ``True``/``False`` force one path (``True`` on the CPU raises RuntimeError at once, which
    is how the device path is tested without a device; so does
    ``_device.presented_device("cuda")``).
    """
    if asynchronous is None:
        asynchronous = not checks_on_host(ok)
    if asynchronous:
        assert_on_device(ok.all(), message)
    elif not bool(ok.all()):
        raise ValueError(message)


def device_assert_message(message: str) -> str:
    """``message`` as a device assertion can carry it: at most ``DEVICE_ASSERT_MESSAGE_BYTES``
    bytes of UTF-8, cut at a character boundary and ended with "…" where it was longer (the
    start of every refusal names the argument and what is wrong; the remedies that follow are
    what a clipped message loses, and the CPU path raises the whole of it)."""
    data = message.encode("utf-8")
    if len(data) <= DEVICE_ASSERT_MESSAGE_BYTES:
        return message
    ellipsis = "…"
    room = DEVICE_ASSERT_MESSAGE_BYTES - len(ellipsis.encode("utf-8"))
    return data[:room].decode("utf-8", errors="ignore") + ellipsis


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """``torch._assert_async(condition, message)`` with the message clipped to what the device
    accepts (``device_assert_message``): no host synchronization, no graph break; a False
    ``condition`` fails at the next synchronization (on the CPU, at once, as RuntimeError)."""
    torch._assert_async(condition, device_assert_message(message))
