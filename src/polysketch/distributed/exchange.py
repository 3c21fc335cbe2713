"""The state exchange: one all-gather of the ranks' states, an exclusive prefix over ranks.

Rank r contributes a carry C_r (..., F', X): the state its shard passes on (LASP-2's memory
state; for linear attention [N Z] of ``polysketch.ops.state`` side by side). Every rank
gathers all W carries in one collective and forms, locally and in rank order,

    P_r = Σ_{j(r) <= ρ < r} C_ρ          (its exclusive prefix: the keys of earlier shards)
    P_W = Σ_{j(W) <= ρ < W} C_ρ          (the total: the state after the whole sequence)

with j(r) the last rank before r whose shard starts a document (``resets``; 0 when none, or
without packing): a packed document that begins inside shard ρ cuts the prefix there, and
ρ's carry is then already the state after that start.

Backward (reverse prefix): dC_r = Σ_{ρ: j(ρ) <= r < ρ} dP_ρ + [j(W) <= r] Σ_ρ dP_W^(ρ), where
dP_W^(ρ) is the gradient of rank ρ's copy of the total; every rank gathers the W prefix
gradients (and the W total gradients when the total is used), again one all-gather of
state-sized buffers. Nothing of size T is communicated in either direction. Every rank of the
group must run the backward (as with any collective in autograd).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .comm import all_gather_flat
from .group import CPGroup

__all__ = ["exchange_states", "keep_in_graph"]


@dataclass
class _Spec:
    group: CPGroup
    first: list[int]  # j(r) for r = 0..W (index W: the total)
    with_total: bool
    ints: list[int]
    name: str
    metas: list[list[int]] = field(default_factory=list)


def _sum(tensors: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Σ in list order (rank order), or zeros like ``like`` for an empty list."""
    if not tensors:
        return torch.zeros_like(like)
    total = tensors[0].clone()
    for t in tensors[1:]:
        total = total + t
    return total


class _StateExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, carry, spec):
        g = spec.group
        gathered, spec.metas = all_gather_flat(
            [carry.contiguous()], spec.ints, group=g, name=spec.name, phase="forward"
        )
        states = [parts[0] for parts in gathered]
        prefix = _sum(states[spec.first[g.rank] : g.rank], carry)
        total = _sum(states[spec.first[g.world_size] :], carry)
        ctx.spec = spec
        return prefix, total

    @staticmethod
    def backward(ctx, d_prefix, d_total):
        spec = ctx.spec
        g, w = spec.group, spec.group.world_size
        parts = [d_prefix.contiguous()] + ([d_total.contiguous()] if spec.with_total else [])
        gathered, _ = all_gather_flat(parts, [], group=g, name=spec.name, phase="backward")
        r = g.rank
        terms = [gathered[rho][0] for rho in range(w) if spec.first[rho] <= r < rho]
        if spec.with_total and spec.first[w] <= r:
            terms += [gathered[rho][1] for rho in range(w)]
        return _sum(terms, d_prefix), None


def exchange_states(
    carry: torch.Tensor,
    *,
    group: CPGroup,
    resets: list[bool] | None = None,
    with_total: bool = False,
    ints: list[int] | tuple[int, ...] = (),
    name: str = "state",
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """(P_r, P_W, metadata) of the module docstring for this rank's ``carry`` (..., F', X).

    ``resets[ρ]``: a document starts inside shard ρ (known to every rank; ``None``: none).
    ``with_total``: the total's gradient is gathered in the backward (set it when the total
    is used). ``ints``: small non-negative ints that ride along; the returned metadata lists
    them per rank. Differentiable in ``carry``.
    """
    w = group.world_size
    resets = [False] * w if resets is None else list(resets)
    if len(resets) != w:
        raise ValueError(f"resets must have one entry per rank ({w}), got {len(resets)}")
    first, last = [], 0
    for rho in range(w + 1):
        first.append(last)
        if rho < w and resets[rho]:
            last = rho
    spec = _Spec(group, first, bool(with_total), list(ints), name)
    prefix, total = _StateExchange.apply(carry, spec)
    return prefix, total, spec.metas


def keep_in_graph(x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """x + 0, where the 0 is the sum of an empty slice of each of ``tensors``: the same values
    (exactly: an empty sum is 0, whatever the tensors hold), with ``tensors`` in x's autograd
    graph. For a collective's output that this rank does not read (an empty shard, a halo of
    no rows): every rank must still run that collective's backward."""
    for t in tensors:
        x = x + t.flatten()[:0].sum()
    return x
