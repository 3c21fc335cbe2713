"""The grid's tag ``SPEC@outinit=S``: ``SPEC`` with ``global_out_init=S`` (issue 44 item 2).

The attention beside the window branch starts with its output projection W_o at S × the
model's residual-output initialization (``HybridSpec.out_init``; the window branch keeps the
model's). Why S = 0 is tried: every normalized attention's score gradient reaches q_i and k_j
through c_ij = g_i·(v_j − o_i), g_i the loss gradient at the branch core's output
(``grid_diagnostics``: ``source_value``). At step 0 the sign of c_ij at the copy's source is
set by the initialized value, output and unembedding projections; on a seed whose
value–output circuit happens to raise the logits of tokens other than the one a key holds,
attending to the source raises the loss, the first steps push q_i off k_src, and the sharp
hash passes no gradient once they share no bucket. With W_o = 0, g_i = W_oᵀ δ_i = 0 at step
0; W_o's first descent direction −Σ_i δ_i o_iᵀ raises the copy trace tr(W_U W_o W_V E) in
expectation (∝ the attention on keys holding the target), so the circuit starts neutral and
turns towards copying before q and k move.

The tag predates the option and names the same model (the weights are drawn as before, then
W_o × S); it is kept so that the grid folders that used it resume (``--reuse``).
"""

from __future__ import annotations

from .surrogate_schedule import split_number

__all__ = ["split_outinit"]


def split_outinit(attention: str) -> tuple[str, float | None]:
    """``"SPEC@outinit=S"`` -> (SPEC with ``global_out_init=S``, S); any other spec ->
    (spec, None). ValueError naming the attention unless S >= 0, or if SPEC already sets
    ``global_out_init``."""
    spec, scale = split_number(attention, "outinit", 0.0)
    if scale is None:
        return attention, None
    if "global_out_init=" in spec:
        raise ValueError(f"attention {attention!r}: @outinit sets global_out_init")
    joiner = "," if ":" in spec else ":"
    return f"{spec}{joiner}global_out_init={scale}", scale
