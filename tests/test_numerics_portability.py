"""The numerics tests pass on every CPU's BLAS, not only on the one that ran them first.

MKL (and every BLAS) picks its kernels by CPU, vector width and shape, so the same product sums
in another order on another machine. A tolerance read off one machine fails on another (issue
38: five failures on an Intel Xeon's AVX-512 path that passed where they were written). This
guard reruns the numerics tests, in subprocesses, where their summation orders differ:

* under ``blas_noise.BlasNoise`` (``POLYSKETCH_TEST_BLAS_NOISE=1``): every matmul gets a
  rounding error of its own, of the size another order would give. It works on every machine,
  so a BLAS-path dependence fails here whatever CPU runs the suite;
* under MKL's conditional numerical reproducibility branches: ``MKL_CBWR=COMPATIBLE`` (the
  SSE2 path, on every x86-64 CPU) and, on Intel CPUs, ``MKL_CBWR=AVX512`` where the CPU has
  AVX-512 and ``AVX2`` where it has not (MKL ignores those branches on other vendors' CPUs).

``NUMERICS`` lists the tests that compare two float computations with a rounding tolerance
(features, ops, decoding, the Hugging Face caches and padding); compiled tests are left out
(torch.compile does not trace under a dispatch mode, and inductor writes its own loops).
"""

from __future__ import annotations

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
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "-p", "no:xdist", "-k", "not compile", *(f"tests/{t}" for t in NUMERICS)]  # fmt: skip
    return subprocess.run(cmd, cwd=TESTS.parent, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, (
        f"numerics tests fail {what}: a tolerance depends on the BLAS's summation order "
        f"(use tests/numerics.py's bounds)\n" + proc.stdout[-6000:] + proc.stderr[-2000:]
    )


def test_numerics_pass_under_another_summation_order():
    _check(_run({"POLYSKETCH_TEST_BLAS_NOISE": "1"}), "under blas_noise.BlasNoise")


def _intel_branches() -> list[str]:
    """MKL_CBWR branches of this CPU's own vector paths (Intel only: MKL ignores them on others)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    if "GenuineIntel" not in info:
        return []
    return ["AVX512"] if " avx512f" in info else ["AVX2"]


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch is built without MKL")
@pytest.mark.parametrize("branch", ["COMPATIBLE", *_intel_branches()])
def test_numerics_pass_on_each_mkl_path(branch):
    _check(_run({"MKL_CBWR": branch}), f"with MKL_CBWR={branch}")
