"""Padding means removal: what a padded batch computes at its real tokens.

A key-padding mask ``keep`` (B, T) (True = real token) may mark pads anywhere: left (batched
prompts of different lengths, as transformers pads them), right, or in the middle. Every
layer of ``polysketch.nn`` computes, at the real tokens of row b, exactly what row b
computes with its pads REMOVED, for every attention and every option:

* attentions whose scores do not depend on positions (linear, softmax, polynomial) only mask
  the padded keys;
* positions (RoPE) count real tokens only: the real token t of a row sits at
  ``real_positions(keep)`` = (number of real tokens before it), as transformers' position
  ids for left padding;
* position-dependent algorithms (mixed attention's block grid, the sliding window) and the
  short convolution run on the *compacted* row: its real tokens moved to the front in order
  (``compaction``; a stable sort of the mask), pads behind them where causality hides them
  from every real token, then moved back. Left padding: the block grid starts at each row's
  first real token.

Outputs at padded positions are meaningless (ignore them). Compaction is a gather along T
(no host synchronization); it runs only when a mask is given.
"""

from __future__ import annotations

import torch

__all__ = ["compaction", "gather_time", "real_positions"]


def compaction(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, inverse), both (B, T) int64: ``x.gather(T, perm)`` puts each row's real tokens
    first (in order) and its pads after them; ``gather(T, inverse)`` undoes it."""
    perm = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True)
    return perm, torch.argsort(perm, dim=-1)


def gather_time(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """x reordered along its time axis ``dim`` by ``index`` (B, T'): x has the batch axis
    first and the time axis at ``dim`` (e.g. (B, T, C) with dim=1, (B, H, T, D) with dim=2);
    returns x with T' entries along ``dim``."""
    dim = dim % x.dim()
    shape = [1] * x.dim()
    shape[0], shape[dim] = index.shape[0], index.shape[1]
    expand = list(x.shape)
    expand[dim] = index.shape[1]
    return x.gather(dim, index.view(shape).expand(expand))


def real_positions(keep: torch.Tensor, start: torch.Tensor | int = 0) -> torch.Tensor:
    """Position of each token counting real tokens only: ``start`` (B,) or int plus the number
    of real tokens before it in its row, (B, T) int64 (a pad gets the position of the
    next real token, which is harmless: pads are never attended to)."""
    before = keep.to(torch.int64).cumsum(-1) - keep.to(torch.int64)
    if isinstance(start, torch.Tensor):
        start = start.to(before.device).unsqueeze(-1)
    return before + start
