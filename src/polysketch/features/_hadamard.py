"""Walsh–Hadamard helpers for the SRHT / TensorSRHT sketches (PolySketchFormer Def. 2.3–2.4).

H_n is the unnormalized Sylvester–Walsh–Hadamard matrix of order n = 2^k (entries ±1,
H_n H_nᵀ = n I), in the natural order of ``scipy.linalg.hadamard``:
H_{ij} = (-1)^{popcount(i & j)}.

Two ways to apply it, both vectorized:

* ``fwht(x)``: the fast transform x ↦ x H_n in log2(n) reshape steps, O(n log n) per row.
* ``hadamard_columns(n, cols)``: the n×r matrix H_n[:, cols] built from the bit formula, so a
  subsampled transform x H P (P selects r columns) is one (n × r) matmul.

The sketches use ``hadamard_columns``: r ≤ n columns are needed, one matmul computes them, and
matmuls are what accelerators are built for (it also beats ``fwht`` + gather on a CPU:
``docs/results/implementation_choices.md``); ``fwht`` is kept as the independent reference
they are tested against.
"""

from __future__ import annotations

import torch

from .._checks import check_positive_int

__all__ = ["next_power_of_two", "fwht", "hadamard_columns", "hadamard_matrix"]


def next_power_of_two(n: int) -> int:
    """The least power of two >= n (n >= 1)."""
    n = check_positive_int(n, "n")
    return 1 << (n - 1).bit_length()


def _check_power_of_two(n: int, name: str) -> int:
    n = check_positive_int(n, name)
    if n & (n - 1):
        raise ValueError(f"{name} must be a power of two, got {n}")
    return n


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Fast unnormalized Walsh–Hadamard transform along the last dim: x ↦ x H_n.

    Shapes: (..., n) -> (..., n), n a power of two. log2(n) butterfly steps, each one reshape
    (..., n / 2h, 2, h) and a sum/difference; differentiable, no loop over elements.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    n = _check_power_of_two(x.shape[-1], "x.shape[-1]")
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return x


def hadamard_columns(n: int, cols: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """The columns ``cols`` of H_n: (n, *cols.shape) -> entries (-1)^{popcount(i & cols)}.

    ``cols`` is an integer tensor with values in [0, n); the result lives on ``cols.device``.
    For ``cols`` of shape (..., r) the result has shape (..., n, r).
    """
    n = _check_power_of_two(n, "n")
    rows = torch.arange(n, device=cols.device, dtype=torch.int64)
    v = rows.unsqueeze(-1) & cols.to(torch.int64).unsqueeze(-2)  # (..., n, r)
    parity = torch.zeros_like(v)
    bit = 1
    while bit < n:  # log2(n) steps: XOR-fold the bits of i & j
        parity = parity ^ ((v // bit) & 1)
        bit *= 2
    return (1 - 2 * parity).to(dtype)


def hadamard_matrix(
    n: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """The full n×n Sylvester–Walsh–Hadamard matrix H_n (entries ±1)."""
    n = _check_power_of_two(n, "n")
    return hadamard_columns(n, torch.arange(n, device=device), dtype=dtype)
