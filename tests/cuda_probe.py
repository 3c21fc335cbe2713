"""A probe of the CUDA path on a CPU: what a step dispatches, and what would synchronize.

``probe()`` is a context that presents CPU tensors as CUDA ones to the library's device
decisions (``polysketch._device.presented_device``: checks, dispatch, precision policy), and
records, through a ``TorchDispatchMode`` (aten ops, after autograd: forward and backward
kernels alike) and a ``TorchFunctionMode`` (tensor methods that never reach the dispatcher on
a CPU, e.g. ``tolist``):

* ``ops``: every aten op dispatched (views included: on a GPU each is still a dispatch on the
  host), and ``kernels``: those that launch work on the device, i.e. not views and not
  ``NO_LAUNCH`` (metadata, allocation and host-scalar ops);
* ``syncs``: the calls that force a host synchronization on CUDA, each with the innermost
  ``polysketch`` frame that made it (``module:function``):
  - ``aten._local_scalar_dense`` (``.item()``, ``bool()``/``int()``/``float()`` of a tensor),
    ``aten.is_nonzero``, ``aten.equal``;
  - data-dependent output shapes: ``nonzero``, ``masked_select``, ``unique*``,
    ``repeat_interleave`` of a repeats tensor without ``output_size``, ``bincount``,
    ``histc``, indexing (``index`` / ``index_put``) with a boolean mask;
  - a copy between host and device: ``Tensor.tolist``, ``.cpu()``, ``.numpy()``,
    ``.to("cpu")`` (a literal: ``.to(x.device)`` cannot be told apart on the probe's CPU
    tensors), and ``torch.tensor`` / ``torch.as_tensor`` of host data onto a ``device=``
    (pageable memory: PyTorch waits for the stream); function mode, since on the probe's
    CPU tensors they copy nothing, while on CUDA they wait.

Triton: under the probe ``ops.dispatch`` could pick the Triton kernels (bf16 inputs of
psf_random's shape from ``dispatch.TRITON_MIN_LENGTH`` tokens, or every call with
``POLYSKETCH_TRITON=1``), which would run under the interpreter here. The probe pins the
Triton mode to "auto" and callers keep T far below ``TRITON_MIN_LENGTH`` (and use fp32), so
every call takes ``chunked_blocks``, as CUDA does below that length; the Triton path itself
is captured as custom ops (``tests/test_ops_triton_custom_op.py``).
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from polysketch._device import presented_device
from polysketch.ops import dispatch

aten = torch.ops.aten

SYNC_PACKETS = {
    aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.nonzero,
    aten.masked_select, aten.unique_consecutive, aten._unique, aten._unique2, aten.unique_dim,
    aten.bincount, aten.histc,
}  # fmt: skip
"""aten packets whose every overload forces a host sync on CUDA."""

NO_LAUNCH = {
    aten._unsafe_view, aten._reshape_alias, aten.promote_types, aten.scalar_tensor,
    aten.empty, aten.empty_like, aten.new_empty, aten.empty_strided, aten.new_empty_strided,
    aten.split, aten.split_with_sizes, aten.unbind, aten.chunk, aten.lift_fresh,
}  # fmt: skip
"""Non-view aten packets that launch no device work (shape/metadata, allocation, a host
scalar)."""

HOST_METHODS = {
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
}
"""Tensor methods that copy to the host (invisible to the dispatcher on a CPU)."""


def _bool_index(indices) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )


def sync_reason(func, args, kwargs) -> str | None:
    """Why the aten op ``func`` would wait for the device on CUDA, or None."""
    packet = func.overloadpacket
    if packet in SYNC_PACKETS:
        return str(packet.__name__)
    if packet is aten.repeat_interleave and isinstance(args[0], torch.Tensor):
        if kwargs.get("output_size") is None and (len(args) < 3 or args[-1] is None):
            return "repeat_interleave (data-dependent size)"
    if packet in (aten.index, aten._unsafe_index) and _bool_index(args[1]):
        return "index with a boolean mask (data-dependent size)"
    if packet in (aten.index_put, aten.index_put_, aten._index_put_impl_) and _bool_index(args[1]):
        return "index_put with a boolean mask (nonzero)"
    return None


def _where() -> str:
    """``module:function`` of the innermost polysketch frame of the current stack."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/polysketch/" in path and "/polysketch/_device" not in path:
            module = path.rsplit("/polysketch/", 1)[1].removesuffix(".py").replace("/", ".")
            return f"{module}:{frame.name}"
    return "?"


@dataclass
class Record:
    """What one probed region dispatched (module docstring)."""

    ops: int = 0
    kernels: int = 0
    by_op: Counter = field(default_factory=Counter)
    syncs: list = field(default_factory=list)  # (reason, "module:function")

    def sync_sites(self) -> set[tuple[str, str]]:
        return set(self.syncs)


class _Dispatch(TorchDispatchMode):
    def __init__(self, record: Record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.record
        rec.ops += 1
        if not func.is_view and func.overloadpacket not in NO_LAUNCH:
            rec.kernels += 1
        rec.by_op[str(func.overloadpacket.__name__)] += 1
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            rec.syncs.append((reason, _where()))
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, record: Record):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = HOST_METHODS.get(func)
        if name is None and func is torch.Tensor.to:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, str) and torch.device(target).type == "cpu":
                name = "to(cpu)"  # a literal: .to(x.device) names the probe's CPU, not a host
        if name is None and func in (torch.tensor, torch.as_tensor):
            data = args[0] if args else kwargs.get("data")
            if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
                name = f"{func.__name__}(host data, device=...)"  # a synchronous H2D copy
        if name is not None:
            self.record.syncs.append((name, _where()))
        return func(*args, **kwargs)


@contextlib.contextmanager
def probe(kind: str = "cuda"):
    """Yield a ``Record`` of everything dispatched inside, with device decisions reading
    ``kind`` (module docstring); the Triton mode is "auto" inside."""
    record = Record()
    saved = list(dispatch._TRITON_SWITCH)
    dispatch._TRITON_SWITCH[:] = ["auto"]
    try:
        with presented_device(kind), _Function(record), _Dispatch(record):
            yield record
    finally:
        dispatch._TRITON_SWITCH[:] = saved
