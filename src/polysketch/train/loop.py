"""The training loop: AdamW, warmup + cosine schedule, accumulation, bf16, DDP, exact resume.

``train(model_config, train_config, data)`` trains a ``polysketch.nn.TransformerLM`` on

* a ``Corpus`` (``polysketch.data.load_corpus``): each step samples B random contiguous blocks
  of ``block_size + 1`` tokens from the training stream, x = block[:-1], y = block[1:], with a
  ``torch.Generator`` whose state *is* the data position (``CorpusBatches``);
* an ``MQARData`` set: a fixed training set visited in a seeded random order, one permutation
  per epoch (``MQARBatches``), plus a validation set scored by loss and recall accuracy.

The samplers live in ``batches``; they are re-exported here. ``pack=True`` trains on packed
rows (``batches.pack_rows``); ``cp`` > 1 or ``fsdp`` trains on a ``dp × cp`` DeviceMesh
(``train.mesh``; the step and the evaluation in ``train.steps``) instead of DDP.

Per optimizer step: the global batch (``batch_size`` rows) is drawn, this rank keeps its slice
(``distributed.rank_slice``), which is split into ``grad_accum`` micro-batches; each micro
loss is divided by ``grad_accum`` and back-propagated (DDP gradient sync on the last only);
gradients are clipped to ``grad_clip`` in global norm; AdamW steps with decay on matrices only
(no decay on norms, biases, embeddings, as nanoGPT); the LambdaLR schedule steps.

Checkpoints (``out_dir/ckpt.pt``, atomic and checksummed, see ``train.checkpoint``) hold the
model (the feature maps' random buffers included), optimizer, scheduler, data-sampler state,
Python/NumPy/torch RNG states, the step, both configs and the history, so ``resume=True``
continues bit-for-bit on CPU: N steps, save, resume, N steps gives the same losses and
parameters as 2N straight steps. Metrics go to ``out_dir/metrics.csv`` and
``out_dir/metrics.jsonl`` (rank 0 only). At the start, rank 0 removes the temporary
``.ckpt.pt.*.tmp`` files a crashed save left in ``out_dir``. ``train`` writes into
``out_dir`` as told: refusing to replace an earlier run is the caller's decision (the
``polysketch train`` command refuses a non-empty ``--out`` without ``--resume`` or
``--overwrite``). The metric files are created at the first completed step, so a run that
fails before it leaves ``out_dir`` as it found it.

Before the first step ``log`` (if given) receives a header: parameters, tokens per step,
steps and schedule, device and dtype. A warmup as long as the run (``warmup_steps >=
steps``: the rate never reaches ``lr``) is a ``WarmupWarning``. Running out of memory
(``is_out_of_memory``: torch's ``OutOfMemoryError``, the CPU allocator's RuntimeError,
``MemoryError``) is re-raised as ``TrainingOutOfMemoryError`` naming the batch size, block
size and micro-batches.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import json
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .._auxiliary import auxiliary_loss_scale
from .._checks import check_positive_int
from ..data.corpus import Corpus
from ..nn import TransformerConfig, TransformerLM
from ..nn.transformer import EXECUTION_FIELDS
from . import distributed, mesh
from .batches import (
    CorpusBatches,
    MQARBatches,
    MQARData,
    make_batches,
    pack_separator,
)
from .checkpoint import (
    CheckpointError,
    load_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
    set_rng_state,
    stored_model_config,
    stored_spec,
)
from .config import TrainConfig
from .mesh import Layout
from .schedule import learning_rate, warmup_cosine
from .steps import autocast_for as _autocast
from .steps import evaluate, mesh_step, micro_inputs

__all__ = [
    "TrainConfig",
    "TrainingOutOfMemoryError",
    "WarmupWarning",
    "MQARData",
    "CorpusBatches",
    "MQARBatches",
    "param_groups",
    "train",
    "CHECKPOINT_NAME",
    "METRIC_FIELDS",
    "is_out_of_memory",
    "warmup_warning",
]

CHECKPOINT_NAME = "ckpt.pt"
METRIC_FIELDS = ("step", "split", "loss", "accuracy", "lr", "tokens", "tokens_per_s", "elapsed_s")


class WarmupWarning(UserWarning):
    """The warmup lasts the whole run: the learning rate never reaches its peak."""


class TrainingOutOfMemoryError(MemoryError):
    """Training ran out of memory; the message names the batch and block size."""


def warmup_warning(cfg: TrainConfig) -> str | None:
    """Why ``cfg``'s schedule never leaves warmup (``warmup_steps >= steps``), or None."""
    if cfg.warmup_steps < cfg.steps:
        return None
    last = learning_rate(cfg.steps - 1, lr=cfg.lr, min_lr=cfg.min_lr,
                         warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)  # fmt: skip
    return (
        f"warmup_steps={cfg.warmup_steps} >= steps={cfg.steps}: the learning rate never leaves "
        f"warmup and its last step uses {last:.3g}, not lr={cfg.lr:g}"
    )


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation failure: torch's ``OutOfMemoryError`` (CUDA, XPU),
    the CPU allocator's or MPS's RuntimeError, or Python's ``MemoryError``."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text
    )


