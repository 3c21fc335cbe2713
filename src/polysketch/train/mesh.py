"""Training beyond data parallelism: a 2-D ``dp × cp`` DeviceMesh, context parallelism, FSDP2.

``torchrun --nproc-per-node N -m polysketch train --cp C [--fsdp]`` lays the N ranks out as
a DeviceMesh of shape (dp, cp) = (N / C, C), dimension names ``("dp", "cp")``, rank
r = d·C + c (``torch.distributed.device_mesh.init_device_mesh``; gloo on CPU is what the
tests run, NCCL on CUDA is the same calls but UNTESTED). Every rank draws the same global
batch (B, T); data-parallel replica d keeps the rows ``rank_slice(B, dp, d)``, and its cp
rank c the columns ``shard_bounds(T, C, c)`` (``polysketch.distributed``): one contiguous
shard of every row, the model computing across shards (``TransformerLM(cp_group=)``).

The loss is the mean over ALL labelled tokens of the global batch: every rank back-propagates
(Σ of its token losses) / (the global batch's token count, known to every rank without
communication since each draws the whole batch), and the parameter gradients are SUMMED over
the dp × cp ranks:

* without ``--fsdp`` the parameters are replicated; one all-reduce (sum) of all gradients,
  flattened into one buffer, over the world after the backward;
* with ``--fsdp`` (FSDP2, ``torch.distributed.fsdp.fully_shard`` on every block, then on the
  root) the parameters, gradients and optimizer state are sharded over the FLATTENED dp × cp
  ranks (a 1-D mesh of all N ranks: the most memory saved), and FSDP2's reduce-scatter sums
  (its divide factor set to 1, plain SUM collectives: gloo has no PREMUL_SUM).

Checkpoints are the gathered, FULL state (``gather_state``: on rank 0 only, CPU tensors) in
the format of one process (``model.state_dict()``, ``optimizer.state_dict()`` indexed by
parameter order), written by ``train.checkpoint`` (format 2, ``weights_only=True``): a
checkpoint of any layout resumes on any other (``load_state``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .._checks import check_positive_int
from ..distributed import shard_bounds
from .distributed import DistContext, rank_slice

__all__ = ["Layout", "check_cp_model", "make_layout", "shard_model", "reduce_gradients",
           "gather_state", "load_state"]  # fmt: skip


@dataclass(frozen=True)
class Layout:
    """This rank's place in the (dp, cp) mesh and whether parameters are sharded (FSDP2)."""

    dp: int = 1
    cp: int = 1
    fsdp: bool = False
    dp_rank: int = 0
    cp_rank: int = 0
    mesh: object = None  # DeviceMesh ("dp", "cp"), or None for a plain (DDP / 1-process) run
    shard_mesh: object = None  # 1-D DeviceMesh over all ranks: FSDP2's

    @property
    def uses_mesh(self) -> bool:
        """True when this module's path runs (cp > 1 or FSDP); else plain DDP / one process."""
        return self.mesh is not None

    @property
    def cp_group(self):
        """The cp dimension (``mesh["cp"]``) for ``TransformerLM(cp_group=)``, or None."""
        return self.mesh["cp"] if self.mesh is not None and self.cp > 1 else None

    def rows(self, batch_size: int, grad_accum: int = 1) -> slice:
        """This replica's rows of the global batch (``rank_slice`` over dp)."""
        return rank_slice(batch_size, self.dp, self.dp_rank, grad_accum)

    def columns(self, length: int) -> slice:
        """This cp rank's shard of T positions (``polysketch.distributed.shard_bounds``)."""
        return slice(*shard_bounds(length, self.cp, self.cp_rank))


def check_cp_model(model_config, cp: int, *, pack: bool = False) -> None:
    """Refuse (ValueError naming the attention and what is supported) a model whose layers
    cannot run with ``cp`` > 1 (no context-parallel op) or packed (``pack``: mixed attention
    too); before any process group or data."""
    if cp <= 1 and not pack:
        return
    from ..distributed import CPGroup
    from ..nn import TransformerLM
    from ..nn.sharding import SequenceShard, check_core_on_shard

    group = CPGroup(None, 0, cp) if cp > 1 else None
    probe = SequenceShard(group, 0, 0, 0, (0, 0) if pack else None)
    for block in TransformerLM(model_config).blocks:
        for core in block.cores():
            check_core_on_shard(core, probe)


def check_launch(world_size: int, *, cp: int = 1, fsdp: bool = False) -> int:
    """dp, the data-parallel ranks of a launch of ``world_size`` processes; ValueError naming
    ``cp`` when it does not divide them (``--cp 2`` without ``torchrun --nproc-per-node 2``)
    and ``fsdp`` on one process. The one check of a launch's layout: ``train`` and the CLI
    call it before any data or process group."""
    cp = check_positive_int(cp, "cp")
    if world_size % cp:
        raise ValueError(
            f"cp={cp} must divide the number of processes ({world_size}); launch with "
            f"torchrun --nproc-per-node N, N a multiple of {cp} (dp = N / cp)"
        )
    if fsdp and world_size == 1:
        raise ValueError(
            "fsdp: sharding parameters needs several processes: launch with torchrun "
            "--nproc-per-node N (N >= 2)"
        )
    return world_size // cp


