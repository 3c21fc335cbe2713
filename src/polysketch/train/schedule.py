"""Learning-rate schedule: linear warmup, then cosine decay to a floor (as nanoGPT).

With peak rate η, floor η_min, W warmup steps and S total steps, optimizer step s (0-based,
the s-th call of ``optimizer.step()``) uses

    η_s = η · (s + 1) / (W + 1)                                   for s < W,
    η_s = η_min + ½ (1 + cos(π (s − W) / max(1, S − W))) (η − η_min)   for W ≤ s ≤ S,
    η_s = η_min                                                   for s > S.

``warmup_cosine`` wraps this in a ``torch.optim.lr_scheduler.LambdaLR`` whose multiplier is a
picklable callable object, so the whole schedule (its step counter and its parameters) is in
``scheduler.state_dict()`` and a checkpoint resumes it exactly.
"""

from __future__ import annotations

import math

import torch

from .._checks import check_float, check_int
from .config import TrainConfig

__all__ = ["WarmupCosine", "warmup_cosine", "learning_rate", "default_warmup"]


def default_warmup(steps: int) -> int:
    """W when a run does not set it (``polysketch train``'s ``--warmup-steps`` default): 10% of
    the run, at most ``TrainConfig``'s 100 (so runs of 1000 steps and more keep it; a 30-step
    run warms up for 3). Experiments that say they train as the CLI does call this."""
    steps = check_int(steps, "steps", minimum=0)
    return min(TrainConfig.warmup_steps, steps // 10)


def learning_rate(
    step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int
) -> float:
    """η_s of the module docstring for optimizer step ``step`` (0-based)."""
    step = check_int(step, "step", minimum=0)
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if step > total_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio))) * (lr - min_lr)


class WarmupCosine:
    """The multiplier η_s / η of ``learning_rate`` (a callable object, so LambdaLR saves it)."""

    def __init__(self, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int):
        self.lr = check_float(lr, "lr", minimum=0.0, strict_minimum=True)
        self.min_lr = check_float(min_lr, "min_lr", minimum=0.0)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr must be <= lr, got min_lr={min_lr} > lr={lr}")
        self.warmup_steps = check_int(warmup_steps, "warmup_steps", minimum=0)
        self.total_steps = check_int(total_steps, "total_steps", minimum=1)

    def __call__(self, step: int) -> float:
        return (
            learning_rate(
                step,
                lr=self.lr,
                min_lr=self.min_lr,
                warmup_steps=self.warmup_steps,
                total_steps=self.total_steps,
            )
            / self.lr
        )


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    min_lr: float,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR giving every param group η_s of the module docstring, η = its initial lr.

    All groups must share one initial lr (the peak η). Call ``scheduler.step()`` after each
    ``optimizer.step()``.
    """
    lrs = {group.get("initial_lr", group["lr"]) for group in optimizer.param_groups}
    if len(lrs) != 1:
        raise ValueError(f"optimizer param groups must share one lr, got {sorted(lrs)}")
    factor = WarmupCosine(
        lr=lrs.pop(), min_lr=min_lr, warmup_steps=warmup_steps, total_steps=total_steps
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
