"""Texts in which passages recur at a set distance: the repeat (copy) probe of long context.

A window of T + 1 byte tokens (inputs x = w[:-1], targets y = w[1:], as ``CorpusBatches``)
is a run of *units* from position 0, then filler up to T + 1:

    unit = P · G · P        |P| = L (``passage_len``), |G| = d − L (``distance`` d ≥ L),

so each passage P first occurs at some position a and recurs at a + d. A model that uses
context at least d tokens back can predict the recurrence by copying; one that does not
predicts it as well as the first occurrence. ``text`` chooses what P, G and the filler are:

* ``"synthetic"``: i.i.d. uniform lowercase letters (26 symbols, entropy ln 26 ≈ 3.26
  nats/byte): the first occurrence is unpredictable, the recurrence fully predictable;
* ``"natural"``: slices of natural text (e.g. the Shakespeare corpus) taken at random
  offsets of ``source``: P, G and filler are unrelated slices, so only the recurrence of P
  can be copied.

``counterfactual=True`` replaces each first occurrence by other text of the same kind (a
new draw), keeping every position and mask: the "recurrence" no longer recurs, so a model's
loss drop from first to second occurrence must vanish there. The same seed gives the same
windows with and without it except for the first occurrences (paired comparison).

Masks are over target positions i (y[i] = w[i + 1]): ``first_mask[i]`` when w[i + 1] lies in
a first occurrence, ``second_mask[i]`` in a recurrence, each without the occurrence's first
token (its prediction crosses a boundary), so both masks hold L − 1 targets per unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._checks import check_choice, check_int, check_positive_int

__all__ = ["RepeatConfig", "RepeatSet", "make_repeat", "occurrence_masks", "LETTERS"]

LETTERS = np.arange(ord("a"), ord("z") + 1, dtype=np.int64)
"""Byte ids of the synthetic passages' alphabet (a–z)."""


@dataclass(frozen=True)
class RepeatConfig:
    """Layout of a repeat-probe window (see the module docstring).

    Attributes:
        seq_len: T, the model's input length; a window holds ``units`` whole units.
        passage_len: L, the length of a passage.
        distance: d ≥ L, from a passage's first token to its recurrence's first token.
        text: ``"synthetic"`` (random letters) or ``"natural"`` (slices of ``source``).
    """

    seq_len: int = 2048
    passage_len: int = 1024
    distance: int = 1024
    text: str = "synthetic"

    def __post_init__(self):
        check_positive_int(self.seq_len, "seq_len")
        check_int(self.passage_len, "passage_len", minimum=2)
        check_positive_int(self.distance, "distance")
        check_choice(self.text, "text", ("synthetic", "natural"))
        if self.distance < self.passage_len:
            raise ValueError(
                f"distance must be >= passage_len (got distance={self.distance}, "
                f"passage_len={self.passage_len}): a passage recurs after it ends"
            )
        if self.units < 1:
            raise ValueError(
                f"seq_len must hold one unit of distance + passage_len = "
                f"{self.distance + self.passage_len} tokens, got seq_len={self.seq_len}"
            )

    @property
    def unit_len(self) -> int:
        """Tokens per unit: d + L."""
        return self.distance + self.passage_len

    @property
    def units(self) -> int:
        """Whole units per window: ⌊T / (d + L)⌋."""
        return self.seq_len // self.unit_len


@dataclass
class RepeatSet:
    """N repeat-probe windows.

    Attributes:
        inputs, targets: (N, T) int64 byte ids, targets = inputs shifted by one.
        first_mask, second_mask: (T,) bool, the target positions of first occurrences and of
            recurrences (the same for every window).
        config: the layout.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    first_mask: torch.Tensor
    second_mask: torch.Tensor
    config: RepeatConfig


def occurrence_masks(config: RepeatConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(first_mask, second_mask), (T,) bool over target positions (module docstring)."""
    t, length, d = config.seq_len, config.passage_len, config.distance
    first = torch.zeros(t, dtype=torch.bool)
    second = torch.zeros(t, dtype=torch.bool)
    for u in range(config.units):
        a = u * config.unit_len  # window position of the passage's first token
        first[a : a + length - 1] = True  # targets w[a+1 .. a+L-1]
        second[a + d : a + d + length - 1] = True  # targets w[a+d+1 .. a+d+L-1]
    return first, second


def _slices(rng, source: np.ndarray, n: int, length: int) -> np.ndarray:
    """(n, length) random contiguous slices of ``source``."""
    starts = rng.integers(0, len(source) - length + 1, size=n)
    return source[starts[:, None] + np.arange(length)]


def make_repeat(
    config: RepeatConfig,
    num_windows: int,
    *,
    source: torch.Tensor | None = None,
    seed: int = 0,
    counterfactual: bool = False,
) -> RepeatSet:
    """Draw ``num_windows`` windows of ``config``'s layout (module docstring).

    Args:
        source: (N,) int64 token stream the natural passages, gaps and filler are sliced
            from (required for ``text="natural"``, e.g. ``load_corpus().val``; it must hold
            at least T + 1 tokens); ignored for synthetic text.
        seed: the draw (NumPy ``default_rng``).
        counterfactual: replace every first occurrence by an independent draw.

    Returns a ``RepeatSet`` (inputs and targets (N, T), masks (T,)).
    """
    n = check_positive_int(num_windows, "num_windows")
    rng = np.random.default_rng(check_int(seed, "seed", minimum=0))
    if not isinstance(counterfactual, bool):
        raise TypeError(f"counterfactual must be a bool, got {type(counterfactual).__name__}")
    total, length, d = config.seq_len + 1, config.passage_len, config.distance
    if config.text == "natural":
        if not isinstance(source, torch.Tensor) or source.dim() != 1:
            raise ValueError('source must be a 1-D token tensor for text="natural"')
        if source.numel() < total:
            raise ValueError(
                f"source holds {source.numel()} tokens, fewer than seq_len + 1 = {total}"
            )
        stream = source.cpu().numpy().astype(np.int64)

        def draw(length: int) -> np.ndarray:
            return _slices(rng, stream, n, length)
    else:

        def draw(length: int) -> np.ndarray:
            return LETTERS[rng.integers(0, len(LETTERS), size=(n, length))]

    window = draw(total)  # filler everywhere, then the units on top
    for u in range(config.units):
        a = u * config.unit_len
        passage, other = draw(length), draw(length)  # both drawn: the same stream either way
        window[:, a : a + length] = other if counterfactual else passage
        if d > length:
            window[:, a + length : a + d] = draw(d - length)
        window[:, a + d : a + d + length] = passage
    w = torch.from_numpy(window)
    first, second = occurrence_masks(config)
    return RepeatSet(w[:, :-1].contiguous(), w[:, 1:].contiguous(), first, second, config)
