"""A window branch beside a converted layer's attention: model presets in transformers models.

The model presets (``polysketch.nn.MODEL_PRESETS``: ``soft_hash_local``,
``soft_hash_far_local``, ``soft_hash_far_local_tied``, ``soft_hash_far_local_balanced``) put
an exact sliding-window softmax
branch beside a linear-time attention in every layer of a ``TransformerLM``. A converted layer
has one set of projections (the model's q/k/v/o and its RoPE), so it takes the *shared* form of
that hybrid (``HybridSpec.shared``, ``polysketch.nn.transformer.Block``): for query head h,

    O_h = W_h + G_h        (then the model's o_proj, as for any converted layer)

    W_h = Σ_{i-w<j≤i} exp(s q_i·k_j) v_j / Σ_{i-w<j≤i} exp(s q_i·k_j)
          the exact softmax over the last w keys (the window), s the model's ``scaling``,
          on the model's rotated q, k (``resolve_attention("sliding_window", window=w)``);
    G_h = the preset's global attention on the same q, k, v: its own q/k LayerNorm, feature
          map and normalizer (soft_hash_far: the blocks of ``chunk_size`` before the query's
          own block only; soft_hash_1k: every earlier key), for h < g; G_h = 0 for h ≥ g.

Each branch keeps its own normalizer (BASED's local + global sum, as the preset trains), so
at conversion the layer is no longer the model's softmax: attention transfer trains the
global branch's LayerNorms and learnable map (soft_hash's directions and temperature) to match
it, and the fine-tune the rest.

Mapping a preset onto the model (``resolve_converted``):

* **Global heads.** A ``TransformerLM`` preset adds one global head (``global_heads=1``; two
  for ``soft_hash_far_local_balanced``) with its own projections; a converted layer cannot
  add heads, so the global branch reads the query heads' own q, k, v. By default it runs on
  **every** query head (``global_heads=None``): each pretrained head may attend far back, and
  a head without the global branch can reach no key beyond its window, which no training of
  the added modules can give back.
  ``global_heads=g`` runs it on query heads 0..g-1 only (the others are the window alone), a
  g/H share of the global state (``docs/hf_integration.md``: the state per layer against the
  KV cache).
* **Values.** ``value_fraction`` (soft_hash_far_local's values of 29/32 the head dim) does
  not apply: the values are the model's own v of each head (its state per head is then
  F·(D + 1)).
* **Initialization.** ``out_init`` and ``out_tied`` (soft_hash_far_local_tied's W_o starting as
  W_vᵀ) set how a fresh ``TransformerLM`` draws its global branch's output projection; a
  converted layer has no such projection of its own (the model's pretrained o_proj follows
  both branches), so they do not apply and a preset carrying them converts as its untied form.
* **Window, block, surrogate.** ``local_window`` (default: the preset's w), ``chunk_size``
  (default: the preset's block, else 64) and ``gradient_surrogate`` (λ, default: the
  preset's) override the preset's; the surrogate gradient acts only while autograd records
  (attention transfer, fine-tuning) and is exactly 0 in value (``AttentionCore``).
* **RoPE.** The global branch reads the model's rotated q, k (the presets' ``global_rope``
  is the model's). A preset whose hybrid cannot be carried (global attention on some layers
  only, or without RoPE) is refused, naming the field.

Any other attention takes a window beside it by ``local_window=w`` (``convert(model,
"soft_hash_far", local_window=64)``, or ``"psf_random"``); an attention that reads only the
blocks before each query's own (``soft_hash_far``) is refused without a window of at least
``chunk_size`` keys, since it would see none of the keys of its own block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..._checks import check_positive_int
from ...nn import resolve_attention
from ...nn.resolve import model_preset

__all__ = ["DEFAULT_CHUNK_SIZE", "ConvertedAttention", "resolve_converted"]

DEFAULT_CHUNK_SIZE = 64
"""``convert``'s block when neither the caller nor a model preset gives one."""

_EXACT = ("softmax", "sliding_window", "polynomial")


