"""Data-parallel training under ``torchrun``: process group, ranks, batch slicing.

``torchrun --nproc_per_node=N -m polysketch train ...`` starts N processes with ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in their environment.
``setup`` joins the process group (``gloo`` on CPU, ``nccl`` on CUDA, one GPU per local rank)
and the training loop wraps the model in ``DistributedDataParallel``.

Every rank draws the same global batch of B sequences from the same seeded data generator
and keeps rows ``[r·B/N, (r+1)·B/N)`` (``rank_slice``). DDP averages the gradients over ranks,
so with equal token counts per rank one data-parallel step is the step of a single process
on the whole global batch, and the data position (the generator state) is identical on every
rank — which is why only rank 0 writes checkpoints and logs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._checks import check_int, check_positive_int

__all__ = ["DistContext", "env_world_size", "setup", "teardown", "rank_slice", "mean_over_ranks"]


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: ``rank`` of ``world_size``, its ``device``.

    ``owns_group`` says whether ``setup`` created the process group (and ``teardown`` should
    destroy it).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    """``WORLD_SIZE`` from the environment (1 when not launched by torchrun)."""
    return check_positive_int(int(os.environ.get("WORLD_SIZE", "1")), "WORLD_SIZE")


def _default_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def setup(device: str | torch.device | None = None) -> DistContext:
    """Join the torchrun process group if ``WORLD_SIZE`` > 1; pick this rank's device.

    ``device=None`` chooses ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU. A bare
    ``"cuda"`` becomes ``cuda:LOCAL_RANK`` under torchrun.
    """
    world_size = env_world_size()
    rank = check_int(int(os.environ.get("RANK", "0")), "RANK", minimum=0)
    local_rank = check_int(int(os.environ.get("LOCAL_RANK", "0")), "LOCAL_RANK", minimum=0)
    if device is None:
        dev = _default_device(local_rank)
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size == 1:
        return DistContext(device=dev)
    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    return DistContext(rank, world_size, local_rank, dev, owns)


def teardown(ctx: DistContext, *, finished: bool = False) -> None:
    """Destroy the process group if ``setup`` created it.

    ``finished=True`` (every rank got to the end) first waits at a barrier, so that no rank tears
    its gloo/NCCL connections down while another is still saving or reducing: a rank leaving
    early could abort (SIGABRT, "terminate called without an active exception") in the gloo
    threads at exit. After an exception there is no barrier, since the other ranks may never
    reach it.
    """
    if ctx.owns_group and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def rank_slice(batch_size: int, world_size: int, rank: int, grad_accum: int = 1) -> slice:
    """Rows of the global batch that ``rank`` trains on: ``[r·B/N, (r+1)·B/N)``.

    Raises ValueError naming ``batch_size`` unless B is divisible by N · grad_accum (each
    rank's share is further split into ``grad_accum`` equal micro-batches).
    """
    batch_size = check_positive_int(batch_size, "batch_size")
    world_size = check_positive_int(world_size, "world_size")
    grad_accum = check_positive_int(grad_accum, "grad_accum")
    if batch_size % (world_size * grad_accum):
        raise ValueError(
            f"batch_size ({batch_size}) must be divisible by world_size × grad_accum "
            f"({world_size} × {grad_accum})"
        )
    share = batch_size // world_size
    return slice(rank * share, (rank + 1) * share)


def mean_over_ranks(value: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """The mean of a scalar tensor over all ranks (itself when not distributed)."""
    if not ctx.distributed:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / ctx.world_size
