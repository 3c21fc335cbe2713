"""Attention specs: ``NAME`` or ``NAME:key=value,...``, as the commands and benchmarks read them.

A spec names a model attention (``polysketch.nn.valid_model_attentions()``: a preset, a model
preset such as ``soft_hash_local``, or a feature map) and optionally keywords, e.g.
``taylor:qk_dim=16`` or ``soft_hash_1k:num_features=320,local_window=64,temperature=8.0``.
Keys in ``MODEL_KEYS`` configure the model (``TransformerConfig``); the others go to the
feature map (``TransformerConfig.map_kwargs``). Values are Python literals where they parse as
one (``256``, ``1e-3``, ``True``), else strings.

* ``parse_attention(spec)`` -> (NAME, model options, map keywords);
* ``split_attentions("a,b:x=1,y=2,c")`` -> ("a", "b:x=1,y=2", "c"): a comma-separated list of
  specs, where an item holding ``=`` and no ``:`` continues the spec before it (a name never
  holds ``=``);
* ``config_options(spec, **defaults)`` -> the ``TransformerConfig`` keywords of the spec;
* ``preset_chunk_size(spec)`` -> the block length a model preset carries for its window.
"""

from __future__ import annotations

from .._checks import parse_key_values
from ..nn import MODEL_PRESETS, valid_model_attentions

__all__ = [
    "MODEL_KEYS",
    "parse_attention",
    "split_attentions",
    "config_options",
    "preset_chunk_size",
]

MODEL_KEYS = (
    "qk_dim", "value_dim", "short_conv", "chunk_size", "qk_norm", "rope", "mixed",
    "learn_balance", "window", "local_window", "local_shared", "global_heads", "global_every",
    "global_rope", "gradient_surrogate",
)  # fmt: skip
"""Keys of an attention spec that configure the model rather than the feature map."""


def parse_attention(spec: str) -> tuple[str, dict, dict]:
    """``"NAME[:key=value,...]"`` -> (NAME, model options, map keywords).

    Keys in ``MODEL_KEYS`` go to the model, the rest to the feature map. Raises ValueError
    naming the spec when it does not parse or NAME is unknown.
    """
    if not isinstance(spec, str):
        raise TypeError(f"attention spec must be a string, got {type(spec).__name__}")
    name, _, rest = spec.partition(":")
    if name not in valid_model_attentions():
        raise ValueError(f"attentions: unknown {name!r} in {spec!r}; choose from "
                         f"{valid_model_attentions()}")  # fmt: skip
    model, maps = {}, {}
    items = rest.split(",") if rest else []
    for key, value in parse_key_values(items, f"attentions {spec!r}").items():
        (model if key in MODEL_KEYS else maps)[key] = value
    return name, model, maps


def split_attentions(text: str) -> tuple[str, ...]:
    """A comma-separated list of specs -> the specs, each checked by ``parse_attention``.

    An item with ``=`` before any ``:`` continues the previous spec's keywords:
    ``"psf_random,soft_hash_1k:num_features=320,temperature=8.0"`` is two specs. Raises
    ValueError for an empty list, a keyword with no spec before it, or a spec that does not
    parse.
    """
    specs: list[str] = []
    for item in (part.strip() for part in str(text).split(",")):
        if not item:
            continue
        if "=" in item.partition(":")[0]:
            if not specs or ":" not in specs[-1]:
                raise ValueError(
                    f"attentions: {item!r} is a keyword with no NAME: before it; write "
                    f"NAME:{item} (e.g. soft_hash_1k:num_features=512)"
                )
            specs[-1] += "," + item
        else:
            specs.append(item)
    if not specs:
        raise ValueError("attentions must name at least one attention, e.g. psf_random,softmax")
    for spec in specs:
        parse_attention(spec)
    return tuple(specs)


def config_options(spec: str, **defaults) -> dict:
    """``TransformerConfig`` keywords of ``spec``: ``attention``, ``map_kwargs`` and the model
    options, over ``defaults`` (e.g. ``chunk_size=64``; the spec's own options win)."""
    name, model_opts, map_kwargs = parse_attention(spec)
    return {**defaults, **model_opts, "attention": name, "map_kwargs": map_kwargs}


def preset_chunk_size(spec: str) -> int | None:
    """The block length ``chunk_size`` of ``spec``: its own ``chunk_size=`` option, else the one
    its model preset carries (``MODEL_PRESETS[NAME]["chunk_size"]``: soft_hash_far_local's
    attention reads only the blocks before each query's own, so its block may not exceed its
    window), else None (the command's default applies)."""
    name, model_opts, _ = parse_attention(spec)
    if "chunk_size" in model_opts:
        return model_opts["chunk_size"]
    return (MODEL_PRESETS.get(name) or {}).get("chunk_size")
