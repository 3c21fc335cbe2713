"""Shared test fixtures."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    """Every test starts from the same global RNG state and default dtype."""
    torch.manual_seed(0)
    yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error ||a - b|| / ||b||."""
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
