"""A surrogate that also trains the values: the grid's value-bootstrap remedy (issue 44 item 2).

The library's training-only surrogate λ·(o_lin − sg(o_lin)) (``AttentionCore``'s
``_gradient_surrogate``) gives q and k the gradient of a far-block attention with the kernel
1 + cos(q, k), its values detached: it moves queries towards keys whose *current* values would
lower the loss. Before the copy starts, nothing in the global branch's values says which key
helps (its output projection and values learn only from the keys the sharp map already
weights), so the q/k gradient has nothing to point at. Softmax near init weights every earlier
key about equally, and its values learn from all of them: a consistent signal that the key
d tokens back carries the next token.

This remedy adds that value signal without changing any value: with μ ≥ 0,

    out += μ · (o_v − sg(o_v)),     o_v = Σ_j (1 + cos(q_i, k_j)) v_j / Σ_j (1 + cos(q_i, k_j)),

over the same far blocks, q and k detached (so the q/k gradient is the library's surrogate
alone) and v not: the values receive μ times the gradient of a near-uniform attention. It is
exactly 0 in value like the library's term, so outputs, evaluations and checkpoints are those
of ``SPEC``. The grid spells it ``SPEC@values=MU`` (``SPEC`` must have a surrogate, λ > 0,
since the term rides on the library's). ``surrogate_values(mu)`` wraps
``AttentionCore._gradient_surrogate`` for the duration of a ``with`` block.
"""

from __future__ import annotations

import contextlib

from polysketch.nn.core import AttentionCore

from .surrogate_schedule import split_number

__all__ = ["split_values", "surrogate_values"]


def split_values(attention: str) -> tuple[str, float | None]:
    """``"SPEC@values=MU"`` -> (SPEC, μ); any other spec -> (spec, None). ValueError naming
    the attention if μ does not parse or is negative."""
    return split_number(attention, "values", 0.0)


@contextlib.contextmanager
def surrogate_values(mu: float):
    """Within the block every ``AttentionCore``'s surrogate term gains μ·(o_v − sg(o_v))
    (module docstring)."""
    original = AttentionCore._gradient_surrogate

    def with_values(self, q, k, v, keep, shard=None):
        term = original(self, q, k, v, keep, shard)
        q, k = q.detach(), k.detach()
        lin_q, lin_k = self.surrogate_features(q, k)
        if keep is not None:  # padded keys drop out, as in the library's term
            m = keep[:, None, :, None]
            lin_k, v = (x.where(m, x.new_zeros(())) for x in (lin_k, v))
        o = self._mixed_op(q, k, v, lin_q, lin_k, local="none", square=False, shard=shard)
        return term + mu * (o - o.detach())

    AttentionCore._gradient_surrogate = with_values
    try:
        yield mu
    finally:
        AttentionCore._gradient_surrogate = original
