"""A surrogate weight that changes over training: the grid's λ-decay remedy (issue 44 item 2).

``polysketch``'s training-only gradient surrogate has one weight λ per model
(``TransformerConfig.gradient_surrogate``, stored resolved in checkpoints, so a resumed run
must keep it). To test a λ that changes over training without a library change, the grid
accepts a candidate spelled ``SPEC@surrogate=A:B:T``: the model is ``SPEC`` with
``gradient_surrogate=A`` (what its checkpoints store), and while it trains every core's
surrogate term λ·(o_lin − sg(o_lin)) is multiplied by λ(t)/A, with

    λ(t) = B + (A − B) · max(0, 1 − t / T),

A at the start, B from step T on. ``scaled_surrogate(scale)`` wraps
``AttentionCore._gradient_surrogate`` (the term's only producer) for the duration of a
``with`` block; the grid sets ``scale.value`` = λ(t)/A at each evaluation, so λ is piecewise
constant over the evaluation interval (``--probe-every`` steps). The surrogate's value stays
exactly 0, so outputs, evaluations and checkpoints are those of ``SPEC`` at any λ; only the
gradients (hence training) change. A hook in the library (a λ schedule in
``TrainConfig`` or a per-step callback) would make this a plain option.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

from polysketch.nn.core import AttentionCore

__all__ = [
    "SurrogateSchedule", "split_decay", "split_number", "split_schedule", "scaled_surrogate",
    "Scale",
]  # fmt: skip


@dataclass(frozen=True)
class SurrogateSchedule:
    """λ(t) = end + (start − end) · max(0, 1 − t / steps) (module docstring)."""

    start: float
    end: float
    steps: int

    def __post_init__(self):
        if not (self.start > 0 and self.end >= 0 and self.steps >= 1):
            raise ValueError(
                f"surrogate schedule needs start > 0, end >= 0, steps >= 1; got {self}"
            )

    def weight(self, step: int) -> float:
        return self.end + (self.start - self.end) * max(0.0, 1.0 - step / self.steps)

    def scale(self, step: int) -> float:
        """λ(step) / λ(0): the factor on a model built with gradient_surrogate = start."""
        return self.weight(step) / self.start


def split_decay(attention: str, tag: str, field: str, example: str):
    """``"SPEC@TAG=A:B:T"`` -> (SPEC with ``field``=A, the ``SurrogateSchedule`` (A, B, T));
    an attention without ``@TAG=`` -> (attention, None). ValueError naming the attention if
    it does not parse or SPEC already sets ``field``. ``example``: A:B:T for the message."""
    marker = f"@{tag}="
    if marker not in attention:
        return attention, None
    spec, _, text = attention.partition(marker)
    try:
        a, b, t = text.split(":")
        schedule = SurrogateSchedule(float(a), float(b), int(t))
    except ValueError as err:
        raise ValueError(
            f"attention {attention!r}: expected SPEC{marker}START:END:STEPS, e.g. "
            f"soft_hash_far_local{marker}{example} ({err})"
        ) from None
    if f"{field}=" in spec:
        raise ValueError(f"attention {attention!r}: the schedule sets {field}")
    joiner = "," if ":" in spec else ":"
    return f"{spec}{joiner}{field}={schedule.start}", schedule


def split_number(attention: str, tag: str, minimum: float, maximum: float | None = None):
    """``"SPEC@TAG=X"`` -> (SPEC, X as a float); an attention without ``@TAG=`` ->
    (attention, None). ValueError naming the attention unless minimum <= X (<= maximum)."""
    marker = f"@{tag}="
    if marker not in attention:
        return attention, None
    spec, _, text = attention.partition(marker)
    bounds = f"in [{minimum:g}, {maximum:g}]" if maximum is not None else f">= {minimum:g}"
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (x >= minimum and (maximum is None or x <= maximum)):
        raise ValueError(f"attention {attention!r}: expected SPEC{marker}X with X {bounds}")
    return spec, x


def split_schedule(attention: str) -> tuple[str, SurrogateSchedule | None]:
    """``"SPEC@surrogate=A:B:T"`` -> (SPEC with gradient_surrogate=A, the schedule);
    any other spec -> (spec, None) (``split_decay``)."""
    return split_decay(attention, "surrogate", "gradient_surrogate", "200:50:300")


@dataclass
class Scale:
    """The factor the wrapped surrogate is multiplied by (mutable between steps)."""

    value: float = 1.0


@contextlib.contextmanager
def scaled_surrogate(scale: Scale):
    """Within the block every ``AttentionCore``'s surrogate term is multiplied by
    ``scale.value`` (read at each call)."""
    original = AttentionCore._gradient_surrogate

    def scaled(self, q, k, v, keep, shard=None):
        return original(self, q, k, v, keep, shard) * scale.value

    AttentionCore._gradient_surrogate = scaled
    try:
        yield scale
    finally:
        AttentionCore._gradient_surrogate = original
