"""Every device decision of the attention compute, and the table of backends.

The backend contract (fla's principle: one signature, one result, a naive reference beside):

    lt_multiply(a, b, c, *, square, chunk_size, initial, return_state, group_bytes)
        -> (num, den, state)

a = φq, b = φk (..., T, F), c = V (..., T, E), already validated, cast and key-masked;
num = lt(s) C + Ψq(A) N_0 (..., T, E), den = lt(s) 1 + Ψq(A) Z_0 (..., T) (s_ij = a_i·b_j,
squared with ``square``; lt the causal lower triangle including the diagonal), ``initial``
(N_0, Z_0) and the returned state (N, Z) (or ``None``) in the ONE layout of
``polysketch.ops.state`` (pair features for squared scores), in the accumulation dtype. Each
backend module adapts itself to it:

    "chunked_scan"    ``ops.chunked``: groups of blocks under ``CPU_GROUP_BYTES`` (cache-sized)
    "chunked_blocks"  ``ops.blocks``: all blocks batched, groups past ``ACCELERATOR_GROUP_BYTES``;
                      a recomputing backward
    "cumsum"          ``ops.cumsum``: Performer prefix sums, dense F×F states (cross-check)
    "triton"          ``ops.triton``: fused kernels (optional extra); no state in or out
    (non-causal)      ``ops.noncausal``: A (Bᵀ C) by associativity; also folds the keys before
                      the first query of a causal call (Tq < Tk) into the initial state

``BACKENDS`` declares what each can do (take or return a state, an efficient backward, half
GEMM operands, which shapes); ``plan`` routes around what a backend cannot do:

    "chunked"  -> "chunked_scan" on CPU, "chunked_blocks" on every other device, except
                  "triton" on CUDA where the fused kernels were measured faster (below)
    a name     -> that backend on any device ("triton" on CPU needs TRITON_INTERPRET=1); a
                  call it cannot do is refused with the reason (ValueError)
    gradients  -> "chunked_scan" has no backward of its own: calls that need one run the
                  recomputing ``ops.blocks`` function over the same cache-sized groups

Triton on CUDA (``triton_mode``, from ``POLYSKETCH_TRITON`` or ``enable_triton``):

    "auto" (default)  "chunked" picks the kernels where ``make gpu-check`` measured them faster
                      than ``chunked_blocks``: bf16 inputs, squared scores with F in
                      ``TRITON_DEFAULT_FEATURE_DIMS``, T >= ``TRITON_MIN_LENGTH``; decoding
                      runs the PyTorch step
    "on"  (=1)        every bf16 call the kernels support, and the fused decode step
    "off" (=0)        never (``chunked_blocks``); ``algorithm="triton"`` still names them

In every mode the call must have no state in or out and a shape the kernels support. Under
``torch.compile`` only "on" picks them (they are custom ops, ``ops.triton.custom_ops``, which
the graph captures whole); "auto" keeps ``chunked_blocks`` there, which inductor fuses itself,
until ``make gpu-check`` has timed the compiled step both ways. fp16 and fp32 inputs take
``chunked_blocks``: the kernels would run in fp32 for both (fp16's range, ``ops.blocks``),
where they spill registers. A new kernel ships opt-in ("on") and joins "auto" only after
``make gpu-check`` has passed with it on a GPU and its table shows it faster.

Nothing outside this module branches on the device in the attention path (``ops``,
``nn.attention``, ``nn.cache``): memory budgets, operand dtype, the layout, the fused decode
step and the GPU facts the Triton launch grids need (``multiprocessor_count``) are decided
here. (The Triton package still validates that its inputs sit where its kernels can run, and
``nn.attention`` sets up autocast for the input's device type: checks and set-up, not choices.)
Every decision reads the device kind through ``device_type`` (``polysketch._device``), as do the
input checks (``_device.checks_on_host``), so ``_device.presented_device("cuda")`` runs the
CUDA path on CPU tensors (``tests/cuda_probe.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._checks import check_choice, compute_dtype
from .._device import device_type  # the kind every decision below reads (presentable)
from . import blocks, chunked, cumsum, noncausal

__all__ = [
    "ALGORITHMS",
    "ACCELERATOR_GROUP_BYTES",
    "BACKENDS",
    "CPU_GROUP_BYTES",
    "NONCAUSAL",
    "Backend",
    "Plan",
    "decode_backend",
    "TRITON_DEFAULT_DTYPES",
    "TRITON_DEFAULT_FEATURE_DIMS",
    "TRITON_MIN_LENGTH",
    "TRITON_MODES",
    "device_type",
    "enable_triton",
    "group_bytes",
    "group_bytes_for",
    "layout_for",
    "multiprocessor_count",
    "operand_dtype",
    "plan",
    "resolve_algorithm",
    "triton_backend",
    "triton_enabled",
    "triton_mode",
]

ALGORITHMS = ("chunked", "chunked_scan", "chunked_blocks", "triton", "cumsum")

CPU_GROUP_BYTES = 4 * 2**20
"""Temporaries budget per group of blocks of the cache-sized layout (``"chunked_scan"``, its
training path and mixed attention on CPU). Measured on a 2-core EPYC (B·H = 1 and 4, b = 256):
1-8 MiB all within noise, 16-64 MiB up to 1.6x slower (plain F = 256); the old
all-blocks-at-once version was 1.3-5x slower."""

ACCELERATOR_GROUP_BYTES = 2**30
"""Temporaries budget per group of the batched layout (``"chunked_blocks"``, mixed attention
off CPU): all blocks at once up to it (B·H = 12, D = 64, r = 32 squared, b = 256: ~46 MB per
block, so one group to ~5.5k tokens, 11 groups at 64k), so peak memory stays bounded at long T
while each kernel is still a large batched one (no host sync either way). Not tuned on a GPU."""

_HALF = (torch.float16, torch.bfloat16)

TRITON_MIN_LENGTH = 1024
"""T from which ``"chunked"`` picks the Triton kernels on CUDA by default (``triton_mode()``
"auto"). It comes from the attention table of ``make gpu-check`` (``benchmarks/gpu_check.py``:
forward + backward, bf16, B = 1, H = 12, D = 64, psf_random's map, the default dispatch,
``chunked_blocks`` and ``triton`` side by side at 1k-64k; the figures in ``docs/gpu.md``): the
shortest length from which ``triton`` was measured faster than ``chunked_blocks`` at every
length timed (the table starts at 1k: shorter calls are unmeasured and keep
``chunked_blocks``)."""

TRITON_DEFAULT_DTYPES = (torch.bfloat16,)
"""Input dtypes for which "auto" picks Triton (the measured one; fp16 and fp32 run the fp32
kernels, unmeasured)."""

TRITON_DEFAULT_FEATURE_DIMS = (32,)
"""Feature dims F of squared scores for which "auto" picks Triton (psf_random's r = 32, the
measured map; the other shapes the kernels support run under ``POLYSKETCH_TRITON=1``)."""


# ----- device policy ------------------------------------------------------------------------
def operand_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype of matmul operands for inputs of ``dtype`` on ``device``.

    On accelerators bf16/fp16 stay half (tensor cores, fp32 accumulation inside the GEMM);
    states, prefix sums and normalizers are still kept in ``compute_dtype`` (fp32) by the ops.
    On CPU half inputs are upcast: CPU BLAS has no fast half GEMM on most machines and fp32
    measured faster here. Other dtypes are unchanged.
    """
    if dtype in _HALF and device_type(device) == "cpu":
        return torch.float32
    return dtype


