"""Attention layer and language model.

- ``AttentionCore``: the one attention core ((B, H, T, D) q, k, v + key mask + cache), shared
  by ``KernelAttention`` and the transformers adapter: presets, precision policy, caches.
- ``KernelAttention``: batch-first multi-head self-attention with any polysketch kernel
  (feature maps, exact softmax / polynomial, PolySketchFormer presets, sliding window).
- ``TransformerConfig`` / ``TransformerLM``: a small decoder-only LM with decoding caches
  (``local_window``: an exact sliding-window branch beside each layer's attention).
- ``PRESETS`` / ``MODEL_PRESETS``: the preset tables; ``AttentionSpec`` / ``HybridSpec`` /
  ``ModelSpec`` / ``LayerSpec``: what a name resolves to, once (``resolve_attention``,
  ``resolve_model``, ``resolve_converted``); ``ATTENTION_OPTIONS``: the options a name takes.
- ``MultiHeadFeatureMap``: independent per-head feature maps applied with ``torch.vmap``.
"""

from .ablate import ablate_global
from .attention import KernelAttention
from .cache import KVCache, MixedCache, ParallelCache, RecurrentCache, WindowCache
from .core import AttentionCore
from .heads import MultiHeadFeatureMap, head_seed
from .presets import MODEL_PRESETS, PRESETS
from .resolve import (
    resolve_attention,
    resolve_converted,
    resolve_model,
    valid_attentions,
    valid_model_attentions,
)
from .rope import RotaryEmbedding
from .spec import (
    ATTENTION_OPTIONS,
    DEFAULT_CHUNK_SIZE,
    AttentionSpec,
    HybridSpec,
    LayerSpec,
    ModelSpec,
)
from .transformer import TransformerConfig, TransformerLM

__all__ = [
    "ATTENTION_OPTIONS",
    "DEFAULT_CHUNK_SIZE",
    "LayerSpec",
    "resolve_converted",
    "AttentionCore",
    "KernelAttention",
    "TransformerConfig",
    "TransformerLM",
    "PRESETS",
    "MODEL_PRESETS",
    "AttentionSpec",
    "HybridSpec",
    "ModelSpec",
    "resolve_attention",
    "resolve_model",
    "MultiHeadFeatureMap",
    "RotaryEmbedding",
    "KVCache",
    "MixedCache",
    "ParallelCache",
    "RecurrentCache",
    "WindowCache",
    "ablate_global",
    "head_seed",
    "valid_attentions",
    "valid_model_attentions",
]
