"""The context-parallel group and the shards of a sequence.

Each rank r of a ``cp`` group of W ranks holds one contiguous shard [start_r, end_r) of the
sequence (dim -2 of every (..., T, ·) tensor), in rank order. The ops of
``polysketch.distributed`` accept any such split (shards may differ in length or be empty);
they learn the other ranks' lengths from their first collective. ``shard_bounds`` is the
balanced split this package suggests (``torch.tensor_split``'s: the first T mod W ranks hold
⌈T/W⌉ tokens, the others ⌊T/W⌋; T < W leaves the last ranks empty).

A group is a ``torch.distributed`` ``ProcessGroup``, a 1-D ``DeviceMesh`` (for a 2-D
``dp × cp`` mesh pass ``mesh["cp"]``), or ``None`` for the default (world) group. gloo (CPU)
is what the tests run; NCCL (CUDA) is supported by the same calls but untested here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._checks import check_int, check_positive_int

__all__ = ["CPGroup", "resolve_group", "shard_bounds", "shard"]


@dataclass(frozen=True)
class CPGroup:
    """A resolved group: the ``ProcessGroup`` ``pg``, this process's ``rank`` in it and the
    group's ``world_size``."""

    pg: object
    rank: int
    world_size: int


def resolve_group(group=None) -> CPGroup:
    """``group`` (ProcessGroup, 1-D DeviceMesh or ``None`` = world) as a ``CPGroup``.

    Raises ValueError naming ``group`` when torch.distributed is not initialized, the mesh is
    not 1-D, or this process is not a member; TypeError for another type.
    """
    if isinstance(group, CPGroup):
        return group
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "group: context parallelism needs an initialized torch.distributed process group "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    from torch.distributed.device_mesh import DeviceMesh

    if group is None:
        pg = dist.group.WORLD
    elif isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group: a DeviceMesh must be 1-D (the cp dimension), got {group.ndim} "
                f"dimensions {group.mesh_dim_names}; pass e.g. mesh['cp']"
            )
        pg = group.get_group()
    elif isinstance(group, dist.ProcessGroup):
        pg = group
    else:
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got "
            f"{type(group).__name__}"
        )
    rank = dist.get_rank(pg)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given group")
    return CPGroup(pg, rank, dist.get_world_size(pg))


def shard_bounds(length: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s shard of ``length`` tokens in the balanced split (module
    docstring): sizes ⌈T/W⌉ for the first T mod W ranks, ⌊T/W⌋ for the others."""
    length = check_int(length, "length", minimum=0)
    world_size = check_positive_int(world_size, "world_size")
    rank = check_int(rank, "rank", minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
    base, extra = divmod(length, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard(x: torch.Tensor, *, group=None, dim: int = -2) -> torch.Tensor:
    """This rank's shard (``shard_bounds``) of a full-length tensor along ``dim`` (a view)."""
    g = resolve_group(group)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    start, end = shard_bounds(x.shape[dim], g.world_size, g.rank)
    return x.narrow(dim, start, end - start)
