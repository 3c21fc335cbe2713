"""``TrainConfig``: the optimization settings of ``polysketch.train.train``.

Its own module so that the loop (``train.loop``) and the batch samplers (``train.batches``),
which both read it, import it from below instead of from each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import check_choice, check_float, check_int, check_positive_int

__all__ = ["TrainConfig"]


@dataclass
class TrainConfig:
    """Optimization settings. ``batch_size`` is the global batch (sequences per step, over all
    ranks and micro-batches); ``block_size=None`` takes the model's. ``grad_clip=0`` disables
    clipping; ``eval_interval=None`` and ``checkpoint_interval=None`` mean only at the end;
    ``amp="bf16"`` runs forward passes under ``torch.autocast(dtype=bfloat16)``.
    ``compile`` names a ``torch.compile`` backend for the model (``"inductor"``, the default
    of ``polysketch train --compile``; ``"aot_eager"`` compiles without code generation);
    ``None`` runs eagerly. Checkpoints hold the uncompiled model's state either way.
    ``cp`` > 1 (context parallelism) and ``fsdp`` (FSDP2) run under torchrun on a
    ``dp × cp`` mesh (``polysketch.train.mesh``)."""

    steps: int = 1000
    batch_size: int = 16
    block_size: int | None = None
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    grad_accum: int = 1
    eval_interval: int | None = 250
    eval_batches: int = 8
    log_interval: int = 10
    amp: str | None = None
    seed: int = 0
    out_dir: str | None = None
    checkpoint_interval: int | None = None
    device: str | None = None
    compile: str | None = None
    warm_start_steps: int = 0  # exact polynomial attention for the first N steps (nn.warm_start)
    cp: int = 1  # context-parallel ranks per sequence (train.mesh; dp = processes / cp)
    fsdp: bool = False  # FSDP2: parameters sharded over all ranks (train.mesh)
    pack: bool = False  # rows packed into one with document boundaries (batches.pack_rows)

    def validate(self) -> TrainConfig:
        """Raise ValueError/TypeError naming the bad field; return self."""
        for name in ("steps", "batch_size", "grad_accum", "eval_batches", "log_interval"):
            check_positive_int(getattr(self, name), name)
        for name in ("block_size", "eval_interval", "checkpoint_interval"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)
        check_float(self.lr, "lr", minimum=0.0, strict_minimum=True)
        check_float(self.min_lr, "min_lr", minimum=0.0, maximum=self.lr)
        check_int(self.warmup_steps, "warmup_steps", minimum=0)
        check_float(self.weight_decay, "weight_decay", minimum=0.0)
        check_float(self.grad_clip, "grad_clip", minimum=0.0)
        if len(tuple(self.betas)) != 2:
            raise ValueError(f"betas must be a pair, got {self.betas!r}")
        for b in self.betas:
            check_float(b, "betas", minimum=0.0, maximum=1.0)
        if self.amp is not None:
            check_choice(self.amp, "amp", ["bf16"])
        check_int(self.seed, "seed", minimum=0)
        if self.compile is not None:
            check_choice(self.compile, "compile", torch._dynamo.list_backends(exclude_tags=()))
        check_int(self.warm_start_steps, "warm_start_steps", minimum=0)
        check_positive_int(self.cp, "cp")
        for name in ("fsdp", "pack"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.compile is not None and (self.fsdp or self.cp > 1):
            raise ValueError(
                "compile is not supported with fsdp or cp > 1 (untested: the collectives of "
                "FSDP2 and of context parallelism inside a compiled graph); drop --compile"
            )
        if self.warm_start_steps and (self.cp > 1 or self.pack):
            raise ValueError(
                "warm_start_steps: the warm start's exact polynomial attention has no "
                "context-parallel or packed form; use warm_start_steps=0 with cp > 1 or pack"
            )
        self.betas = tuple(float(b) for b in self.betas)
        return self
