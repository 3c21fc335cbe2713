"""Sequence mixing on features: exact references, chunked/cumsum/recurrent linear attention.

Public entry points:

- ``linear_attention(phi_q, phi_k, v, *, causal, square=False, chunk_size=256, ...)``: linear
  attention on features (non-causal by associativity; causal by the block lower-triangular
  algorithm of PolySketchFormer Theorem 3.1, or by Performer prefix sums).
- ``kernel_attention(q, k, v, feature_map, *, causal, ...)``: applies a ``FeatureMap`` first.
- ``linear_attention_step`` and ``LinearAttentionState``: constant-size decoding.
- ``softmax_attention``, ``polynomial_attention``, ``naive_linear_attention``: exact quadratic
  references (PolySketchFormer Eq. (1)).

Internals kept stable for ``mixed`` and the benchmark: ``chunked_lt_multiply``,
``cumsum_lt_multiply``, ``noncausal_multiply``, ``square_state``, ``square_apply``,
``stabilize_denominator``.
"""

from .chunked import (
    apply_state,
    chunked_lt_multiply,
    chunked_lt_multiply_with_sums,
    noncausal_multiply,
    square_apply,
    square_state,
)
from .cumsum import MAX_SQUARE_CUMSUM_ELEMENTS, cumsum_lt_multiply
from .kernel import ALGORITHMS, kernel_attention, linear_attention
from .mixed import LOCAL_KERNELS, mixed_attention, naive_mixed_attention
from .naive import (
    DEFAULT_EPS,
    causal_mask,
    naive_linear_attention,
    polynomial_attention,
    softmax_attention,
    stabilize_denominator,
)
from .recurrent import LinearAttentionState, linear_attention_step

__all__ = [
    "ALGORITHMS",
    "LOCAL_KERNELS",
    "DEFAULT_EPS",
    "MAX_SQUARE_CUMSUM_ELEMENTS",
    "LinearAttentionState",
    "apply_state",
    "causal_mask",
    "chunked_lt_multiply",
    "chunked_lt_multiply_with_sums",
    "cumsum_lt_multiply",
    "kernel_attention",
    "linear_attention",
    "linear_attention_step",
    "mixed_attention",
    "naive_mixed_attention",
    "naive_linear_attention",
    "noncausal_multiply",
    "polynomial_attention",
    "softmax_attention",
    "square_apply",
    "square_state",
    "stabilize_denominator",
]
