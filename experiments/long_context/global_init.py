"""The global branch's output projection initialized at S times GPT-2's: the grid's remedy
``SPEC@outinit=S`` (issue 44 item 2).

In a block with a soft-hash global branch beside a window, every normalized attention's
score gradient reaches q_i and k_j through c_ij = g_i·(v_j − o_i), g_i the loss gradient at
the branch core's output (``grid_diagnostics``: ``source_value``). At step 0 the sign of
c_ij at the copy's source is set by the initialized value, output and unembedding
projections: where the head's value–output circuit happens to raise the logit of a token
*other* than the one its key holds, attending to the source raises the loss, and the first
steps push q_i off k_src. Softmax recovers from that (its weights move smoothly); the sharp
hash does not once q_i and k_src share no bucket.

With the output projection W_o of the global branch at 0, g_i = W_oᵀ δ_i = 0 at step 0: q, k
and the values get no gradient until W_o has learned; W_o's own descent direction,
−Σ_i δ_i o_iᵀ, raises the copy trace tr(W_U W_o W_V E) in expectation by ∝ Σ_i
a_i,src (the attention on keys whose token is the target), whatever the initialization's
sign, so the circuit starts neutral and turns towards copying before q and k are moved.
S = 1 is the library's initialization; S = 0 zeroes W_o (as ReZero zeroes a residual branch).

``scaled_global_init(s)`` wraps ``TransformerLM._init_weights`` for the duration of a
``with`` block: models built inside it have ``block.attn.out_proj.weight`` × s in every
block with an unshared global branch beside a window (a block whose two branches share one
projection is refused). Checkpoints store the trained weights, so a resumed run is the same
model; the init only changes where training starts.
"""

from __future__ import annotations

import contextlib

import torch

from polysketch.nn import TransformerLM

from .surrogate_schedule import split_number

__all__ = ["split_outinit", "scaled_global_init"]


def split_outinit(attention: str) -> tuple[str, float | None]:
    """``"SPEC@outinit=S"`` -> (SPEC, s); any other spec -> (spec, None). ValueError naming
    the attention unless s >= 0."""
    return split_number(attention, "outinit", 0.0)


@contextlib.contextmanager
def scaled_global_init(scale: float):
    """Within the block, a new ``TransformerLM``'s global branches start with their output
    projection × ``scale`` (module docstring)."""
    original = TransformerLM._init_weights

    @torch.no_grad()
    def init(self):
        original(self)
        for i, block in enumerate(self.blocks):
            if block.local_attn is None:
                continue
            if block.shared:
                raise ValueError(
                    f"@outinit: layer {i}'s branches share one output projection; "
                    "use a spec with unshared branches"
                )
            block.attn.out_proj.weight.mul_(scale)

    TransformerLM._init_weights = init
    try:
        yield
    finally:
        TransformerLM._init_weights = original
