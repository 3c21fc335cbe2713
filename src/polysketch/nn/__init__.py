"""Attention layer and language model.

- ``KernelAttention``: batch-first multi-head self-attention with any polysketch kernel
  (feature maps, exact softmax / polynomial, PolySketchFormer presets).
- ``TransformerConfig`` / ``TransformerLM``: a small decoder-only LM with decoding caches.
- ``PRESETS``: the PolySketchFormer presets (name -> description and settings).
- ``MultiHeadFeatureMap``: independent per-head feature maps applied with ``torch.vmap``.
"""

from .attention import KernelAttention
from .cache import KVCache, MixedCache, RecurrentCache
from .heads import MultiHeadFeatureMap, head_seed
from .presets import PRESETS, valid_attentions
from .rope import RotaryEmbedding
from .transformer import TransformerConfig, TransformerLM

__all__ = [
    "KernelAttention",
    "TransformerConfig",
    "TransformerLM",
    "PRESETS",
    "MultiHeadFeatureMap",
    "RotaryEmbedding",
    "KVCache",
    "MixedCache",
    "RecurrentCache",
    "head_seed",
    "valid_attentions",
]
