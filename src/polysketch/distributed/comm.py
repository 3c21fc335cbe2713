"""The one collective of context parallelism, and a record of the bytes it moves.

Every exchange of ``polysketch.distributed`` is one ``all_gather`` of a flat buffer per rank:
the tensors a rank contributes (a state, a halo of rows, their gradients), flattened and
concatenated, followed by a few small integers (a shard length, a state length) written as
base-256 digits, exact in every floating dtype (bf16 holds the integers 0..256 exactly). So
metadata costs no collective of its own, and every rank reads the same gathered metadata: a
shard that does not fit is refused on every rank at once instead of leaving the others
waiting in a collective.

Recording: inside ``with record_collectives() as log:`` each gather appends a ``Collective``
(what, forward or backward, the bytes one rank contributes, the group size); ``log.received``
sums what one rank receives, (W - 1) × the contribution per gather. ``benchmarks/cp_attention.py``
reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .group import CPGroup

__all__ = ["Collective", "CommLog", "record_collectives", "all_gather_flat", "gather_ints"]

_DIGITS = 4  # base-256 digits per integer: 0 <= value < 2**32
_BASE = 256


@dataclass(frozen=True)
class Collective:
    """One all-gather: ``name`` (e.g. ``"state"``), ``phase`` (``"forward"``/``"backward"``),
    ``payload_bytes`` one rank contributes (tensors + metadata), ``world_size``."""

    name: str
    phase: str
    payload_bytes: int
    world_size: int

    @property
    def received_bytes(self) -> int:
        """Bytes one rank receives: the other W - 1 ranks' payloads."""
        return (self.world_size - 1) * self.payload_bytes


@dataclass
class CommLog:
    """The ``Collective`` records of a ``record_collectives`` block, in order."""

    records: list[Collective] = field(default_factory=list)

    def received(self, *, phase: str | None = None, name: str | None = None) -> int:
        """Bytes one rank received, over the records of ``phase`` / ``name`` (None: all)."""
        return sum(
            r.received_bytes
            for r in self.records
            if (phase is None or r.phase == phase) and (name is None or r.name == name)
        )


_LOGS: list[CommLog] = []


@contextmanager
def record_collectives() -> Iterator[CommLog]:
    """Record every collective of this package inside the block (this process only)."""
    log = CommLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def _encode(values: list[int], like: torch.Tensor) -> torch.Tensor:
    digits = []
    for value in values:
        if not 0 <= value < _BASE**_DIGITS:
            raise ValueError(f"metadata value {value} outside [0, 2**32)")
        digits += [(value // _BASE**i) % _BASE for i in range(_DIGITS)]
    return torch.tensor(digits, dtype=like.dtype, device=like.device)


def _decode(digits: torch.Tensor) -> list[int]:
    raw = [int(round(x)) for x in digits.tolist()]
    return [sum(raw[i + j] * _BASE**j for j in range(_DIGITS)) for i in range(0, len(raw), _DIGITS)]


def all_gather_flat(
    parts: list[torch.Tensor],
    ints: list[int],
    *,
    group: CPGroup,
    name: str,
    phase: str,
) -> tuple[list[list[torch.Tensor]], list[list[int]]]:
    """All-gather ``parts`` (same dtype and device; shapes equal on every rank) and ``ints``.

    Returns, per rank of the group in order, its tensors (shaped as ``parts``) and its ints.
    One ``dist.all_gather`` of one flat buffer; recorded under ``name`` and ``phase``.
    Not differentiable (the autograd Functions of this package call it in both directions).
    """
    like = parts[0]
    flat = torch.cat([p.detach().reshape(-1) for p in parts] + [_encode(ints, like)])
    for log in _LOGS:
        log.records.append(
            Collective(name, phase, flat.numel() * flat.element_size(), group.world_size)
        )
    if group.world_size == 1:
        gathered = [flat]
    else:
        gathered = [torch.empty_like(flat) for _ in range(group.world_size)]
        dist.all_gather(gathered, flat, group=group.pg)
    sizes = [p.numel() for p in parts] + [len(ints) * _DIGITS]
    tensors, metas = [], []
    for buf in gathered:
        *pieces, digits = buf.split(sizes)
        tensors.append([x.view(p.shape) for x, p in zip(pieces, parts, strict=True)])
        metas.append(_decode(digits))
    return tensors, metas


def gather_ints(ints: list[int], *, group: CPGroup, name: str, device) -> list[list[int]]:
    """All-gather a few non-negative ints per rank (e.g. shard lengths): per rank, its ints."""
    like = torch.empty(0, dtype=torch.float32, device=device)
    return all_gather_flat([like], ints, group=group, name=name, phase="forward")[1]
