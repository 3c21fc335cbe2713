"""Multi-query associative recall (MQAR), the synthetic recall benchmark of Zoology / BASED.

A sequence first lists ``num_kv_pairs`` key-value pairs ``k1 v1 k2 v2 ...``; later, each key
appears again (in a random order, at random positions among filler tokens) and the model must
emit its value right after it. Keys come from the lower half of the vocabulary, values from the
upper half, keys are distinct within a sequence, and token 0 is the filler. Queries are placed
with gaps drawn from a power law (``power_a``) as in Zoology, so that some answers must be
recalled from far back.

Long-range recall (``min_distance`` = d): every query is placed at least d tokens after its
key. The pairs occupy positions 0 … 2·kv − 1 (key i at 2i), query slot s puts its key at
2·kv + 2s, so the distance to key i is 2(kv − i + s) ≥ 2(s + 1); slots s < ⌈d/2⌉ − 1 are
left to filler and the power law is drawn over the remaining slots (shifted to start at
the first allowed one). d beyond an attention's exact local window (a sliding window, or
``psf_mixed``'s block) makes every answer depend on its global part. d ≤ 2 changes nothing
(every query is ≥ 2 tokens after its key), and draws the same sequences as before.

Targets are next-token labels with ``ignore_index`` (-100) everywhere except at the positions
whose next token is a queried value, so cross-entropy scores recall only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._checks import check_float, check_int, check_positive_int

__all__ = ["MQARConfig", "make_mqar", "IGNORE_INDEX"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class MQARConfig:
    """Sizes of an MQAR data set.

    Attributes:
        vocab_size: tokens 1..vocab_size/2-1 are keys, vocab_size/2..vocab_size-1 values.
        seq_len: length of each example (inputs and targets both have this length).
        num_kv_pairs: key-value pairs per example; 4 * num_kv_pairs + 1 <= seq_len + 1.
        power_a: exponent of the power law of query gaps (Zoology's default 0.01).
        min_distance: every query's key token is at least this many tokens after the same
            key in the key-value list (0: no constraint; see the module docstring).
    """

    vocab_size: int = 8192
    seq_len: int = 64
    num_kv_pairs: int = 4
    power_a: float = 0.01
    min_distance: int = 0

    def __post_init__(self):
        check_int(self.vocab_size, "vocab_size", minimum=8)
        check_positive_int(self.seq_len, "seq_len")
        check_positive_int(self.num_kv_pairs, "num_kv_pairs")
        check_float(self.power_a, "power_a", minimum=0.0, strict_minimum=True)
        if 4 * self.num_kv_pairs > self.seq_len + 1:
            raise ValueError(
                f"seq_len must be >= 4 * num_kv_pairs - 1 (got seq_len={self.seq_len}, "
                f"num_kv_pairs={self.num_kv_pairs})"
            )
        check_int(self.min_distance, "min_distance", minimum=0)
        room = self.query_slots - self.first_slot
        if room < self.num_kv_pairs:
            raise ValueError(
                f"min_distance={self.min_distance} leaves {max(room, 0)} query slots for "
                f"num_kv_pairs={self.num_kv_pairs} queries in seq_len={self.seq_len}: lower "
                "min_distance or num_kv_pairs, or raise seq_len"
            )
        if self.num_kv_pairs > self.vocab_size // 2 - 1:
            raise ValueError(
                f"vocab_size {self.vocab_size} has too few keys for "
                f"num_kv_pairs={self.num_kv_pairs}"
            )

    @property
    def query_slots(self) -> int:
        """Two-token query slots after the key-value list: (seq_len + 1 − 2·kv) // 2."""
        return (self.seq_len + 1 - 2 * self.num_kv_pairs) // 2

    @property
    def first_slot(self) -> int:
        """The first slot a query may use: max(0, ⌈min_distance / 2⌉ − 1)."""
        return max(0, -(-self.min_distance // 2) - 1)


def make_mqar(
    config: MQARConfig, num_examples: int, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate ``num_examples`` MQAR sequences.

    Returns:
        inputs: (N, seq_len) int64 tokens.
        targets: (N, seq_len) int64 next-token labels, ``IGNORE_INDEX`` except where the next
            token is the value of a queried key.
    """
    num_examples = check_positive_int(num_examples, "num_examples")
    rng = np.random.default_rng(check_int(seed, "seed", minimum=0))
    n, kv = num_examples, config.num_kv_pairs
    total = config.seq_len + 1  # one extra token so inputs/targets are shifted views
    half = config.vocab_size // 2

    # distinct keys per example (lower half without filler 0), values from the upper half
    keys = np.argsort(rng.random((n, half - 1)), axis=1)[:, :kv] + 1
    values = rng.integers(half, config.vocab_size, size=(n, kv))
    seq = np.zeros((n, total), dtype=np.int64)
    seq[:, 0 : 2 * kv : 2] = keys
    seq[:, 1 : 2 * kv : 2] = values

    # query slots: pairs (key, value) at even offsets after the context, power-law distributed
    # over the slots at least min_distance after every key (all slots when min_distance <= 2)
    first = config.first_slot
    space = config.query_slots - first  # number of 2-token slots a query may use
    slot_ids = np.arange(space)
    p = config.power_a * (slot_ids + 1.0) ** (config.power_a - 1)
    p = p / p.sum()
    slots = first + np.stack([rng.choice(space, size=kv, replace=False, p=p) for _ in range(n)])
    query_pos = 2 * kv + 2 * slots  # position of the repeated key
    order = np.argsort(rng.random((n, kv)), axis=1)  # which key is asked in each slot
    rows = np.arange(n)[:, None]
    seq[rows, query_pos] = keys[rows, order]
    seq[rows, query_pos + 1] = values[rows, order]

    labels = np.full((n, total), IGNORE_INDEX, dtype=np.int64)
    labels[rows, query_pos + 1] = values[rows, order]
    inputs = torch.from_numpy(seq[:, :-1].copy())
    targets = torch.from_numpy(labels[:, 1:].copy())
    return inputs, targets