@dataclass(frozen=True)
class ConvertedAttention:
    """What a converted layer computes, a model preset expanded (module docstring).

    ``attention``: the global attention's name (an attention preset or feature map);
    ``map_kwargs``: its map keywords (the preset's, then the caller's); ``chunk_size``;
    ``local_window``: w of the window branch, or None (no branch); ``global_heads``: g, or
    None (every query head); ``gradient_surrogate``: λ (0: none).
    """

    attention: str
    chunk_size: int
    local_window: int | None = None
    global_heads: int | None = None
    gradient_surrogate: float = 0.0
    map_kwargs: dict = field(default_factory=dict)


def _optional_int(value, name: str) -> int | None:
    return None if value is None else check_positive_int(value, name)


def resolve_converted(
    attention: str,
    *,
    chunk_size: int | None = None,
    local_window: int | None = None,
    global_heads: int | None = None,
    gradient_surrogate: float | None = None,
    mixed: bool = False,
    window: int | None = None,
    map_kwargs: dict | None = None,
) -> ConvertedAttention:
    """``attention`` (a model preset, an attention preset or a feature-map name) and the
    caller's overrides -> ``ConvertedAttention`` (module docstring); ``mixed`` and ``window``
    (``sliding_window``'s) as ``convert``'s. Raises ValueError / TypeError naming the
    argument for what a converted layer cannot compute."""
    map_kwargs = dict(map_kwargs or {})
    chunk_size = _optional_int(chunk_size, "chunk_size")
    local_window = _optional_int(local_window, "local_window")
    global_heads = _optional_int(global_heads, "global_heads")
    lam = gradient_surrogate
    if lam is not None and (isinstance(lam, bool) or not isinstance(lam, (int, float))):
        raise TypeError(f"gradient_surrogate must be a float >= 0 or None, got {lam!r}")
    preset = model_preset(attention)
    if preset is not None:
        if mixed:
            raise ValueError(
                f"mixed=True changes the form of an attention; the model preset "
                f"attention={attention!r} sets its own ({preset.attention} beside a window)"
            )
        hybrid = preset.hybrid
        if hybrid.every is not None:
            raise ValueError(
                f"the model preset {attention!r} has its global attention in every "
                f"{hybrid.every}th layer only (global_every), which convert does not map"
            )
        if hybrid.rope is False:
            raise ValueError(
                f"the model preset {attention!r} has no RoPE on its global attention "
                "(global_rope=False): a converted layer's q, k reach it rotated"
            )
        name = preset.attention
        map_kwargs = {**preset.map_kwargs, **map_kwargs}
        local_window = hybrid.window if local_window is None else local_window
        lam = preset.gradient_surrogate if lam is None else lam
        chunk_size = preset.chunk_size if chunk_size is None else chunk_size
    else:
        name = attention
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    lam = 0.0 if lam is None else float(lam)
    if local_window is None and global_heads is not None:
        raise ValueError(
            "global_heads sets the heads of the attention beside a sliding-window branch: "
            "it needs local_window"
        )
    if local_window is not None and name in _EXACT:
        raise ValueError(
            f"local_window adds an exact sliding-window branch beside a linear-time "
            f"attention; attention={attention!r} "
            + (
                "sees every key exactly and decodes from a KV cache"
                if name == "polynomial"
                else "already sees the local keys exactly"
            )  # fmt: skip
        )
    # the spec's form does not depend on the head size: any size resolves it (and checks λ)
    spec = resolve_attention(name, 1, map_kwargs, mixed=mixed, window=window,
                             gradient_surrogate=lam)  # fmt: skip
    if (
        spec.form == "mixed"
        and spec.local == "none"
        and (local_window is None or local_window < chunk_size)
    ):
        raise ValueError(
            f"attention={attention!r} reads only the blocks of chunk_size={chunk_size} before "
            f"each query's own: it needs an exact window of >= chunk_size keys beside it, got "
            f"local_window={local_window}: convert(model, {attention!r}, local_window="
            f"{chunk_size}), or the model preset 'soft_hash_far_local_balanced'"
        )
    return ConvertedAttention(name, chunk_size, local_window, global_heads, lam, map_kwargs)
