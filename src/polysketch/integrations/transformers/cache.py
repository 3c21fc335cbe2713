"""``PolysketchCache``: a transformers ``Cache`` holding constant-size decode states.

A transformers attention module calls ``past_key_values.update(k, v, layer_idx)`` just before
its attention function and attends to what it returns. ``PolysketchCacheLayer.update`` keeps
no keys or values: it returns the new k, v unchanged and hands its state to the layer's
``PolysketchAttention`` (``core._active_cache``), which the attention function consumes at
once; the state is

* linear attention: ``polysketch.nn.cache.RecurrentCache`` — N = Σ φk⊗v, Z = Σ φk
  (``LinearAttentionState``, F'·(D + 1) floats per head, F' = F² for square maps);
* ``psf_mixed``: ``polysketch.nn.cache.MixedCache`` — N, Z of the completed blocks plus the
  keys, key features and values of the current block (< chunk_size tokens).

``get_seq_length`` counts the tokens consumed (the position of the next one), and
``get_mask_sizes`` reports the full length, so transformers builds the usual causal/padding
mask; the attention function reads only the columns of the new keys (padded keys never
enter a state). Beam search reorders the states (``reorder_cache``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from ...ops import LinearAttentionState
from .attention import PolysketchAttention

__all__ = ["PolysketchCache", "PolysketchCacheLayer"]


class PolysketchCacheLayer(CacheLayerMixin):
    """One layer's decode state (see the module docstring); ``state`` is the polysketch cache."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, core: PolysketchAttention):
        super().__init__()
        self.core = core
        self.state = core.new_state()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Hand the state to the attention function; return the new k, v (nothing is stored)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.core._active_cache = self
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.state.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self):  # the state is small; it stays where it is
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        self.state = self.core.new_state()

    def num_floats(self) -> int:
        """Floats held for the whole batch."""
        return self.state.num_floats()

    def _map_batch(self, fn) -> None:
        s = self.state
        if isinstance(getattr(s, "state", None), LinearAttentionState):
            st = s.state
            s.state = LinearAttentionState(fn(st.numerator), fn(st.denominator), st.length)
            return
        for name in ("state", "k", "phi_k", "v"):
            t = getattr(s, name, None)
            if isinstance(t, torch.Tensor):
                setattr(s, name, fn(t))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])


class PolysketchCache(Cache):
    """A ``Cache`` for a ``convert``-ed model: one ``PolysketchCacheLayer`` per layer.

    ``PolysketchCache(model)``; ``model.generate`` creates one by itself after ``convert``.
    ``num_floats()`` is the decode memory (all layers, whole batch), constant in the length
    for linear attention and bounded for ``psf_mixed``.
    """

    def __init__(self, model: nn.Module):
        cores = sorted(
            (m for m in model.modules() if isinstance(m, PolysketchAttention)),
            key=lambda m: m.layer_index,
        )
        if not cores:
            raise ValueError("model has no polysketch attention: call convert(model) first")
        if not all(c.uses_state_cache for c in cores):
            raise ValueError(
                f"attention={cores[0].attention!r} decodes from a KV cache; use DynamicCache"
            )
        if [c.layer_index for c in cores] != list(range(len(cores))):
            raise ValueError("converted layers must have indices 0..L-1")
        super().__init__(layers=[PolysketchCacheLayer(c) for c in cores])

    def num_floats(self) -> int:
        """Floats held by all layers for the whole batch."""
        return sum(layer.num_floats() for layer in self.layers)
