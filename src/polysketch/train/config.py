"""``TrainConfig``: the optimization settings of ``polysketch.train.train``.

Its own module so that the loop (``train.loop``) and the batch samplers (``train.batches``),
which both read it, import it from below instead of from each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import check_choice, check_float, check_int, check_positive_int
from .._fields import documented

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

    steps: int = documented(1000, help="optimizer steps of the run (a resumed run continues "
                            "up to it)")  # fmt: skip
    batch_size: int = documented(16, help="global batch: sequences per step, over all ranks "
                                 "and micro-batches")  # fmt: skip
    block_size: int | None = documented(None, help="tokens per sequence (default: the model's)")
    lr: float = documented(1e-3, help="peak learning rate (AdamW)")
    min_lr: float = documented(1e-4, help="learning rate at the end of the cosine decay")
    warmup_steps: int = documented(100, help="linear warmup steps")
    weight_decay: float = documented(0.1, help="AdamW weight decay (matrices only)")
    betas: tuple[float, float] = documented((0.9, 0.95), help="AdamW betas")
    grad_clip: float = documented(1.0, help="gradient norm clipping; 0 = off")
    grad_accum: int = documented(1, help="micro-batches per step")
    eval_interval: int | None = documented(250, help="steps between evaluations (None: the end)")
    eval_batches: int = documented(8, help="batches per evaluation")
    log_interval: int = documented(10, help="steps between metric rows")
    amp: str | None = documented(None, help="bf16: forward passes under torch.autocast(bf16)")
    seed: int = documented(0, help="seed of the data order and of dropout")
    out_dir: str | None = documented(None, help="folder of the metrics and the checkpoint")
    checkpoint_interval: int | None = documented(None, help="steps between checkpoints "
                                                 "(None: at the end)")  # fmt: skip
    device: str | None = documented(None, help="cpu, cuda, ... (default: cuda if available)")
    compile: str | None = documented(None, help="torch.compile backend of the model "
                                     "(inductor, aot_eager; None: eager)")  # fmt: skip
    warm_start_steps: int = documented(0, help="train the first N steps with exact polynomial "
                                       "attention, then the sketch (nn.warm_start)")  # fmt: skip
    cp: int = documented(1, help="context parallelism: each sequence split over C processes "
                         "(torchrun; dp = processes / C)")  # fmt: skip
    fsdp: bool = documented(False, help="FSDP2: parameters, gradients and optimizer state "
                            "sharded over all processes")  # fmt: skip
    pack: bool = documented(False, help="pack each micro-batch into one row of documents, each "
                            "computed alone (linear attentions only)")  # fmt: skip

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
