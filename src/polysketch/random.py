"""Seeded randomness.

Every random matrix or hash table in polysketch is drawn from an explicit ``seed`` or
``torch.Generator`` on the CPU (so the same seed gives the same draw on every device) and
then stored as a module buffer, which ``.to()`` moves and ``state_dict`` saves. Nothing is
redrawn except by an explicit ``redraw_`` call.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_int, check_positive_int

__all__ = [
    "MAX_SEED",
    "check_seed",
    "make_generator",
    "fresh_seed",
    "gaussian",
    "rademacher",
    "randint",
    "orthogonal_gaussian",
]


MAX_SEED = 2**64 - 1
"""The largest seed ``torch.Generator.manual_seed`` takes (seeds are 64-bit unsigned)."""


def check_seed(seed, name: str = "seed") -> int:
    """Return ``seed`` as an int in [0, 2**64); raise naming ``name`` otherwise.

    TypeError for a non-integer (bool included), ValueError for a negative seed or one beyond
    64 bits (torch's generators hold 64-bit seeds and would fail with an overflow deep inside).
    """
    seed = check_int(seed, name, minimum=0)
    if seed > MAX_SEED:
        raise ValueError(f"{name} must be < 2**64 (a 64-bit unsigned seed), got {seed}")
    return seed


def fresh_seed(generator: torch.Generator | None = None) -> int:
    """Draw a 63-bit seed from ``generator`` (or from torch's global RNG when ``None``)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator).item())


def make_generator(
    seed: int | None = None, generator: torch.Generator | None = None
) -> torch.Generator:
    """Return a CPU ``torch.Generator`` from an explicit ``seed`` or ``generator``.

    Exactly one source is used: ``generator`` if given (it must be a CPU generator; it is
    returned as is, so successive draws advance it), else a new generator seeded with
    ``seed``; if both are ``None`` the seed is drawn from torch's global RNG, so
    ``torch.manual_seed`` makes the result reproducible.
    """
    if generator is not None:
        if seed is not None:
            raise ValueError("pass either seed or generator, not both")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if generator.device.type != "cpu":
            raise ValueError(f"generator must be a CPU generator, got device {generator.device}")
        return generator
    if seed is None:
        seed = fresh_seed()
    seed = check_seed(seed)
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def gaussian(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """i.i.d. N(0, 1) entries of the given shape, float32, drawn in float64 on the CPU."""
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(torch.float32)


def rademacher(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """i.i.d. uniform ±1 entries of the given shape (float32)."""
    bits = torch.randint(0, 2, shape, generator=generator)
    return (2 * bits - 1).to(torch.float32)


def randint(high: int, *shape: int, generator: torch.Generator) -> torch.Tensor:
    """i.i.d. uniform integers in [0, high) of the given shape (int64)."""
    return torch.randint(0, high, shape, generator=generator, dtype=torch.int64)


def orthogonal_gaussian(num: int, dim: int, *, generator: torch.Generator) -> torch.Tensor:
    """``num`` Gaussian directions in R^dim, orthogonal within blocks of ``dim`` rows.

    Orthogonal random features (Yu et al., 2016; HRF paper §4): each block of ``dim`` rows
    is an orthonormal basis (QR of a Gaussian matrix with sign correction, i.e. Haar) and each
    row is rescaled by an independent chi(dim)-distributed norm, so every row is marginally
    N(0, I_dim) and estimators built on it stay unbiased.

    Returns: (num, dim) float32.
    """
    num = check_positive_int(num, "num")
    dim = check_positive_int(dim, "dim")
    num_blocks = math.ceil(num / dim)
    g = torch.randn(num_blocks, dim, dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(g)  # one batched QR for all blocks
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar-distributed
    directions = q.transpose(-1, -2).reshape(num_blocks * dim, dim)[:num]
    norms = torch.randn(num, dim, generator=generator, dtype=torch.float64).norm(
        dim=1, keepdim=True
    )
    return (directions * norms).to(torch.float32)