def layout_for(device: torch.device | str) -> str:
    """The block layout for ``device``: ``"chunked_scan"`` on CPU, else ``"chunked_blocks"``."""
    return "chunked_scan" if device_type(device) == "cpu" else "chunked_blocks"


def group_bytes(layout: str) -> int | None:
    """The temporaries budget of a layout: ``CPU_GROUP_BYTES`` for the cache-sized scan,
    ``ACCELERATOR_GROUP_BYTES`` for the batched blocks, ``None`` for the others."""
    return {"chunked_scan": CPU_GROUP_BYTES, "chunked_blocks": ACCELERATOR_GROUP_BYTES}.get(layout)


def group_bytes_for(device: torch.device | str) -> int:
    """The group budget on ``device``: that of ``layout_for(device)``."""
    return group_bytes(layout_for(device))


# ----- Triton: optional; by default where measured faster -----------------------------------
_BACKEND: list = []  # [module or None], decided once per process (not per call)
_TRITON_SWITCH: list = []  # ["auto" | "on" | "off"] once decided (environment, enable_triton)
TRITON_MODES = ("auto", "on", "off")
_ENV_WORDS = {
    "": "auto", "auto": "auto",
    "1": "on", "true": "on", "on": "on", "yes": "on",
    "0": "off", "false": "off", "off": "off", "no": "off",
}  # fmt: skip


