"""Block sizes and launch configurations of the Triton kernels.

Register budget (H100: 64K 32-bit registers per SM, 255 per thread): the largest tensors a
program holds are the state tile (F, BE) fp32 (plain; square: one slice S_a), the block scores
(BT, BT) fp32, and the operand tiles A_n, B_n (BT, F), C_n (BT, BE). We keep F·BE <= 8192 and
BT <= 64 so that no tile exceeds 32 KiB of registers and the operands staged in shared memory
for ``tl.dot`` are small (BT·F·2 bytes for half A_n, B_n: 32 KiB at BT = 64, F = 256; software
pipelining multiplies the buffers, see below). Checked by compiling every kernel, mode and
supported configuration for sm_90 without a GPU, with triton 3.6 and 3.9
(``benchmarks/triton_compile_check.py``; tables in ``docs/results/triton_compile_check/``): all
compile; shared memory up to 176 KiB per program (plain half F = 256 dB/dC pass at 2 stages;
the H100 allows 227 KiB); half-precision square kernels spill at most ~0.7 KB per thread; plain
F >= 128 and fp32 configurations spill KBs (fp32 plain F = 256, dB/dC pass: ~45 KB per thread,
the worst); the split layout's phase 3 (``INIT``) spills more than the sequential pass in fp32
plain configurations (up to 3x). At 8 warps (an autotune choice) half kernels spill at most
~0.7 KB (square: 28 bytes). Run on an H100 (``docs/gpu.md``).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ._validate import interpreting

__all__ = [
    "autotune_configs",
    "block_t",
    "block_e",
    "slice_groups",
    "segment_length",
    "tuned",
    "mma",
]

MIN_BLOCK = 16  # tl.dot needs every dim >= 16
MAX_BLOCK = 64  # 128-row blocks: (128, 128) fp32 scores spilled registers (sm_90)
STATE_ELEMENTS = 8192  # F·BE of the fp32 state tile held in registers
OPERAND_BYTES = 32 * 1024  # BT·F·element size of one operand tile
MAX_SLICE_GROUPS = 8
PARTIAL_BYTES = 256 * 2**20  # fp32 partials of the slice groups (``slice_groups``)
SEGMENT_BYTES = 256 * 2**20  # fp32 segment states of the split layout (``segment_length``)
MIN_SEGMENT = 1024
FP32_BLOCK = 32
"""BT and BE cap for fp32 inputs: exact fp32 ``tl.dot`` (``input_precision="ieee"``) runs on
FMA units with its operands in registers; at 64-wide tiles ptxas (sm_90, triton 3.9) spilled
10-20 KB per thread to local memory, at 32 far less. Half inputs use tensor cores."""


def block_t(chunk_size: int, t: int, f: int, element_size: int) -> int:
    """BT: the largest power of two <= ``chunk_size`` in [16, 64], with BT·F·element_size
    <= 32 KiB (one operand tile A_n), at most 32 for fp32 inputs (``FP32_BLOCK``), and no
    larger than T rounded up to a power of two (short calls: less masked work)."""
    bt = 1 << (max(1, int(chunk_size)).bit_length() - 1)
    cap = min(MAX_BLOCK, OPERAND_BYTES // (f * element_size))
    if element_size == 4:
        cap = min(cap, FP32_BLOCK)
    bt = min(max(bt, MIN_BLOCK), cap)
    return max(MIN_BLOCK, min(bt, triton.next_power_of_2(t)))


def block_e(f: int, e: int, *, square: bool, element_size: int) -> int:
    """BE: the value columns per program (E is split in tiles over the grid's second axis);
    at most 32 for fp32 inputs (``FP32_BLOCK``)."""
    be = min(e, 64) if square else min(e, max(32, STATE_ELEMENTS // f))
    return min(be, FP32_BLOCK) if element_size == 4 else be


def slice_groups(
    bh: int, t: int, f: int, e: int, sms: int | None, *, square: bool, element_size: int
) -> int:
    """NS, the groups the F square-state slices are split into across programs (1 when plain).

    The grid is (BH, E/BE, NS): with few batch·heads (B = 1, H = 12: 12 programs on 132
    SMs) the slices of one sequence run on NS SMs at once. Each group writes fp32 partials,
    summed afterwards in a fixed order (deterministic): NS·BH·T·E·4 bytes of numerator in the
    forward, NS·BH·T·(2·(E/BE)·F + E)·4 bytes of dA, dB, dC in the backward, capped together
    at ``PARTIAL_BYTES``. Grows NS (powers of two, at most 8 and F) until the grid covers the
    GPU's ``sms`` multiprocessors (``polysketch.ops.dispatch.multiprocessor_count``); 1 when
    ``sms`` is None (no GPU: the interpreter).
    """
    if not square or sms is None:
        return 1
    ne = triton.cdiv(e, block_e(f, e, square=True, element_size=element_size))
    per_group = bh * t * (2 * ne * f + e) * 4
    ns = 1
    while (
        bh * ne * ns < sms
        and 2 * ns <= min(MAX_SLICE_GROUPS, f)
        and 2 * ns * per_group <= PARTIAL_BYTES
    ):
        ns *= 2
    return ns


def segment_length(
    bh: int, t: int, f: int, e: int, bt: int, *, square: bool, requested: int | None = None
) -> int:
    """L, the segment length of the split layout (``_layout``): ``requested`` rounded up to
    a multiple of BT, else the smallest L = 1024·2^k whose fp32 segment states,
    ceil(T/L)·BH·F^q·(E + 1)·4 bytes (q = 2 if square), fit in ``SEGMENT_BYTES`` (L >= T,
    one segment, when none does: the sequential pass)."""
    if requested is not None:
        return triton.cdiv(requested, bt) * bt
    per_segment = bh * (f * f if square else f) * (e + 1) * 4
    seg = max(MIN_SEGMENT, bt)
    while seg < t and triton.cdiv(t, seg) * per_segment > SEGMENT_BYTES:
        seg *= 2
    return seg


WARPS = (4, 8)
STAGES = (1, 2)
CONFIGS_ENV = "POLYSKETCH_TRITON_CONFIGS"
"""Environment variable naming the (warps, stages) the autotuner tries, as ``WxS[,WxS...]``
(e.g. ``4x1``): one config is compiled and launched without timing. ``tests/gpu`` sets one
(cheap tests: every kernel compiles once); unset, every pair of ``WARPS`` × ``STAGES``."""


def autotune_configs() -> list[tuple[int, int]]:
    """The (num_warps, num_stages) pairs ``tuned`` gives the autotuner (``CONFIGS_ENV``);
    ValueError naming the variable for a malformed value."""
    text = os.environ.get(CONFIGS_ENV, "").strip()
    if not text:
        return [(w, s) for w in WARPS for s in STAGES]
    pairs = []
    for item in text.split(","):
        warps, _, stages = item.strip().lower().partition("x")
        if not (warps.isdigit() and stages.isdigit()) or int(warps) not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"{CONFIGS_ENV} must be WARPSxSTAGES[,...] with warps in 1, 2, 4, 8, 16 and "
                f"stages >= 1 (e.g. 4x1), got {text!r}"
            )
        if int(stages) < 1:
            raise ValueError(f"{CONFIGS_ENV}: stages must be >= 1, got {text!r}")
        pairs.append((int(warps), int(stages)))
    return pairs


def tuned():
    """``triton.autotune`` over warps and pipeline stages (``autotune_configs``; key: the
    shape constexprs), or nothing under the interpreter (one plain launch with 4 warps,
    nothing to time).

    The kernels zero their own scratch state, except the split layout's phase 3 (``INIT``),
    which starts from and updates its slots of ``STATE`` in place: the autotuner restores
    ``STATE`` after each timed run (``restore_value``; a copy of it while tuning).
    """

    def wrap(kernel):
        if interpreting():
            return kernel
        configs = [triton.Config({}, num_warps=w, num_stages=s) for w, s in autotune_configs()]
        key = ["F", "E", "BT", "BE", "SQUARE", "NS", "INIT", "STATE_ONLY"]
        return triton.autotune(configs=configs, key=key, restore_value=["STATE"])(kernel)

    return wrap


INTERPRET_UPCAST = tl.constexpr(interpreting())
"""Under the interpreter, ``mma`` multiplies in fp32: triton 3.9's interpreter returns garbage
for ``tl.dot`` on bfloat16 operands. The product of two half values is exact in fp32, so
this is the arithmetic of the compiled half-precision ``tl.dot`` with fp32 accumulation (up to
the summation order)."""


@triton.jit
def mma(x, y, PRECISION: tl.constexpr):
    """``tl.dot(x, y)`` with fp32 accumulation; operands of one dtype, every dim >= 16."""
    if INTERPRET_UPCAST:
        out = tl.dot(x.to(tl.float32), y.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(x, y, input_precision=PRECISION)
    return out
