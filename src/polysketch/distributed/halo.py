"""Halos: the rows just before a rank's shard, from the ranks that hold them.

For x (..., T_r, C) sharded along the sequence (``polysketch.distributed.group``), the halo
of width w of rank r is

    halo_r = x[start_r - w : start_r]   (..., w, C),   rows before position 0 are zeros,

taken from as many earlier ranks as it needs (shards shorter than w, empty shards). Each rank
contributes its last min(T_ρ, w) rows, zero-padded to w, and its length T_ρ (which gives every
rank every start_ρ) to one all-gather; (W - 1)·w·C elements are received per rank, independent
of T. Backward: each rank gathers the W halo gradients and adds the rows that came from its
own shard (one all-gather of the same size).

Uses: ``short_conv = K`` needs the K - 1 inputs before the shard
(``polysketch.distributed.short_conv``); mixed attention needs the previous ranks' rows of the
block that crosses the shard boundary (``polysketch.distributed.mixed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._checks import check_int, check_tensor
from .comm import all_gather_flat
from .group import CPGroup, resolve_group

__all__ = ["halo", "halo_exchange"]


@dataclass
class _Spec:
    group: CPGroup
    width: int
    name: str
    lengths: list[int] = field(default_factory=list)

    def starts(self) -> list[int]:
        out, pos = [], 0
        for length in self.lengths:
            out.append(pos)
            pos += length
        return out

    def pieces(self, receiver: int):
        """(sender ρ, rows [i0, i1) of the receiver's halo, rows [j0, j1) of ρ's buffer)."""
        starts, w = self.starts(), self.width
        lo = starts[receiver] - w  # the halo's first (global) position
        for rho in range(receiver):
            m = min(self.lengths[rho], w)
            end = starts[rho] + self.lengths[rho]
            a, b = max(lo, end - m), min(starts[receiver], end)  # positions in both
            if b > a:
                yield rho, a - lo, b - lo, a - (end - m), b - (end - m)


class _Halo(torch.autograd.Function):
    """x: the last m = min(T, w) rows of the shard (T = ``length``) -> the halo (..., w, C)."""

    @staticmethod
    def forward(ctx, x, length, spec):
        m, w = x.shape[-2], spec.width
        buf = x.new_zeros(*x.shape[:-2], w, x.shape[-1])
        buf[..., :m, :] = x
        gathered, metas = all_gather_flat([buf], [length], group=spec.group, name=spec.name,
                                          phase="forward")  # fmt: skip
        spec.lengths = [meta[0] for meta in metas]
        out = torch.zeros_like(buf)
        for rho, i0, i1, j0, j1 in spec.pieces(spec.group.rank):
            out[..., i0:i1, :] = gathered[rho][0][..., j0:j1, :]
        ctx.spec, ctx.m = spec, m
        return out

    @staticmethod
    def backward(ctx, d_out):
        spec, m = ctx.spec, ctx.m
        g = spec.group
        gathered, _ = all_gather_flat([d_out.contiguous()], [], group=g, name=spec.name,
                                      phase="backward")  # fmt: skip
        dx = d_out.new_zeros(*d_out.shape[:-2], m, d_out.shape[-1])
        for receiver in range(g.rank + 1, g.world_size):
            for rho, i0, i1, j0, j1 in spec.pieces(receiver):
                if rho == g.rank:  # buffer row j is row j of x
                    dx[..., j0:j1, :] += gathered[receiver][0][..., i0:i1, :]
        return dx, None, None


def halo_exchange(
    tail: torch.Tensor, width: int, *, length: int, group=None, name: str = "halo"
) -> tuple[torch.Tensor, list[int]]:
    """(halo (..., width, C), every rank's shard length) from this rank's last
    min(``length``, ``width``) rows ``tail`` (..., m, C) and its shard ``length``; see ``halo``.
    Only the tail enters the autograd graph (its gradient comes back)."""
    g = resolve_group(group)
    tail = check_tensor(tail, "tail", min_dim=2)
    width = check_int(width, "width", minimum=0)
    length = check_int(length, "length", minimum=0)
    if tail.shape[-2] != min(length, width):
        raise ValueError(
            f"tail must hold the last min(length, width) = {min(length, width)} rows, got "
            f"{tail.shape[-2]}"
        )
    spec = _Spec(g, width, name)
    out = _Halo.apply(tail, length, spec)
    return out, spec.lengths


def halo(x: torch.Tensor, width: int, *, group=None) -> torch.Tensor:
    """The ``width`` rows before this rank's shard (module docstring), differentiable.

    Args:
        x: this rank's shard (..., T_r, C) (leading dims and C equal on every rank; any
            T_r >= 0). width: w >= 0. group: the cp group (``resolve_group``).

    Returns:
        (..., w, C): x[start_r - w : start_r] of the full sequence, zeros before position 0.
    """
    x = check_tensor(x, "x", min_dim=2)
    width = check_int(width, "width", minimum=0)
    t = x.shape[-2]
    return halo_exchange(x[..., t - min(t, width) :, :], width, length=t, group=group)[0]
