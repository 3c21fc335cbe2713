"""Keep freed CPU memory in the process between training steps (glibc's malloc).

glibc gives freed memory back to the kernel in two ways: a block at or above the mmap
threshold is unmapped when freed, and free space at the top of the heap beyond the trim
threshold is trimmed. By default both thresholds are dynamic: the mmap threshold rises from
128 KiB to the size of the largest mmapped block freed so far (at most 32 MiB), the trim
threshold is twice that. A training step allocates and frees the same large activations every
step; when it frees more than the trim threshold at the top of the heap at once (the
activations of a checkpointed layer, the gradients of a wide feature map), the next step
allocates them again from fresh pages, and the kernel faults in and zeroes every 4 KiB page of
them again: system time that grows with the activations' bytes, not with the FLOPs. The
2048 × 1920 bucket probabilities of ``soft_hash_far_local`` (15 MiB each, several per layer)
pay it every step on a CPU (``docs/results/long_context/speed/README.md``).

``hold_freed_memory()`` fixes both thresholds: the mmap threshold at glibc's largest (32 MiB:
blocks below it come from the heap and go back to it) and the trim threshold at 2 GiB − 1 (the
heap is not trimmed), so a step reuses the pages of the step before. The cost: the process keeps
the heap it reached at its peak (a training step reaches it again each step) until it exits;
blocks of 32 MiB and more are mmapped and unmapped as before.

It changes the whole process, so the library never calls it on import: the ``polysketch``
command line calls it once at start (``polysketch.cli.main``), and a training loop of one's own
may. It leaves the allocator alone where the user has chosen one: another C library than glibc,
a ``MALLOC_*_`` variable or ``glibc.malloc`` tunable in the environment, an allocator in
``LD_PRELOAD`` (jemalloc, tcmalloc, mimalloc: they keep freed memory themselves), or
``POLYSKETCH_SYSTEM_MALLOC=1``.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "hold_freed_memory", "holds_freed_memory"]

_M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc's malloc.h)
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 1024 * 1024
"""Blocks below this come from the heap: glibc's largest accepted value on 64-bit systems
(HEAP_MAX_SIZE / 2)."""

TRIM_THRESHOLD = 2**31 - 1
"""Free heap top kept before trimming: the largest value ``mallopt``'s ``int`` takes."""

_ENV_CHOICES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                "MALLOC_MMAP_MAX_", "MALLOC_ARENA_MAX")  # fmt: skip
_held = False


def _user_choice() -> str | None:
    """The environment setting by which the user chose the allocator's behaviour, if any."""
    if os.environ.get("POLYSKETCH_SYSTEM_MALLOC", "") not in ("", "0"):
        return "POLYSKETCH_SYSTEM_MALLOC"
    for name in _ENV_CHOICES:
        if name in os.environ:
            return name
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # jemalloc, tcmalloc, mimalloc, ...
        return "LD_PRELOAD"
    return None


def hold_freed_memory() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD`` and its trim threshold at
    ``TRIM_THRESHOLD`` for this process (module docstring). Returns whether both are set now:
    False off Linux/glibc, where the environment chooses the allocator (module docstring), or
    where ``mallopt`` refuses a value. Idempotent."""
    global _held
    if _held:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if _user_choice() is not None:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the mmap threshold first: setting either turns glibc's dynamic thresholds off
    _held = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _held


def holds_freed_memory() -> bool:
    """Whether ``hold_freed_memory`` set the thresholds in this process."""
    return _held
