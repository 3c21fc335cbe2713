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

    "chunked"  -> "chunked_scan" on CPU, "chunked_blocks" on every other device, or
                  "triton" on CUDA when Triton is switched on (``enable_triton``), the inputs
                  are bf16/fp16, no state goes in or out, the kernels support the shape, and
                  the call is not being compiled (inductor fuses chunked_blocks itself)
    a name     -> that backend on any device ("triton" on CPU needs TRITON_INTERPRET=1); a
                  call it cannot do is refused with the reason (ValueError)
    gradients  -> "chunked_scan" has no backward of its own: calls that need one run the
                  recomputing ``ops.blocks`` function over the same cache-sized groups

Triton is opt-in: its kernels have been tested under Triton's CPU interpreter and compiled for
sm_90, but never run or timed on a GPU, so no default picks them (README "Backends").
Switch them on with ``enable_triton()`` or ``POLYSKETCH_TRITON=1`` in the environment (read
at the first decision); ``algorithm="triton"`` always asks for them explicitly.

Nothing outside this module branches on the device in the attention path (``ops``,
``nn.attention``, ``nn.cache``): memory budgets, operand dtype, the layout, the fused decode
step and the GPU facts the Triton launch grids need (``multiprocessor_count``) are decided
here. (The Triton package still validates that its inputs sit where its kernels can run, and
``nn.attention`` sets up autocast for the input's device type: checks and set-up, not choices.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._checks import check_choice, compute_dtype
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


# ----- device policy ------------------------------------------------------------------------
def operand_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype of matmul operands for inputs of ``dtype`` on ``device``.

    On accelerators bf16/fp16 stay half (tensor cores, fp32 accumulation inside the GEMM);
    states, prefix sums and normalizers are still kept in ``compute_dtype`` (fp32) by the ops.
    On CPU half inputs are upcast: CPU BLAS has no fast half GEMM on most machines and fp32
    measured faster here. Other dtypes are unchanged.
    """
    if dtype in _HALF and torch.device(device).type == "cpu":
        return torch.float32
    return dtype


def layout_for(device: torch.device | str) -> str:
    """The block layout for ``device``: ``"chunked_scan"`` on CPU, else ``"chunked_blocks"``."""
    return "chunked_scan" if torch.device(device).type == "cpu" else "chunked_blocks"


def group_bytes(layout: str) -> int | None:
    """The temporaries budget of a layout: ``CPU_GROUP_BYTES`` for the cache-sized scan,
    ``ACCELERATOR_GROUP_BYTES`` for the batched blocks, ``None`` for the others."""
    return {"chunked_scan": CPU_GROUP_BYTES, "chunked_blocks": ACCELERATOR_GROUP_BYTES}.get(layout)


def group_bytes_for(device: torch.device | str) -> int:
    """The group budget on ``device``: that of ``layout_for(device)``."""
    return group_bytes(layout_for(device))


# ----- Triton: optional, opt-in -------------------------------------------------------------
_BACKEND: list = []  # [module or None], decided once per process (not per call)
_TRITON_SWITCH: list = []  # [bool] once decided (environment, or enable_triton)


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


def enable_triton(enabled: bool = True) -> None:
    """Let ``algorithm="chunked"`` and ``linear_attention_step`` pick the Triton kernels on
    CUDA (``False`` switches them off again). Overrides ``POLYSKETCH_TRITON``."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _TRITON_SWITCH[:] = [enabled]


def triton_enabled() -> bool:
    """Whether automatic choices may pick Triton: ``enable_triton``'s last word, else
    ``POLYSKETCH_TRITON`` in (1, true, on, yes) at the first call; off by default."""
    if not _TRITON_SWITCH:
        value = os.environ.get("POLYSKETCH_TRITON", "0").strip().lower()
        _TRITON_SWITCH.append(value in ("1", "true", "on", "yes"))
    return _TRITON_SWITCH[0]


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
        and not torch.compiler.is_compiling()
        and a.device.type == "cuda"
        and a.dtype in _HALF  # fp32 kernels spill registers
        and triton_enabled()
        and _refusal("triton", a, b, c, square=square, with_state=with_state) is None
    ):
        return "triton"
    return layout


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

    Triton only when switched on (``enable_triton``), on CUDA, for exactly what the PyTorch
    step computes there: one new token, fp32/bf16/fp16 inputs with fp32 states, no key
    padding, no gradient, a shape the kernel supports.
    """
    if not (phi_q.is_cuda and triton_enabled() and key_padding_mask is None):
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
