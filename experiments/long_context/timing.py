"""Seconds per training step of a model, to plan the CPU hours of a table.

``time_steps(config, batch_size=B, seq_len=T)`` builds ``TransformerLM(config)`` and times
what ``polysketch.train.train`` does per optimizer step — forward with targets, backward,
gradient clipping to norm 1, AdamW step (decay on matrices, ``train.param_groups``) — on
random tokens, after ``warmup`` untimed steps. It reports the median over ``steps`` timed
steps (wall seconds; the CPU is shared, so the median resists other jobs' bursts) and the
tokens per second it implies. No data pipeline, evaluation or checkpointing is timed.
"""

from __future__ import annotations

import statistics
import time

import torch

from polysketch.nn import TransformerConfig, TransformerLM
from polysketch.train import param_groups

__all__ = ["time_steps"]


def time_steps(
    config: TransformerConfig,
    *,
    batch_size: int,
    seq_len: int,
    steps: int = 3,
    warmup: int = 1,
    lr: float = 1e-3,
    seed: int = 0,
) -> dict:
    """Median seconds per training step (module docstring): {"s_per_step", "tokens_per_s",
    "steps", "params", "state_size"}."""
    if steps < 1 or warmup < 0 or batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"steps, batch_size and seq_len must be >= 1 and warmup >= 0, got steps={steps}, "
            f"warmup={warmup}, batch_size={batch_size}, seq_len={seq_len}"
        )
    torch.manual_seed(seed)
    model = TransformerLM(config).train()
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    times = []
    for i in range(warmup + steps):
        x = torch.randint(config.vocab_size, (batch_size, seq_len + 1), generator=gen)
        start = time.perf_counter()
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    s = statistics.median(times)
    return {
        "s_per_step": s,
        "tokens_per_s": batch_size * seq_len / s,
        "steps": steps,
        "params": model.num_parameters(),
        "state_size": model.decode_state_size(seq_len),
    }