def _out_of_memory(err: BaseException, cfg: TrainConfig, block_size: int, device, step) -> str:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    where = f"at step {step + 1}" if step is not None else "building the model"
    micro = ""
    if cfg.grad_accum > 1:
        micro = f" in {cfg.grad_accum} micro-batches of {cfg.batch_size // cfg.grad_accum}"
    return (
        f"out of memory {where} on {device}: batch size {cfg.batch_size:,} x block size "
        f"{block_size:,} = {cfg.batch_size * block_size:,} tokens per step{micro}; lower the "
        f"batch size or the block size, or raise grad_accum (same batch, smaller "
        f"micro-batches) ({first})"
    )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on weight matrices; none on biases, norms and embeddings."""
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.replace("__", ".").split(".")
        plain = (
            p.dim() < 2
            or id(p) in embedding
            or parts[-1] == "bias"
            or any("norm" in s or s.startswith("ln") for s in parts[:-1])
        )
        (no_decay if plain else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class _MetricFiles:
    """metrics.csv + metrics.jsonl in ``out_dir`` (rewritten from history on resume), created
    at the first row or ``ensure()``: nothing is written before a step completes."""

    def __init__(self, out_dir: Path | None, rows: list[dict]):
        self.paths = None
        self.out_dir = out_dir
        for row in rows:
            self.write(row)

    def ensure(self) -> None:
        """Create both files (headers only) unless they exist already."""
        if self.paths is not None or self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.paths = (self.out_dir / "metrics.csv", self.out_dir / "metrics.jsonl")
        with self._writing(self.paths[0]), open(self.paths[0], "w", newline="") as f:
            csv.DictWriter(f, METRIC_FIELDS).writeheader()
        with self._writing(self.paths[1]):
            self.paths[1].write_text("")

    @staticmethod
    @contextlib.contextmanager
    def _writing(path: Path):
        """Re-raise a failed write (ENOSPC has no file name) as an OSError naming ``path``."""
        try:
            yield
        except OSError as err:
            reason = err.strerror or str(err)
            raise OSError(err.errno, f"cannot write {path}: {reason}") from err

    def write(self, row: dict) -> None:
        self.ensure()
        if self.paths is None:
            return
        with self._writing(self.paths[0]), open(self.paths[0], "a", newline="") as f:
            csv.DictWriter(f, METRIC_FIELDS).writerow({k: row.get(k, "") for k in METRIC_FIELDS})
        with self._writing(self.paths[1]), open(self.paths[1], "a") as f:
            f.write(json.dumps(row) + "\n")


def train(
    model_config: TransformerConfig,
    train_config: TrainConfig,
    data: Corpus | MQARData,
    *,
    resume: bool = False,
    progress: bool = True,
    metadata: dict | None = None,
    stop_after: int | None = None,
    init_weights: dict | None = None,
    log: Callable[[str], object] | None = None,
) -> dict:
    """Train a ``TransformerLM(model_config)``; see the module docstring.

    Args:
        model_config: a ``polysketch.nn.TransformerConfig`` (its ``vocab_size`` must cover
            the data's).
        train_config: a ``TrainConfig``; ``steps`` is the total step count (a resumed run
            continues up to it).
        data: a ``Corpus`` or ``MQARData``.
        resume: continue from ``out_dir/ckpt.pt`` (same model config required; a damaged,
            refused or mismatched checkpoint raises ``CheckpointError`` naming the file).
        progress: show a tqdm bar (rank 0 only).
        metadata: extra information stored in every checkpoint (e.g. the data source): plain
            values only (dicts, lists, str, numbers, bool, None, tensors).
        stop_after: stop (with a checkpoint) after this step, as a time-boxed job would; the
            schedule still spans ``steps`` and ``resume=True`` continues the same run.
        init_weights: a ``TransformerLM`` state dict of ``model_config``'s model (e.g. an
            earlier stage's ``history["model"].state_dict()``, as a curriculum trains) that
            replaces the fresh weights before the first step; the optimizer, schedule and
            data sampler start fresh. Not with ``resume`` (the checkpoint holds the weights).
        log: receives the header lines (``header_lines``) before the first step, on rank 0.

    Returns:
        history ``{"train": [rows per step], "val": [rows per evaluation], "model": the
        trained (unwrapped) model}``; train rows hold ``step`` (1-based), ``loss`` (mean
        over the global batch), ``lr``, ``tokens``, ``tokens_per_s``, ``elapsed_s``; val rows
        ``step``, ``loss``, ``accuracy``.

    The model's weights come from ``model_config.seed``; torch's global RNG (dropout) is
    seeded with ``train_config.seed`` at the start (and restored from the checkpoint on
    resume).

    Raises ``TrainingOutOfMemoryError`` (naming the batch and block size) when an allocation
    fails; warns (``WarmupWarning``) when ``warmup_steps >= steps``.
    """
    cfg = _checked(model_config, train_config, data, stop_after)
    if init_weights is not None and resume:
        raise ValueError("init_weights and resume=True exclude each other: a resumed run "
                         "continues from its checkpoint's weights")  # fmt: skip
    if init_weights is not None and not isinstance(init_weights, dict):
        raise TypeError(f"init_weights must be a state dict, got {type(init_weights).__name__}")
    out_dir = Path(cfg.out_dir) if cfg.out_dir is not None else None
    ckpt_path = out_dir / CHECKPOINT_NAME if out_dir is not None else None
    if resume and (ckpt_path is None or not ckpt_path.is_file()):
        raise FileNotFoundError(
            f"resume needs a checkpoint at {ckpt_path or 'out_dir/' + CHECKPOINT_NAME}"
        )
    block_size = cfg.block_size or model_config.block_size
    note = warmup_warning(cfg)
    if note is not None:
        warnings.warn(note, WarmupWarning, stacklevel=2)

    ctx = distributed.setup(cfg.device)
    finished = False
    model = run = None
    try:
        if ckpt_path is not None and ctx.is_main:
            remove_stale_temporaries(ckpt_path)  # a crashed save's leftovers
        layout = mesh.make_layout(ctx, cp=cfg.cp, fsdp=cfg.fsdp)
        state = None  # the checkpoint's RNG states are restored by run.restore
        if resume:
            state = load_checkpoint(ckpt_path, map_location=ctx.device, restore_rng=False)
        run = _Run.start(model_config, cfg, data, block_size, ctx.device, metadata, layout,
                         init_weights, stored_spec(state, ckpt_path))  # fmt: skip
        if resume:
            run.restore(state, ckpt_path)
        model = run.model
        if log is not None and ctx.is_main:
            for line in header_lines(run, ctx, block_size, layout):
                log(line)
        if ctx.distributed and not layout.uses_mesh:
            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        if cfg.compile is not None:  # after DDP, as torch recommends; state_dict from run.model
            model = torch.compile(model, backend=cfg.compile)
        rows = layout.rows(cfg.batch_size, cfg.grad_accum)
        main = ctx.is_main
        history = run.history
        files = _MetricFiles(
            out_dir if main else None, _logged(history, cfg.log_interval, cfg.steps)
        )
        bar = tqdm(
            total=cfg.steps, initial=run.step, disable=not (progress and main), dynamic_ncols=True
        )
        elapsed = history["train"][-1]["elapsed_s"] if history["train"] else 0.0
        tokens = history["train"][-1]["tokens"] if history["train"] else 0
        model.train()
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        while run.step < end:
            if cfg.warm_start_steps:  # steps 1..N exact; the mode follows the step on resume
                run.model.set_exact_attention(run.step < cfg.warm_start_steps)
            t0 = time.perf_counter()
            lr = run.optimizer.param_groups[0]["lr"]
            step_fn = mesh_step if layout.uses_mesh else _optimizer_step
            loss_value, batch_tokens = step_fn(run, model, rows, ctx)
            step = run.step = run.step + 1
            dt = time.perf_counter() - t0
            elapsed += dt
            tokens += batch_tokens
            row = {
                "step": step,
                "split": "train",
                "loss": loss_value,
                "lr": lr,
                "tokens": tokens,
                "tokens_per_s": batch_tokens / max(dt, 1e-9),
                "elapsed_s": elapsed,
            }
            history["train"].append(row)
            files.ensure()
            if step % cfg.log_interval == 0 or step == cfg.steps:
                files.write(row)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
            if step == cfg.steps or (cfg.eval_interval and step % cfg.eval_interval == 0):
                if cfg.warm_start_steps:
                    run.model.set_exact_attention(step < cfg.warm_start_steps)
                val_loss, acc = evaluate(
                    run.model, data, cfg, block_size, ctx, layout, run.separator
                )
                vrow = {"step": step, "split": "val", "loss": val_loss, "accuracy": acc}
                history["val"].append(vrow)
                files.write(vrow)
                if progress and main:
                    bar.write(f"step {step}: val loss {val_loss:.4f}, accuracy {acc:.4f}")
            if step == end or (cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0):
                if ckpt_path is not None:
                    state = run.checkpoint_state()  # gathered on rank 0 (a collective)
                    if main:
                        save_checkpoint(ckpt_path, state)
        bar.close()
        history["model"] = run.model
        finished = True
        return history
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        step = run.step if run is not None else None
        message = _out_of_memory(err, cfg, block_size, ctx.device, step)
        raise TrainingOutOfMemoryError(message) from None
    finally:
        if ctx.distributed:  # the DDP reducer holds the group: free it now, not at interpreter exit
            model = None
            gc.collect()
        distributed.teardown(ctx, finished=finished)


def header_lines(run: _Run, ctx, block_size: int, layout: Layout) -> list[str]:
    """What a run is about to do: the model and its parameters, tokens per step, steps and
    schedule, device and dtype (``train``'s ``log`` receives these lines)."""
    cfg, mc = run.cfg, run.model_config
    params = run.model.num_parameters()
    tokens = cfg.batch_size * block_size
    micro = ""
    if cfg.grad_accum > 1:
        micro = f" ({cfg.grad_accum} micro-batches of {cfg.batch_size // cfg.grad_accum})"
    procs = ""
    if ctx.world_size > 1:
        procs = f", {ctx.world_size} processes (dp {layout.dp} x cp {layout.cp})"
    dtype = str(next(run.model.parameters()).dtype).removeprefix("torch.")
    amp = ", bf16 autocast" if cfg.amp == "bf16" else ""
    start = f"resuming after step {run.step} of " if run.step else ""
    return [
        f"model: {params:,} parameters (attention={mc.attention}, {mc.n_layer} layers, "
        f"{mc.n_head} heads, n_embd {mc.n_embd})",
        f"batch: {cfg.batch_size} sequences x {block_size} tokens = {tokens:,} tokens per "
        f"step{micro}",
        f"schedule: {start}{cfg.steps} steps ({cfg.steps * tokens:,} tokens), lr {cfg.lr:g}, "
        f"warmup {cfg.warmup_steps}, cosine to {cfg.min_lr:g}",
        f"device {ctx.device}, {dtype}{amp}{procs}",
    ]


def check_launch(model_config: TransformerConfig, cfg: TrainConfig) -> None:
    """Refuse (ValueError) a run this launch cannot split: a model without a context-parallel
    op for ``cfg.cp`` / ``cfg.pack``, ``cp`` not dividing the processes, FSDP on one process,
    a batch that does not split over the data-parallel ranks and micro-batches. Before any
    data or process group (``train`` and ``polysketch train`` call it)."""
    mesh.check_cp_model(model_config, cfg.cp, pack=cfg.pack)
    dp = mesh.check_launch(distributed.env_world_size(), cp=cfg.cp, fsdp=cfg.fsdp)
    distributed.rank_slice(cfg.batch_size, max(dp, 1), 0, cfg.grad_accum)


def _checked(model_config, train_config, data, stop_after) -> TrainConfig:
    """``train``'s arguments checked (TypeError/ValueError naming the bad one); the config."""
    if not isinstance(model_config, TransformerConfig):
        raise TypeError(f"model_config must be a TransformerConfig, got {type(model_config)}")
    if not isinstance(train_config, TrainConfig):
        raise TypeError(f"train_config must be a TrainConfig, got {type(train_config)}")
    cfg = train_config.validate()
    model_config.validate()
    if not isinstance(data, (Corpus, MQARData)):
        raise TypeError(f"data must be a Corpus or MQARData, got {type(data).__name__}")
    if data.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"vocab_size of the model ({model_config.vocab_size}) is smaller than the data's "
            f"({data.vocab_size})"
        )
    check_launch(model_config, cfg)  # before any work
    if cfg.pack:
        pack_separator(data)
    if stop_after is not None:
        check_positive_int(stop_after, "stop_after")
    return cfg


@dataclass
class _Run:
    """What a run carries from step to step and into its checkpoint: the (unwrapped) model,
    optimizer, schedule, data sampler, history and the number of steps done."""

    model_config: TransformerConfig
    cfg: TrainConfig
    model: TransformerLM
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    batches: CorpusBatches | MQARBatches
    metadata: dict
    layout: Layout = field(default_factory=Layout)
    separator: list[int] | None = None  # pack: where documents start (batches.pack_rows)
    history: dict = field(default_factory=lambda: {"train": [], "val": []})
    step: int = 0

    @classmethod
    def start(cls, model_config, cfg, data, block_size, device, metadata, layout=None,
              init_weights=None, model_spec=None) -> _Run:  # fmt: skip
        """A fresh run: torch's global RNG seeded with ``cfg.seed``, then the model (weights
        from ``model_config.seed``, or ``init_weights``; its ``ModelSpec`` ``model_spec``
        when given, a resumed checkpoint's; sharded by FSDP2 when ``layout.fsdp``), AdamW,
        the schedule and the data sampler."""
        layout = Layout() if layout is None else layout
        torch.manual_seed(cfg.seed)
        model = TransformerLM(model_config, model_spec)
        if init_weights is not None:
            try:
                model.load_state_dict(init_weights)
            except RuntimeError as err:
                first = str(err).strip().splitlines()[0]
                raise ValueError(f"init_weights do not fit model_config's model: {first}") from None
        model = model.to(device)
        if layout.fsdp:
            mesh.shard_model(model, layout)
        optimizer = torch.optim.AdamW(
            param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas
        )
        scheduler = warmup_cosine(
            optimizer, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps, min_lr=cfg.min_lr
        )
        batches = make_batches(data, block_size, cfg.seed)
        separator = pack_separator(data) if cfg.pack else None
        return cls(model_config, cfg, model, optimizer, scheduler, batches, metadata or {},
                   layout, separator)  # fmt: skip

    def restore(self, state: dict, ckpt_path: Path) -> None:
        """Continue the run saved at ``ckpt_path`` (``state``, loaded with its RNG states
        restored); the schedule is stretched to ``cfg.steps`` when the run is extended.
        ``CheckpointError`` when the checkpoint does not fit this run."""
        if "rng" in state:
            set_rng_state(state["rng"])

        def arithmetic(config) -> dict:  # execution choices (recompute) may change on resume
            stored = stored_model_config(config)
            return {k: v for k, v in stored.items() if k not in EXECUTION_FIELDS}

        saved = arithmetic(state.get("model_config", {}))
        if saved != arithmetic(self.model_config):  # a field added since: its default
            raise CheckpointError(
                f"checkpoint {ckpt_path}: model_config differs from the checkpoint's "
                "model_config (resume takes the checkpoint's)"
            )
        optimizer, scheduler = self.optimizer, self.scheduler
        try:
            mesh.load_state(self.model, optimizer, state["model"], state["optimizer"],
                            self.layout)  # fmt: skip
            scheduler.load_state_dict(state["scheduler"])
            scheduler.lr_lambdas[0].total_steps = self.cfg.steps  # the run may be extended
            for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
                group["lr"] = base * scheduler.lr_lambdas[0](scheduler.last_epoch)
            self.batches.load_state_dict(state["data"])
            self.history, self.step = state["history"], int(state["step"])
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            detail = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
            raise CheckpointError(
                f"checkpoint {ckpt_path} does not fit this run ({type(err).__name__}: {detail})"
            ) from None

    def checkpoint_state(self) -> dict:
        """The state ``save_checkpoint`` writes (``restore`` reads it back): the gathered,
        one-process format (``train.mesh.gather_state``; every rank must call this, rank 0
        gets the state, the others None)."""
        model_state, optim_state = mesh.gather_state(self.model, self.optimizer, self.layout)
        if model_state is None:
            return None
        return {
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": self.scheduler.state_dict(),
            "data": self.batches.state_dict(),
            "step": self.step,
            "model_config": stored_model_config(self.model_config),
            "model_spec": self.model.spec.to_dict(),
            "train_config": asdict(self.cfg),
            "history": self.history,
            "metadata": self.metadata,
        }


def _optimizer_step(run: _Run, model: nn.Module, rows: slice, ctx) -> tuple[float, int]:
    """One optimizer step of ``model`` (``run.model``, maybe wrapped in DDP / compiled) on
    the next global batch: this rank's ``rows`` in ``grad_accum`` micro-batches, the mean
    loss back-propagated (DDP syncs on the last micro-batch), clipping, AdamW, schedule.
    Returns (mean loss over the global batch, tokens of the global batch)."""
    cfg = run.cfg
    x, y = run.batches.next(cfg.batch_size)
    x, y = x[rows].to(ctx.device), y[rows].to(ctx.device)
    micro = (rows.stop - rows.start) // cfg.grad_accum
    loss_sum = torch.zeros((), device=ctx.device, dtype=torch.float64)
    for k in range(cfg.grad_accum):
        sync = k == cfg.grad_accum - 1 or not ctx.distributed
        part = slice(k * micro, (k + 1) * micro)
        xm, ym, kw = micro_inputs(x[part], y[part], separator=run.separator)
        with contextlib.nullcontext() if sync else model.no_sync():
            with _autocast(cfg, ctx.device), auxiliary_loss_scale(1 / cfg.grad_accum):
                _, loss = model(xm, ym, **kw)  # auxiliary losses averaged as the loss is
            (loss / cfg.grad_accum).backward()
        loss_sum += loss.detach().double()
    if cfg.grad_clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    loss_value = float(distributed.mean_over_ranks(loss_sum / cfg.grad_accum, ctx))
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"training loss became {loss_value} at step {run.step + 1}")
    return loss_value, x.numel() * ctx.world_size


def _logged(history: dict, log_interval: int, total_steps: int) -> list[dict]:
    """The rows a run writes to the metric files, in order (to rewrite them on resume)."""
    val = {r["step"]: r for r in history["val"]}
    rows = []
    for r in history["train"]:
        if r["step"] % log_interval == 0 or r["step"] == total_steps:
            rows.append(r)
        if r["step"] in val:
            rows.append(val[r["step"]])
    return rows