def make_layout(ctx: DistContext, *, cp: int = 1, fsdp: bool = False) -> Layout:
    """The ``Layout`` of this rank; builds the meshes (a collective: every rank calls it).
    Raises ValueError as ``check_launch``."""
    dp = check_launch(ctx.world_size, cp=cp, fsdp=fsdp)
    if cp == 1 and not fsdp:
        return Layout(dp=dp, dp_rank=ctx.rank)
    from torch.distributed.device_mesh import init_device_mesh

    device = ctx.device.type
    mesh = init_device_mesh(device, (dp, cp), mesh_dim_names=("dp", "cp"))
    shard_mesh = init_device_mesh(device, (ctx.world_size,), mesh_dim_names=("dpcp",))
    return Layout(dp, cp, bool(fsdp), ctx.rank // cp, ctx.rank % cp, mesh,
                  shard_mesh if fsdp else None)  # fmt: skip


def shard_model(model: nn.Module, layout: Layout) -> nn.Module:
    """FSDP2 over the flattened dp × cp ranks: ``fully_shard`` on every block, then the root
    (embeddings, final norm, tied head); gradients summed (divide factor 1). In place."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=layout.shard_mesh)
    fully_shard(model, mesh=layout.shard_mesh)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):  # an FSDPModule
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def reduce_gradients(model: nn.Module, layout: Layout) -> None:
    """Without FSDP: Σ over all ranks of every parameter's gradient, in one all-reduce of one
    flat buffer (a parameter without a gradient on this rank counts as zeros)."""
    if layout.fsdp or dist.get_world_size() == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                      for p in params])  # fmt: skip
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad = g.view_as(p).clone()


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter, in the order of ``optimizer.state_dict()``'s
    integer ids (its groups in order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def gather_state(model, optimizer, layout: Layout) -> tuple[dict | None, dict | None]:
    """(model state dict, optimizer state dict) in the format of one process, gathered to
    rank 0 as CPU tensors (other ranks: None, None). Every rank must call it (collectives)."""
    if not layout.fsdp:
        if dist.is_initialized() and dist.get_rank() != 0:
            return None, None
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    if dist.get_rank() != 0:
        return None, None
    names = _param_names(model, optimizer)
    state = {i: osd["state"][n] for i, n in enumerate(names) if n in osd["state"]}
    groups, i = [], 0
    for group in optimizer.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = list(range(i, i + len(group["params"])))
        i += len(group["params"])
        groups.append(g)
    full = dict(model.state_dict())  # the keys (a tied head included), then gathered values
    for key in list(full):
        full[key] = msd[key] if key in msd else msd[_tied_source(model, key)]
    return full, {"state": state, "param_groups": groups}


def _tied_source(model: nn.Module, key: str) -> str:
    """The name under which the parameter stored at ``key`` also appears (tied weights)."""
    target = model.get_parameter(key)
    for name, p in model.named_parameters():
        if p is target:
            return name
    raise KeyError(key)


def _check_optimizer_shapes(model, optimizer, optim_state: dict) -> None:
    """Refuse an optimizer state whose per-parameter tensors (Adam's moments) do not have the
    shapes of this optimizer's parameters, taken in order: ``Optimizer.load_state_dict``
    matches them by position and checks no shape, so a checkpoint written with another
    parameter order would train with the wrong moments (or fail later, mid-step)."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [i for group in optim_state.get("param_groups", []) for i in group["params"]]
    if len(saved) != len(params):
        raise ValueError(f"the optimizer state has {len(saved)} parameters, the model "
                         f"{len(params)}")  # fmt: skip
    for index, param in zip(saved, params, strict=True):
        for key, value in optim_state.get("state", {}).get(index, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                raise ValueError(
                    f"the optimizer state's {key!r} of parameter {names.get(id(param), '?')!r} "
                    f"has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}: the "
                    "checkpoint's parameters are in another order or of other sizes"
                )


def load_state(model, optimizer, model_state: dict, optim_state: dict, layout: Layout) -> None:
    """Load a one-process-format state (``gather_state``'s, or any ``polysketch train``
    checkpoint's) into this rank's model and optimizer, sharded when ``layout.fsdp``."""
    if not layout.fsdp:
        model.load_state_dict(model_state)
        _check_optimizer_shapes(model, optimizer, optim_state)
        optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=opts)
    names = _param_names(model, optimizer)
    state = {names[int(i)]: v for i, v in optim_state["state"].items()}
    groups = [{**g, "params": [names[int(i)] for i in g["params"]]}
              for g in optim_state["param_groups"]]  # fmt: skip
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups},
                             options=opts)  # fmt: skip
