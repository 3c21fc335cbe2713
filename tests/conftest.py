"""Shared test fixtures."""

import os

import pytest
import torch

# Without CUDA the Triton kernels (polysketch.ops.triton) run in Triton's CPU interpreter;
# triton reads TRITON_INTERPRET when a kernel is defined, so set it before any test imports.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One Triton launch configuration per kernel (read when the kernels are defined): on a GPU every
# kernel compiles once and nothing is autotuned, which keeps tests/gpu inside one short lease
# (the values do not depend on warps or stages; `make gpu-check`'s bench autotunes fully).
os.environ.setdefault("POLYSKETCH_TRITON_CONFIGS", "4x1")

# Tests run in parallel (pytest-xdist, one worker per core): one intra-op thread per worker
# avoids oversubscription, which makes small ops 10-100x slower on a 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic():
    """Every test starts from the same global RNG state and default dtype."""
    torch.manual_seed(0)
    yield


# torch._assert_async refuses a message of 255 bytes or more on CUDA (250 on MPS) before it checks
# anything, and takes any length on the CPU: the first GPU check failed every normalizer check so
# (docs/gpu.md). Every test runs with the device's limit, so a device path exercised on the CPU
# (``presented_device("cuda")``, ``asynchronous=True``) cannot carry a message a GPU refuses.
DEVICE_ASSERT_LIMIT = 250
_assert_async = torch._assert_async


def _assert_async_as_on_a_device(condition, assert_msg=None):
    if assert_msg is None:
        return _assert_async(condition)
    if not torch.compiler.is_compiling() and len(assert_msg.encode("utf-8")) >= DEVICE_ASSERT_LIMIT:
        raise RuntimeError(
            f"Message length must be smaller than {DEVICE_ASSERT_LIMIT} (a device refuses it): "
            f"{assert_msg[:80]!r}…"
        )
    return _assert_async(condition, assert_msg)


torch._assert_async = _assert_async_as_on_a_device


_NOISE_SEED = os.environ.get("POLYSKETCH_TEST_BLAS_NOISE", "")


@pytest.fixture(autouse=_NOISE_SEED not in ("", "0"))
def _blas_noise():
    """Under POLYSKETCH_TEST_BLAS_NOISE=<seed> (a positive integer) every matmul rounds as another
    BLAS would (blas_noise.py), one "other BLAS" per seed: tests/test_numerics_portability.py runs
    the numerics tests so, on every machine."""
    from blas_noise import BlasNoise

    with BlasNoise(int(_NOISE_SEED)):
        yield


def seeded(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``, for reproducible test draws."""
    return torch.Generator().manual_seed(seed)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error ||a - b|| / ||b||."""
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def naive_lt_same_dtype(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, square: bool):
    """Causal lt((A Bᵀ)^{∘q}) C and its row sums with every matmul and sum in the inputs' dtype
    (no upcast): flash-attention's same-dtype baseline for half-precision accuracy tests.

    a, b (..., T, F), c (..., T, E) -> (num (..., T, E), row_sums (..., T)).
    """
    t = a.shape[-2]
    s = a @ b.transpose(-1, -2)
    if square:
        s = s * s
    keep = torch.ones(t, t, dtype=torch.bool, device=a.device).tril()
    s = torch.where(keep, s, s.new_zeros(()))
    return s @ c, s.sum(-1)
