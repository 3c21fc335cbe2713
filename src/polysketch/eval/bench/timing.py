"""How ``polysketch bench`` times a call: ``torch.utils.benchmark.Timer``, peak memory, malloc.

``time_call(fn, ...)`` times ``fn()`` with ``torch.utils.benchmark.Timer``, which runs it
under the current torch thread count and synchronises an accelerator (CUDA) before reading
the clock. ``Timer.blocked_autorange(min_run_time=min_time)`` first picks a block size (calls
per timed block, so that reading the clock costs < 0.01% of a block; those calls are the
warm-up), then times blocks until ``min_time`` seconds have passed; a call slower than that
is timed again until ``min_repeats`` calls were timed. Reported: the median and the fastest
time per call over the blocks, and the number of timed calls.
``peak_memory(fn, device)`` is the CUDA allocator's peak above the memory allocated before
the call (None elsewhere). ``set_malloc_top_pad`` keeps freed heap memory in the process
(glibc ``M_TOP_PAD``, ``MALLOC_TOP_PAD``), as ``polysketch bench`` does by default.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils.benchmark import Timer

from ..._checks import check_float, check_positive_int

__all__ = ["Timing", "time_call", "peak_memory", "set_malloc_top_pad", "MALLOC_TOP_PAD"]

MALLOC_TOP_PAD = 2**30
"""Bytes glibc ``malloc`` keeps at the top of the heap when memory is freed (``M_TOP_PAD``).

The chunked scan allocates and frees several MiB of temporaries per block. With glibc's
defaults, freed memory goes back to the OS and is page-faulted in again on the next block;
in this project's VM that alone made causal polysketch attention 1.2-1.4x slower at
T = 2k-16k and the F = 256 map up to 1.9x slower (SDPA, one fused kernel, is unaffected).
``polysketch bench`` sets it for its process by default (``--default-malloc`` to measure
without); users get the same effect with ``MALLOC_TOP_PAD_=1073741824`` in the environment
or a caching allocator such as jemalloc or tcmalloc."""


class Timing(NamedTuple):
    """Seconds per call: the median and the fastest over the timed blocks of ``repeats``
    calls in all."""

    median: float
    repeats: int
    fastest: float


def time_call(fn: Callable[[], object], *, min_time: float, min_repeats: int = 1) -> Timing:
    """Time ``fn()`` with ``torch.utils.benchmark.Timer`` (module docstring): blocks of calls
    for ``min_time`` seconds after a warm-up, and at least ``min_repeats`` timed calls."""
    min_time = check_float(min_time, "min_time", minimum=0.0)
    min_repeats = check_positive_int(min_repeats, "min_repeats")
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    measured = timer.blocked_autorange(min_run_time=min_time)
    times = list(measured.times)  # seconds per call, one value per block
    calls = len(times) * measured.number_per_run
    if calls < min_repeats:  # slower than min_time: time it again, min_repeats calls in all
        more = timer.blocked_autorange(min_run_time=(min_repeats - calls) * measured.median)
        times += more.times
        calls += len(more.times) * more.number_per_run
    return Timing(statistics.median(times), calls, min(times))


def peak_memory(fn: Callable[[], object], device: torch.device) -> int | None:
    """Bytes the CUDA allocator held at the peak of ``fn()`` above what was allocated before;
    None on other devices (no allocator statistics)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def set_malloc_top_pad(nbytes: int) -> bool:
    """``mallopt(M_TOP_PAD, nbytes)`` on glibc; False where unavailable (no change then)."""
    nbytes = check_positive_int(nbytes, "malloc_top_pad")
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(-2, min(nbytes, 2**31 - 1)))  # M_TOP_PAD = -2 in <malloc.h>
