"""One optimizer step on a ``dp × cp`` mesh (``train.mesh``), and the inputs of a micro-batch.

``micro_inputs`` turns a micro-batch of rows (b, T) into what the model takes: the rows as
they are, or with ``pack`` one packed row (1, b·T) and its ``cu_seqlens``
(``batches.pack_rows``); then, on a mesh, this cp rank's contiguous shard of the columns.
``evaluate`` scores the validation batches (plain, DDP or mesh). ``mesh_step`` is
``loop._optimizer_step`` for the mesh: each micro-batch back-propagates
Σ token losses / the global batch's labelled-token count and the gradients are summed over
all ranks, so the step is that of one process on the global batch.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..data.mqar import IGNORE_INDEX
from ..nn.transformer import logits_for_loss
from . import distributed, mesh
from .batches import pack_rows, val_batches
from .config import TrainConfig
from .mesh import Layout

__all__ = ["autocast_for", "evaluate", "micro_inputs", "mesh_step"]


def autocast_for(cfg: TrainConfig, device: torch.device):
    """bf16 autocast when ``cfg.amp == "bf16"``, else a null context."""
    if cfg.amp == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def micro_inputs(x, y, *, separator=None, layout=None) -> tuple:
    """(x, y, model keywords) of a micro-batch (b, T): packed when ``separator`` is not None,
    then this cp rank's columns when ``layout`` has a cp group."""
    kw = {}
    if separator is not None:
        x, y, cu = pack_rows(x, y, separator)
        kw["cu_seqlens"] = cu
    if layout is not None and layout.uses_mesh:
        cols = layout.columns(x.shape[1])
        x, y = x[:, cols], y[:, cols]
        kw["cp_group"] = layout.cp_group
    return x, y, kw


@torch.no_grad()
def evaluate(model, data, cfg, block_size, ctx, layout=None, separator=None):
    """Mean loss and next-token accuracy (on labelled positions) over the validation batches.

    On a mesh (``train.mesh``) the rows are split over dp and the columns over cp; a replica
    without rows runs one row with every label ignored (FSDP2's and the cp ops' collectives
    need every rank's forward). ``separator``: packed rows (``batches.pack_rows``).
    Returns (loss, accuracy)."""
    layout = Layout() if layout is None else layout
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, count
    rows_ctx = distributed.DistContext(layout.dp_rank, layout.dp) if layout.uses_mesh else ctx
    for x, y in val_batches(data, cfg, block_size, rows_ctx):
        if len(x) == 0:
            if not layout.uses_mesh:
                continue
            x, y = next(val_batches(data, cfg, block_size, distributed.DistContext()))
            x, y = x[:1], torch.full_like(y[:1], IGNORE_INDEX)
        x, y, kw = micro_inputs(x, y, separator=separator, layout=layout)
        x, y = x.to(ctx.device), y.to(ctx.device)
        with autocast_for(cfg, ctx.device):
            logits, _ = model(x, **kw)
        logits, y = logits_for_loss(logits).flatten(0, 1), y.flatten()
        mask = y != IGNORE_INDEX
        totals[0] += F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
        totals[1] += (logits.argmax(-1)[mask] == y[mask]).sum()
        totals[2] += mask.sum()
    model.train(was_training)
    if ctx.distributed:
        torch.distributed.all_reduce(totals)
    count = max(float(totals[2]), 1.0)
    return float(totals[0]) / count, float(totals[1]) / count


def mesh_step(run, model: nn.Module, rows: slice, ctx) -> tuple[float, int]:
    """One optimizer step on the mesh (module docstring): this replica's ``rows`` of the next
    global batch in ``grad_accum`` micro-batches, this cp rank's columns of each; gradients
    summed over all ranks (one all-reduce, or FSDP2's reduce-scatter); clipping, AdamW, the
    schedule. Returns (mean loss over the global batch's labelled tokens, its tokens)."""
    cfg, layout = run.cfg, run.layout
    x, y = run.batches.next(cfg.batch_size)
    count = max(int((y != IGNORE_INDEX).sum()), 1)  # the whole global batch, every rank
    tokens = x.numel()
    x, y = x[rows], y[rows]
    micro = (rows.stop - rows.start) // cfg.grad_accum
    loss_sum = torch.zeros((), device=ctx.device, dtype=torch.float64)
    for k in range(cfg.grad_accum):
        if layout.fsdp:  # reduce-scatter once, after the last micro-batch
            model.set_requires_gradient_sync(k == cfg.grad_accum - 1)
        part = slice(k * micro, (k + 1) * micro)
        xm, ym, kw = micro_inputs(x[part], y[part], separator=run.separator, layout=layout)
        xm, ym = xm.to(ctx.device), ym.to(ctx.device)
        with autocast_for(cfg, ctx.device):
            logits, _ = model(xm, **kw)
        token_sum = F.cross_entropy(logits_for_loss(logits).flatten(0, 1), ym.flatten().long(),
                                    ignore_index=IGNORE_INDEX, reduction="sum")  # fmt: skip
        (token_sum / count).backward()
        loss_sum += token_sum.detach().double()
    mesh.reduce_gradients(model, layout)
    if cfg.grad_clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    torch.distributed.all_reduce(loss_sum)
    loss_value = float(loss_sum) / count
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"training loss became {loss_value} at step {run.step + 1}")
    return loss_value, tokens
