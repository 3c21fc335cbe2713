"""Sequence mixing on features: exact references, linear attention backends, decoding.

Public entry points:

- ``linear_attention(phi_q, phi_k, v, *, causal, square=False, chunk_size=256, ...)``: linear
  attention on features (non-causal by associativity; causal by the block lower-triangular
  algorithm of PolySketchFormer Theorem 3.1, or by Performer prefix sums), one entry point over
  the backends of ``polysketch.ops.dispatch`` (one contract, one state layout).
- ``kernel_attention(q, k, v, feature_map, *, causal, ...)``: applies a ``FeatureMap`` first.
- ``linear_attention_step`` and ``LinearAttentionState`` (``ops.state``): constant-size
  decoding; squared maps keep their state in the pair layout of ``ops.pairs``
  (``dense_to_pair_state`` converts states of earlier releases).
- ``mixed_attention`` and ``mixed_attention_step`` / ``MixedAttentionState``: exact local
  blocks + features before them, and its decoding.
- ``window_attention`` / ``naive_window_attention``: exact attention over the last w keys in
  O(T·w) (``ops.window``), the local-only control of mixed attention.
- ``softmax_attention``, ``polynomial_attention``, ``naive_linear_attention``,
  ``naive_mixed_attention``: exact quadratic references (PolySketchFormer Eq. (1)).
- ``cumsum_lt_multiply``: Performer-style prefix sums over dense states (the cross-check of
  ``algorithm="cumsum"``).
"""

from .cumsum import MAX_SQUARE_CUMSUM_ELEMENTS, cumsum_lt_multiply
from .dispatch import enable_triton
from .kernel import ALGORITHMS, kernel_attention, linear_attention
from .mixed import LOCAL_KERNELS, mixed_attention, naive_mixed_attention
from .mixed_step import MixedAttentionState, mixed_attention_state, mixed_attention_step
from .naive import (
    DEFAULT_EPS,
    causal_mask,
    naive_linear_attention,
    polynomial_attention,
    softmax_attention,
    stabilize_denominator,
)
from .pairs import PairFeatures, pair_dim, state_dim
from .recurrent import linear_attention_step
from .state import LinearAttentionState, dense_to_pair_state, pair_to_dense_state
from .window import naive_window_attention, window_attention

__all__ = [
    "ALGORITHMS",
    "LOCAL_KERNELS",
    "DEFAULT_EPS",
    "MAX_SQUARE_CUMSUM_ELEMENTS",
    "LinearAttentionState",
    "MixedAttentionState",
    "PairFeatures",
    "causal_mask",
    "cumsum_lt_multiply",
    "dense_to_pair_state",
    "enable_triton",
    "kernel_attention",
    "linear_attention",
    "linear_attention_step",
    "mixed_attention",
    "mixed_attention_state",
    "mixed_attention_step",
    "naive_mixed_attention",
    "naive_window_attention",
    "naive_linear_attention",
    "pair_dim",
    "pair_to_dense_state",
    "polynomial_attention",
    "softmax_attention",
    "stabilize_denominator",
    "state_dim",
    "window_attention",
]
