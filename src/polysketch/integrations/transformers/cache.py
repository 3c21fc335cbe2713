"""``PolysketchCache``: a transformers ``Cache`` holding constant-size decode states.

A transformers attention module calls ``past_key_values.update(k, v, layer_idx)`` just before
its attention function and attends to what it returns. ``PolysketchCacheLayer.update`` keeps
no keys or values: it returns the new k, v unchanged and hands its state to the layer's
``PolysketchAttention`` (the slot ``core._active_cache[0]``), which the attention function
consumes at once; the state is

* linear attention: ``polysketch.nn.cache.RecurrentCache`` — N = Σ φk⊗v, Z = Σ φk
  (``LinearAttentionState``, F'·(D + 1) floats per head, F' = F(⌊F/2⌋+1) for square maps);
* mixed attention: ``polysketch.nn.cache.MixedCache`` — N, Z of the completed blocks plus
  the keys, key features and values of the current block (< chunk_size tokens);
* ``sliding_window``: ``polysketch.nn.cache.WindowCache`` — the last w keys and values;
* a window branch beside the attention (``local_window``, the model presets:
  ``hybrid``): ``polysketch.nn.cache.ParallelCache`` — the attention's cache (``far``) and
  the window's ``WindowCache`` (``local``);

the caches of the one attention core (``AttentionCore.new_cache``).

``get_seq_length`` counts the tokens consumed (the position of the next one), and
``get_mask_sizes`` reports the full length, so transformers builds the usual causal/padding
mask; the attention function reads only the columns of the new keys (padded keys never
enter a state). Beam search reorders the states (``reorder_cache``).

Which cache a converted model may decode with (``check_cache``, called before anything is
computed): attentions that decode from a state take only a ``PolysketchCache``; the exact
``polynomial`` attention takes transformers' ``DynamicCache`` with full layers (its keys and
values); ``softmax`` (the model's own attention) takes whatever the model takes. Every other
cache (static, sliding-window, offloaded static, quantized, a ``DynamicCache`` for a state
attention) is refused with a ValueError naming the cache and what to use, never computed
with: their layers hand the attention keys it cannot read correctly (a static cache's
unfilled slots, a sliding layer's truncated keys, quantized values).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
)

from ...nn.cache import ParallelCache
from .attention import PolysketchAttention

__all__ = ["PolysketchCache", "PolysketchCacheLayer", "check_cache"]


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
        self.core._active_cache[0] = self
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

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state.select_rows(beam_idx.to(torch.int64))

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = self._rows()
        self.state.select_rows(torch.arange(rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        index = torch.as_tensor(indices)
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        self.state.select_rows(index.to(torch.int64).flatten())

    def _rows(self) -> int:
        """The batch size the state holds."""
        return _state_rows(self.state)


def _state_rows(st) -> int:
    """The batch size a core's cache holds (0 while empty); a ``ParallelCache``: its
    branches'."""
    if isinstance(st, ParallelCache):
        return max(_state_rows(st.far), _state_rows(st.local))
    for t in (getattr(st, "positions", None), getattr(st, "conv_tail", None),
              getattr(getattr(st, "state", None), "numerator", None),
              getattr(st, "k", None)):  # fmt: skip
        if isinstance(t, torch.Tensor):
            return t.shape[0]
    rows = getattr(st, "rows", None)
    if rows is not None:
        return len(rows)
    batch = getattr(st, "batch", None)
    if batch is not None:
        for t in (batch.summary, batch.k):
            if t is not None:
                return t.shape[0]
    return 0


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


def check_cache(cache, core: PolysketchAttention, layer_idx: int | None = None) -> None:
    """Refuse (ValueError) a cache ``core``'s attention cannot decode with exactly (module
    docstring); ``None`` passes.

    ``layer_idx``: the check of one attention layer about to run. A plain ``DynamicCache``
    (full or sliding layers) that holds nothing for that layer yet is then accepted for any
    attention: transformers makes one itself in a plain forward with ``use_cache=True``, and
    a full forward reads nothing from it (handing it back for a next step is refused then).
    """
    if cache is None or core.form == "softmax":
        return
    name = type(cache).__name__
    plain = type(cache) is DynamicCache and not getattr(cache, "offloading", False)
    if (
        plain
        and layer_idx is not None
        and (
            layer_idx >= len(cache.layers)
            or (
                type(cache.layers[layer_idx]) in (DynamicLayer, DynamicSlidingWindowLayer)
                and cache.layers[layer_idx].get_seq_length() == 0
            )
        )
    ):
        return
    if core.uses_state_cache:
        if not isinstance(cache, PolysketchCache):
            raise ValueError(
                f"attention={core.attention!r} decodes from a constant-size state: it cannot use "
                f"a {name} (its keys and values are not what this attention reads); pass "
                "past_key_values=PolysketchCache(model) (cache= from transformers 5.24), or "
                "leave cache_implementation unset so generate() makes one"
            )
        return
    if not plain or any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise ValueError(
            f"attention={core.attention!r} decodes from transformers' DynamicCache with full "
            f"layers (every key and value); a {name} "
            + ("with sliding-window layers " if type(cache) is DynamicCache else "")
            + "is not supported (static, sliding, offloaded and quantized caches hand the "
            "attention keys it cannot read exactly): leave cache_implementation unset, or pass "
            "DynamicCache()"
        )
