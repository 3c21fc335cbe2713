"""The numerics tests pass on every CPU's BLAS, not only on the one that ran them first.

MKL (and every BLAS) picks its kernels by CPU, vector width and shape, so the same product sums
in another order on another machine. A tolerance read off one machine fails on another (issue
38: five failures on an Intel Xeon's AVX-512 path that passed where they were written; issue
69: one more on its AVX2 path). This guard reruns the numerics tests, in subprocesses, under
``blas_noise.BlasNoise`` (``POLYSKETCH_TEST_BLAS_NOISE=1``: every matmul gets a rounding error
of its own, of the size another order would give) combined with each of MKL's conditional
numerical reproducibility branches this CPU runs differently: the default path,
``MKL_CBWR=COMPATIBLE`` (the SSE2 path, on every x86-64 CPU), ``AVX2`` where the CPU has AVX2
and ``AVX512`` where it has AVX-512F. A branch whose products equal, bit for bit, those of a
branch already listed (MKL ignores the vector branches on some CPUs, and the default is one
of them on others) would rerun the same arithmetic and is skipped (``_branches``).

The noise makes every machine behave like another BLAS, and each MKL branch gives it other
products to perturb, so a tolerance that holds only for a lucky summation order fails here
whatever CPU runs the suite. ``tests/numerics_margins.py`` shows each comparison's margin under
every branch and many noise seeds.

``NUMERICS`` lists the tests that compare two float computations with a rounding tolerance
(features, ops, decoding, the Hugging Face caches and padding); compiled tests are left out
(torch.compile does not trace under a dispatch mode, and inductor writes its own loops).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent

NUMERICS = [
    "test_features_stability.py",
    "test_features_baselines.py::test_output_dtype_follows_input",
    "test_features_exact.py",
    "test_features_fpa.py::test_table1_linear_case",
    "test_features_fpa.py::test_table1_identity_is_tensor_power",
    "test_features_fpa.py::test_dtypes_follow_input",
    "test_features_fpa.py::test_seed_reproducibility_and_state_dict",
    "test_features_llops.py::test_output_dtype_follows_input",
    "test_nn_heads.py",
    "test_ops_recurrent.py",
    "test_ops_validation.py",
    "test_ops_linear.py",
    "test_ops_blocks.py",
    "test_ops_mixed.py",
    "test_ops_varlen.py",
    "test_integrations_transformers.py::test_cached_decoding_equals_full_forward",
    "test_integrations_transformers_padding.py::test_left_padded_forward_equals_each_row_alone",
    "test_integrations_transformers_caches.py",
    "test_train_loop.py::test_grad_accumulation_matches_one_big_batch",
]


def _run(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    env.pop("PYTEST_XDIST_WORKER", None)
    if "MKL_CBWR" not in env_extra:
        env.pop("MKL_CBWR", None)  # the default path
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "-p", "no:xdist", "-k", "not compile", *(f"tests/{t}" for t in NUMERICS)]  # fmt: skip
    return subprocess.run(cmd, cwd=TESTS.parent, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, (
        f"numerics tests fail {what}: a tolerance depends on the BLAS's summation order "
        f"(use tests/numerics.py's bounds)\n" + proc.stdout[-6000:] + proc.stderr[-2000:]
    )


_PROBE = (
    "import hashlib, torch; torch.manual_seed(0); h = hashlib.md5()\n"
    "for m, k, n in ((257, 1031, 129), (64, 64, 64), (3, 100, 37), (1, 16, 256)):\n"
    "    h.update((torch.randn(m, k) @ torch.randn(k, n)).numpy().tobytes())\n"
    "print(h.hexdigest())"
)


def _cpu_flags() -> set[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in info.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _candidates() -> list[str]:
    """default, COMPATIBLE, and AVX2 / AVX512 where the CPU has them (default only without MKL)."""
    if not torch.backends.mkl.is_available():
        return ["default"]
    flags = _cpu_flags()
    vector = ["AVX2"] * ("avx2" in flags) + ["AVX512"] * ("avx512f" in flags)
    return ["default", "COMPATIBLE", *vector]


@functools.cache
def _digest(branch: str) -> str:
    """A digest of float32 products of four shapes (tall to one row) under MKL_CBWR=branch."""
    env = {**os.environ}
    env.pop("MKL_CBWR", None)
    if branch != "default":
        env["MKL_CBWR"] = branch
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    return out.stdout.strip()


@pytest.mark.parametrize("branch", _candidates())
def test_numerics_pass_under_noise_on_each_mkl_path(branch):
    earlier = _candidates()[: _candidates().index(branch)]
    same = [b for b in earlier if _digest(b) == _digest(branch)]
    if same:
        pytest.skip(f"MKL_CBWR={branch} gives the products of {same[0]} bit for bit on this CPU")
    env = {"POLYSKETCH_TEST_BLAS_NOISE": "1"}
    if branch != "default":
        env["MKL_CBWR"] = branch
    _check(_run(env), f"under blas_noise.BlasNoise with MKL_CBWR={branch}")
