"""Batch samplers for ``train``: where each step's (x, y) rows come from.

* ``CorpusBatches``: B random contiguous blocks of ``block_size + 1`` tokens from a token
  stream, x = block[:-1], y = block[1:]; the ``torch.Generator`` state *is* the data position.
* ``MQARData`` / ``MQARBatches``: a fixed MQAR training set visited in a seeded random order,
  one permutation per epoch, plus a validation set.
* ``pack_rows``: ``train --pack``: a batch of rows as ONE packed row with ``cu_seqlens``
  (``polysketch.ops.varlen``): every row is a document, and inside a row a new document
  starts after each corpus document separator (``DOC_SEPARATOR``, a blank line: the corpus
  joins its files with one, and blank lines between paragraphs count too: the byte stream
  keeps no other boundary).

Every sampler has ``next(batch_size)`` and ``state_dict()`` / ``load_state_dict()`` so a
checkpoint resumes the data stream exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..data.corpus import DOC_SEPARATOR, Corpus
from ..data.mqar import MQARConfig, make_mqar
from . import distributed
from .config import TrainConfig

__all__ = ["MQARData", "CorpusBatches", "MQARBatches", "make_batches", "val_batches",
           "pack_rows", "pack_separator"]  # fmt: skip


@dataclass
class MQARData:
    """An MQAR task: (N, T) inputs / targets (``IGNORE_INDEX`` off the recall positions)."""

    train_inputs: torch.Tensor
    train_targets: torch.Tensor
    val_inputs: torch.Tensor
    val_targets: torch.Tensor
    vocab_size: int

    @classmethod
    def make(cls, config: MQARConfig, *, num_train: int, num_val: int, seed: int = 0):
        """Draw disjointly seeded train (``seed``) and validation (``seed + 1``) sets."""
        x, y = make_mqar(config, num_train, seed=seed)
        vx, vy = make_mqar(config, num_val, seed=seed + 1)
        return cls(x, y, vx, vy, config.vocab_size)


class CorpusBatches:
    """Random contiguous blocks of a token stream; the generator state is the data position."""

    def __init__(self, tokens: torch.Tensor, block_size: int, seed: int, name: str = "data"):
        if tokens.numel() < block_size + 1:
            raise ValueError(
                f"{name} holds {tokens.numel()} tokens, fewer than block_size + 1 = "
                f"{block_size + 1}: use a smaller block_size or more text"
            )
        self.windows = tokens.unfold(0, block_size + 1, 1)  # (N - block, block + 1), a view
        self.generator = torch.Generator().manual_seed(seed)

    def next(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(self.windows), (batch_size,), generator=self.generator)
        blocks = self.windows[ix]
        return blocks[:, :-1], blocks[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


class MQARBatches:
    """A fixed example set visited in seeded random order, a fresh permutation per epoch."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, seed: int):
        self.inputs, self.targets = inputs, targets
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(len(inputs), generator=self.generator)
        self.position = 0

    def next(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        while batch_size > 0:
            if self.position == len(self.order):
                self.order = torch.randperm(len(self.inputs), generator=self.generator)
                self.position = 0
            take = self.order[self.position : self.position + batch_size]
            self.position += len(take)
            batch_size -= len(take)
            rows.append(take)
        ix = torch.cat(rows)
        return self.inputs[ix], self.targets[ix]

    def state_dict(self) -> dict:
        return {
            "generator": self.generator.get_state(),
            "order": self.order.clone(),
            "position": self.position,
        }

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.order, self.position = state["order"].clone(), int(state["position"])


def make_batches(data, block_size: int, seed: int) -> CorpusBatches | MQARBatches:
    """The training sampler for ``data`` (a ``Corpus`` or ``MQARData``), seeded with ``seed``."""
    if isinstance(data, Corpus):
        return CorpusBatches(data.train, block_size, seed, "the corpus' training split")
    if isinstance(data, MQARData):
        return MQARBatches(data.train_inputs, data.train_targets, seed)
    raise TypeError(f"data must be a Corpus or MQARData, got {type(data).__name__}")


def val_batches(data, cfg: TrainConfig, block_size: int, ctx):
    """The validation batches (this rank's rows), the same ones at every evaluation."""
    if isinstance(data, MQARData):
        n = len(data.val_inputs)
        for i in range(0, n, cfg.batch_size):
            x, y = data.val_inputs[i : i + cfg.batch_size], data.val_targets[i : i + cfg.batch_size]
            share = math.ceil(len(x) / ctx.world_size)
            part = slice(ctx.rank * share, (ctx.rank + 1) * share)
            yield x[part], y[part]
        return
    block = min(block_size, data.val.numel() - 1)
    if block < 1:
        raise ValueError("the corpus' validation split needs at least 2 tokens")
    sampler = CorpusBatches(data.val, block, cfg.seed + 7919)
    rows = distributed.rank_slice(cfg.batch_size, ctx.world_size, ctx.rank)
    for _ in range(cfg.eval_batches):
        x, y = sampler.next(cfg.batch_size)
        yield x[rows], y[rows]


def pack_separator(data) -> list[int]:
    """The token ids after which ``pack_rows`` starts a document: the corpus' blank line.
    Raises ValueError for MQAR (one example per row already; nothing to pack)."""
    if not isinstance(data, Corpus):
        raise ValueError("pack: packing needs a text corpus (MQAR examples are one per row)")
    return list(DOC_SEPARATOR.encode("utf-8"))  # the byte tokenizer's ids


def pack_rows(x: torch.Tensor, y: torch.Tensor, separator: list[int]) -> tuple:
    """(b, T) inputs and targets -> ((1, b·T), (1, b·T), cu_seqlens): the rows side by side,
    a document starting at every row start and right after every occurrence of
    ``separator`` in a row (module docstring). Each document is then computed alone."""
    b, t = x.shape
    starts = set(range(0, b * t, t))
    s = len(separator)
    if s and t >= s:
        hit = (x.unfold(1, s, 1) == torch.tensor(separator, dtype=x.dtype)).all(-1)
        for row, j in hit.nonzero().tolist():
            if j + s < t:
                starts.add(row * t + j + s)
    return x.reshape(1, b * t), y.reshape(1, b * t), sorted(starts) + [b * t]
