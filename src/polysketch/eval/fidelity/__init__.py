"""Fidelity: how well feature maps reproduce their kernels, on sampled or captured q, k.

* ``metrics``: relative Frobenius error, RMAE (LLoPS Eq. 21), max relative error;
* ``evaluate``: ``evaluate_map`` (one map, seeded trials, optional fit) and ``sweep`` (maps ×
  degrees × feature dims), each against the Eckart–Young optimum (LLoPS Thm 3.1, from
  ``polysketch.features.optimal_rank``, re-exported here);
* ``data_sources``: ``load_qk`` (Gaussian, sphere, or a ``.pt``/``.npz``/``.npy`` file);
* ``capture``: the q, k (and v) a model's attention layers receive (``capture_qk``,
  ``capture_qkv``), per-head samples;
* ``softmax``: softmax-kernel estimators' error vs the angle between q and k (HRF Fig. 2);
* ``approx``: what ``polysketch approx`` measures and writes.

The names of the former module ``polysketch.eval.fidelity`` are importable from here as
before.
"""

from ...features.optimal_rank import (
    OptimalError,
    fitted_optimum,
    optimal_curve,
    optimal_rank_approximation,
    optimal_rank_error,
    optimal_rank_error_of,
    polynomial_target,
)
from .data_sources import load_qk
from .evaluate import evaluate_map, sweep
from .metrics import kernel_matrices, max_relative_error, relative_frobenius_error, rmae

__all__ = [
    "polynomial_target",
    "kernel_matrices",
    "relative_frobenius_error",
    "rmae",
    "max_relative_error",
    "OptimalError",
    "optimal_rank_approximation",
    "optimal_rank_error_of",
    "optimal_rank_error",
    "optimal_curve",
    "fitted_optimum",
    "evaluate_map",
    "sweep",
    "load_qk",
]
