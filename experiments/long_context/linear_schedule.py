"""A soft-hash linear term that fades over training: the grid's α-decay remedy (issue 44 item 2).

``soft_hash``'s linear term (``linear_weight = α``, Eq. 5 of ``features/soft_hash.py``) adds
α(1 + cos(q, k))/2 to every score: a floor under each key's weight and a gradient towards every
key, where the sharp map alone passes none between a query and a key that share no bucket. In
the grid it keeps the global head's weight on the copy's source from collapsing, but each
unrelated key then adds ≈ α/2 to the normalizer, which costs retrieval for as long as α stays.

To test an α that is large while the map learns and 0 once it retrieves, the grid accepts
``SPEC@linear=A:B:T``: the model is ``SPEC`` with ``linear_weight=A`` (what its checkpoints
store), and while it trains and is probed every soft-hash map's linear features
√(A/2)·(1, x/‖x‖) are multiplied by √(α(t)/A), so that its scores carry

    α(t) = B + (A − B) · max(0, 1 − t / T)

(``SurrogateSchedule``'s arithmetic), A at the start, B from step T on. The grid sets the
factor at each evaluation, so α is piecewise constant over the evaluation interval
(``--probe-every`` steps), and a resumed run continues from its last evaluation's α. Unlike
the surrogate's schedule this changes outputs: evaluations at step t are those of the map with
α(t), and a checkpoint reloaded outside the grid has α = A.
"""

from __future__ import annotations

import contextlib

from polysketch.features.soft_hash import SoftHashFeatureMap

from .surrogate_schedule import Scale, SurrogateSchedule, split_decay

__all__ = ["split_linear", "faded_linear"]


def split_linear(attention: str) -> tuple[str, SurrogateSchedule | None]:
    """``"SPEC@linear=A:B:T"`` -> (SPEC with linear_weight=A, the schedule); any other spec
    -> (spec, None) (``split_decay``)."""
    return split_decay(attention, "linear", "linear_weight", "0.001:0:300")


@contextlib.contextmanager
def faded_linear(scale: Scale):
    """Within the block every soft-hash map's linear features are multiplied by
    √``scale.value`` (read at each call), so its linear term is α·``scale.value``."""
    original = SoftHashFeatureMap.linear_features

    def faded(self, x):
        return original(self, x) * scale.value**0.5

    SoftHashFeatureMap.linear_features = faded
    try:
        yield scale
    finally:
        SoftHashFeatureMap.linear_features = original
