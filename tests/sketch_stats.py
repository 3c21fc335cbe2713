"""Helpers shared by the statistical tests of the random sketches."""

import math

import torch


def correlated_pairs(dim, n=3, seed=0, mix=0.8):
    """Unit rows x and correlated unit rows y (diagonal dots ≈ mix): (n, dim) each, fp64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True)
    noise = torch.randn(n, dim, generator=g, dtype=torch.float64) / math.sqrt(dim)
    y = mix * x + math.sqrt(1 - mix**2) * noise
    return x, y / y.norm(dim=-1, keepdim=True)


def seeded_estimates(make, x, y, draws):
    """approx_kernel of ``make(seed)`` over seeds 0..draws-1: (draws, Tx, Ty)."""
    return torch.stack([make(seed).approx_kernel(x, y) for seed in range(draws)])
