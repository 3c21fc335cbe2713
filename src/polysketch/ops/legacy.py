"""The pre-contract entry points of ``polysketch.ops``, kept for one release.

These return the DENSE square states (..., F, F, E) of earlier releases; the library now works
in the pair layout of ``polysketch.ops.state`` through the backend contract of
``polysketch.ops.dispatch``. Replacements:

    chunked_lt_multiply(_with_sums)  ->  ops.chunked.lt_multiply (num, den, state), or
                                         linear_attention(..., normalize=False)
    noncausal_multiply               ->  ops.noncausal.multiply
    square_state / square_apply /    ->  ops.pairs.key_state / PairFeatures.queries (pair
    apply_state                          layout), ops.pairs.expand to get a dense state

They stay exact: a dense ``initial`` goes in through ``pairs.compress`` and the returned state
comes back through ``pairs.expand`` plus the antisymmetric part of ``initial``, which the
queries never read (x⊗x is symmetric) but the old functions returned.
"""

from __future__ import annotations

import torch

from . import chunked
from .dispatch import group_bytes_for
from .pairs import compress, expand

__all__ = [
    "chunked_lt_multiply",
    "chunked_lt_multiply_with_sums",
    "noncausal_multiply",
    "square_state",
    "square_apply",
    "apply_state",
]


def square_state(b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """S_fge = Σ_t B_tf B_tg C_te for B (..., T, F), C (..., T, E) -> (..., F, F, E)."""
    f, e = b.shape[-1], c.shape[-1]
    bc = (b.unsqueeze(-1) * c.unsqueeze(-2)).flatten(-2)  # (..., T, F·E), never F²
    return (b.transpose(-1, -2) @ bc).unflatten(-1, (f, e))


def square_apply(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """out_te = Σ_fg A_tf A_tg S_fge for A (..., T, F), S (..., F, F, E) -> (..., T, E)."""
    f, e = s.shape[-2], s.shape[-1]
    y = (a @ s.flatten(-2)).unflatten(-1, (f, e))  # (..., T, F, E): Σ_f A_tf S_fge
    return torch.einsum("...tg,...tge->...te", a, y)


def apply_state(a: torch.Tensor, s: torch.Tensor, *, square: bool) -> torch.Tensor:
    """A S (plain, S: (..., F, E)) or Σ_fg A_f A_g S_fge (square, S: (..., F, F, E))."""
    return square_apply(a, s) if square else a @ s


def noncausal_multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    square: bool = False,
    initial: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal (A Bᵀ)^{∘q} C by associativity: A (Bᵀ C), q = 2 if ``square``.

    A (..., Tq, F), B (..., Tk, F), C (..., Tk, E); ``initial`` (dense, (..., F[, F], E)) is
    added to S. Returns out (..., Tq, E) and S (..., F[, F], E).
    """
    s = square_state(b, c) if square else b.transpose(-1, -2) @ c
    if initial is not None:
        s = s + initial
    return apply_state(a, s, square=square), s


def _dense_scan(a, b, c, *, chunk_size, square, initial, initial_sums, final_state, group_bytes):
    f = a.shape[-1]
    n0, z0 = initial, initial_sums
    if square:
        n0 = None if initial is None else compress(initial)
        z0 = None if initial_sums is None else compress(initial_sums, values=False)
    budget = group_bytes_for(a.device) if group_bytes is None else group_bytes
    out, rs, n, z = chunked.scan(
        a, b, c, chunk_size=chunk_size, square=square, initial=n0, initial_sums=z0,
        final_state=final_state, group_bytes=budget,
    )  # fmt: skip
    if square and n is not None:
        n, z = expand(n, f), expand(z, f, values=False)
        if initial is not None:  # the pair layout dropped the antisymmetric part: restore it
            n = n + (initial - initial.transpose(-2, -3)) / 2
        if initial_sums is not None:
            z = z + (initial_sums - initial_sums.transpose(-1, -2)) / 2
    return out, rs, n, z


def chunked_lt_multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    chunk_size: int = 256,
    square: bool = False,
    initial: torch.Tensor | None = None,
    group_bytes: int | None = None,
    final_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal lt((A Bᵀ)^{∘q}) C by blocks (Theorem 3.1) with dense states: A, B (..., T, F),
    C (..., T, E), ``initial`` (..., F[, F], E) -> out (..., T, E) and the final state
    initial + Σ_t Φ(B_t)⊗C_t (``None`` with ``final_state=False``). ``group_bytes`` default:
    the dispatcher's budget for the device."""
    out, _, state, _ = _dense_scan(
        a, b, c, chunk_size=chunk_size, square=square, initial=initial, initial_sums=None,
        final_state=final_state, group_bytes=group_bytes,
    )  # fmt: skip
    return out, state


def chunked_lt_multiply_with_sums(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    chunk_size: int = 256,
    square: bool = False,
    initial: torch.Tensor | None = None,
    initial_sums: torch.Tensor | None = None,
    group_bytes: int | None = None,
    final_state: bool = True,
):
    """``chunked_lt_multiply`` and the row sums lt((A Bᵀ)^{∘q}) 1: out (..., T, E), row_sums
    (..., T), state (..., F[, F], E) and key sums (..., F[, F]) (dense; both ``None`` with
    ``final_state=False``); ``initial_sums`` (..., F[, F])."""
    return _dense_scan(
        a, b, c, chunk_size=chunk_size, square=square, initial=initial,
        initial_sums=initial_sums, final_state=final_state, group_bytes=group_bytes,
    )  # fmt: skip