def triton_backend():
    """The ``polysketch.ops.triton`` module when its kernels can run here, else ``None``.

    Decided on first use and cached (triton importable, and CUDA or ``TRITON_INTERPRET=1``),
    so dispatch does no import or probing per call. A first use while ``torch.compile``
    traces decides without caching: a traced region that mutates a global (a recomputed
    attention's ``torch.utils.checkpoint`` body) would break the graph.
    """
    if _BACKEND:
        return _BACKEND[0]
    try:
        from . import triton as backend
    except ImportError:
        backend = None
    backend = backend if backend is not None and backend.available() else None
    if not torch.compiler.is_compiling():
        _BACKEND.append(backend)
    return backend


def enable_triton(enabled: bool | None = True) -> None:
    """Set the Triton mode (module docstring): ``True`` "on" (every bf16 call the kernels
    support, and the fused decode step), ``False`` "off", ``None`` "auto" (the default: where
    measured faster). Overrides ``POLYSKETCH_TRITON``."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool or None, got {type(enabled).__name__}")
    _TRITON_SWITCH[:] = ["auto" if enabled is None else "on" if enabled else "off"]


def triton_mode() -> str:
    """The mode, "auto", "on" or "off": ``enable_triton``'s last word, else
    ``POLYSKETCH_TRITON`` at the first call (unset, empty or auto: "auto"; 1, true, on, yes:
    "on"; 0, false, off, no: "off"; anything else: ValueError naming the variable)."""
    if _TRITON_SWITCH:
        return _TRITON_SWITCH[0]
    value = os.environ.get("POLYSKETCH_TRITON", "").strip().lower()
    if value not in _ENV_WORDS:
        raise ValueError(
            f"POLYSKETCH_TRITON must be auto, 1 (on) or 0 (off), got "
            f"{os.environ['POLYSKETCH_TRITON']!r}"
        )
    if not torch.compiler.is_compiling():  # cached outside traces (``triton_backend``)
        _TRITON_SWITCH.append(_ENV_WORDS[value])
    return _ENV_WORDS[value]


def triton_enabled() -> bool:
    """Whether automatic choices may pick Triton at all (``triton_mode()`` is not "off")."""
    return triton_mode() != "off"


@torch.compiler.assume_constant_result  # a fact of the GPU: a constant of a traced graph
def multiprocessor_count(device: torch.device | str) -> int | None:
    """The streaming multiprocessors of a CUDA ``device`` (Triton's launch grids), else None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def _triton_lt_multiply(a, b, c, **kwargs):
    return triton_backend().lt_multiply(a, b, c, sms=multiprocessor_count(a.device), **kwargs)


def _triton_refusal(a, b, c, square) -> str | None:
    backend = triton_backend()
    if backend is None:
        return (
            "needs the triton package (pip install polysketch[triton]) and a CUDA device (or "
            "TRITON_INTERPRET=1 to run the kernels on CPU)"
        )
    reason = backend.unsupported_reason(a, b, c, square=square)
    return None if reason is None else f"cannot run this call: {reason}"


# ----- the backend table --------------------------------------------------------------------
@dataclass(frozen=True)
class Backend:
    """One implementation of the contract (module docstring) and what it can do.

    ``state``: takes ``initial`` and returns a state. ``backward``: has an efficient backward
    (else ``grad_fallback`` runs calls that need gradients). ``half_operands``: bf16/fp16
    GEMM operands stay half where ``operand_dtype`` allows (else the accumulation dtype).
    ``refusal``: (a, b, c, square) -> ``None`` or why the shapes, dtypes or the installation
    rule it out (dtypes included).
    """

    name: str
    run: Callable
    state: bool = True
    backward: bool = True
    grad_fallback: str | None = None
    half_operands: bool = False
    refusal: Callable | None = None


BACKENDS: dict[str, Backend] = {
    "chunked_scan": Backend(
        "chunked_scan", chunked.lt_multiply, backward=False, grad_fallback="chunked_blocks"
    ),
    "chunked_blocks": Backend("chunked_blocks", blocks.lt_multiply, half_operands=True),
    "cumsum": Backend("cumsum", cumsum.lt_multiply),
    "triton": Backend(
        "triton", _triton_lt_multiply, state=False, half_operands=True, refusal=_triton_refusal
    ),
}
NONCAUSAL = Backend("noncausal", noncausal.multiply)


def _refusal(name: str, a, b, c, *, square: bool, with_state: bool) -> str | None:
    backend = BACKENDS[name]
    if backend.refusal is not None:
        reason = backend.refusal(a, b, c, square)
        if reason is not None:
            return reason
    if with_state and not backend.state:
        return (
            "does not take initial_state, return_state or Tq < Tk (keys before the first "
            'query); use algorithm="chunked_blocks"'
        )
    return None


def resolve_algorithm(
    algorithm: str,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    square: bool,
    with_state: bool,
) -> str:
    """The backend name for causal ``algorithm`` on these operands (features a, b, values c).

    ``with_state``: an initial state is read or the final state returned. A named backend
    that cannot run the call raises ValueError saying why (module docstring).
    """
    check_choice(algorithm, "algorithm", ALGORITHMS)
    if algorithm != "chunked":
        reason = _refusal(algorithm, a, b, c, square=square, with_state=with_state)
        if reason is not None:
            raise ValueError(f'algorithm="{algorithm}" {reason}')
        return algorithm
    layout = layout_for(a.device)
    if (
        layout == "chunked_blocks"
        and device_type(a.device) == "cuda"
        and not with_state
        and (not torch.compiler.is_compiling() or triton_mode() == "on")
        and _triton_wanted(a, square)
        and _refusal("triton", a, b, c, square=square, with_state=with_state) is None
    ):
        return "triton"
    return layout


def _triton_wanted(a: torch.Tensor, square: bool) -> bool:
    """Whether the Triton mode asks for the kernels on features ``a`` (module docstring):
    bf16 always ("on"; fp16 and fp32 would run the spilling fp32 kernels), and in "auto" only
    the measured squared maps from ``TRITON_MIN_LENGTH`` tokens on."""
    mode = triton_mode()
    if mode == "off" or a.dtype not in TRITON_DEFAULT_DTYPES:
        return False
    if mode == "on":
        return True
    measured = square and a.shape[-1] in TRITON_DEFAULT_FEATURE_DIMS
    return measured and a.shape[-2] >= TRITON_MIN_LENGTH


@dataclass(frozen=True)
class Plan:
    """What runs a call: the ``backend``, the ``name`` it was resolved to, the operand and
    accumulation dtypes and the group budget (``group_bytes``)."""

    name: str
    backend: Backend
    operand_dtype: torch.dtype
    accumulate_dtype: torch.dtype
    group_bytes: int | None

    def run(self, a, b, c, *, square, chunk_size, initial, return_state):
        """The contract on this plan's backend (operands already in ``operand_dtype``)."""
        return self.backend.run(
            a, b, c, square=square, chunk_size=chunk_size, initial=initial,
            return_state=return_state, group_bytes=self.group_bytes,
        )  # fmt: skip


def plan(
    algorithm: str | None,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    square: bool,
    with_state: bool,
    needs_grad: bool,
) -> Plan:
    """The ``Plan`` of a causal call (``algorithm`` a name of ``ALGORITHMS``) or, with
    ``algorithm=None``, of a non-causal one (``NONCAUSAL``, operands in the accumulation dtype).
    """
    acc = compute_dtype(a.dtype)
    if algorithm is None:
        return Plan("noncausal", NONCAUSAL, acc, acc, None)
    name = resolve_algorithm(algorithm, a, b, c, square=square, with_state=with_state)
    backend = BACKENDS[name]
    od = operand_dtype(a.dtype, a.device) if backend.half_operands else acc
    if needs_grad and not backend.backward:
        backend = BACKENDS[backend.grad_fallback]  # same layout budget, same operands
    return Plan(name, backend, od, acc, group_bytes(name))


def decode_backend(phi_q, phi_k, v, numerator, denominator, *, square, key_padding_mask):
    """The fused Triton decode step (the ``polysketch.ops.triton`` module) for one token, or
    ``None`` for the PyTorch step (``ops.recurrent``).

    Triton only in mode "on" (``enable_triton()``, ``POLYSKETCH_TRITON=1``: the step has not
    been timed on a GPU), on CUDA, for exactly what the PyTorch step computes there: one new
    token, fp32/bf16/fp16 inputs with fp32 states, no key padding, no gradient, a shape the
    kernel supports.
    """
    if device_type(phi_q.device) != "cuda" or key_padding_mask is not None:
        return None
    if triton_mode() != "on":
        return None
    tensors = (phi_q, phi_k, v, numerator, denominator)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    backend = triton_backend()
    if backend is None:
        return None
    reason = backend.decode_unsupported_reason(
        phi_q, phi_k, v, numerator, denominator, square=square
    )
    return backend if reason is None else None
