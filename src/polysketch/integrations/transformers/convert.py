"""``convert``: swap the self-attention of a transformers causal LM for polysketch attention.

Families and their adapters (``FAMILIES``: where the attention modules are and how they name
their head size): Llama, Qwen2, Mistral (``self_attn``, ``head_dim``), GPT-NeoX
(``attention``, ``head_size``), GPT-2 (``attn``, ``head_dim``). All of them call
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` after projecting q/k/v, applying RoPE
(when the family has it) and updating the cache, so ``convert`` only

1. attaches a ``PolysketchAttention`` (q/k norms, per-head feature maps of that layer) as the
   submodule ``polysketch`` of each attention module — the q/k/v/o weights, the RoPE and the
   GQA layout stay the model's own;
2. switches ``config._attn_implementation`` to ``"polysketch"`` (registered attention
   function, see ``attention.py``);
3. stores the settings in ``config.polysketch`` so ``load_converted(path)`` rebuilds the
   modules after ``from_pretrained`` and loads their tensors from the checkpoint;
4. makes ``generate`` decode from a ``PolysketchCache`` (constant-size state) by default,
   and refuses, before computing anything, a cache the attention cannot decode with
   (``cache.check_cache``: static, sliding, quantized, ...);
5. says what happens to a sliding window or to logit soft-capping (``policies``:
   ``sliding_window="refuse"|"full"``, ``softcap="refuse"|"drop"``);
6. derives ``position_ids`` from a 2D ``attention_mask`` when a forward gets none
   (``positions``), so a left-padded batch equals each row alone without them.

Other causal LMs whose attention modules have ``layer_idx``, ``scaling`` and ``head_dim`` (or
``head_size``) and use the attention interface go through the generic adapter.
"""

from __future__ import annotations

import json
import logging
import types
from pathlib import Path

import torch
from torch import nn

from ..._checks import check_int, check_positive_int
from ...nn.resolve import valid_model_attentions
from .attention import ATTENTION_NAME, PolysketchAttention
from .cache import PolysketchCache, check_cache
from .hybrid import ConvertedAttention, resolve_converted
from .policies import check_policies, configured_window, install_cache_guards, register
from .positions import install_position_ids

__all__ = [
    "FAMILIES",
    "attention_modules",
    "convert",
    "converted_cores",
    "load_converted",
    "polysketch_settings",
]

CONFIG_KEY = "polysketch"
"""The attribute of ``model.config`` holding the conversion settings (saved in config.json)."""

FAMILIES: dict[str, str] = {
    "llama": "self_attn",
    "qwen2": "self_attn",
    "mistral": "self_attn",
    "gpt_neox": "attention",
    "gpt2": "attn",
}
"""model_type -> name of the self-attention submodule of each decoder layer."""


def _head_dim(module: nn.Module) -> int | None:
    for name in ("head_dim", "head_size"):
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value
    return None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of ``model`` in layer order (raises for unsupported models)."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            "model must be a decoder-only causal LM (encoder-decoders are not supported)"
        )
    attr = FAMILIES.get(getattr(config, "model_type", None))
    found = []
    for name, module in model.named_modules():
        if attr is not None:
            ok = name.rsplit(".", 1)[-1] == attr and hasattr(module, "layer_idx")
        else:  # generic adapter: attention modules of the interface's shape
            ok = (
                type(module).__name__.endswith("Attention")
                and isinstance(getattr(module, "layer_idx", None), int)
                and hasattr(module, "scaling")
                and _head_dim(module) is not None
            )
        if ok:
            if getattr(module, "is_cross_attention", False):
                raise ValueError("cross-attention cannot be converted (decoder-only models only)")
            found.append(module)
    if not found:
        raise ValueError(
            f"found no self-attention modules in {type(model).__name__} "
            f"(model_type={getattr(config, 'model_type', None)!r}; supported: {sorted(FAMILIES)})"
        )
    return sorted(found, key=lambda m: m.layer_idx)


def converted_cores(model: nn.Module) -> list[PolysketchAttention]:
    """The ``PolysketchAttention`` modules ``convert`` attached, in order (raises if none)."""
    cores = [m for m in model.modules() if isinstance(m, PolysketchAttention)]
    if not cores:
        raise ValueError("model has no polysketch attention: call convert(model) first")
    return cores


def polysketch_settings(model: nn.Module) -> dict | None:
    """The settings ``convert`` stored in ``model.config`` (None if not converted)."""
    settings = getattr(model.config, CONFIG_KEY, None)
    return dict(settings) if settings else None


def _check_settings(
    attention,
    chunk_size,
    seed,
    qk_norm,
    denominator_offset,
    mixed,
    map_kwargs,
    *,
    learn_balance=False,
    window=None,
    local_window=None,
    global_heads=None,
    gradient_surrogate=None,
    sliding_window="refuse",
    softcap="refuse",
) -> tuple[dict, ConvertedAttention]:
    """The settings ``convert`` stores (concrete: a model preset's window, block and λ
    resolved) and what each layer computes (``hybrid.resolve_converted``), checked."""
    if not isinstance(attention, str):
        raise TypeError(f"attention must be a string, got {type(attention).__name__}")
    if attention not in valid_model_attentions():
        raise ValueError(f"attention must be one of {valid_model_attentions()}, got {attention!r}")
    for name, flag in (("mixed", mixed), ("learn_balance", learn_balance)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    for name, value in (("window", window), ("local_window", local_window),
                        ("global_heads", global_heads)):  # fmt: skip
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if qk_norm is not None and not isinstance(qk_norm, bool):
        raise TypeError(f"qk_norm must be a bool or None, got {type(qk_norm).__name__}")
    if denominator_offset is not None:
        if isinstance(denominator_offset, bool) or not isinstance(denominator_offset, (int, float)):
            raise TypeError("denominator_offset must be a float or None")
        denominator_offset = float(denominator_offset)
    try:
        json.dumps(map_kwargs)
    except TypeError as err:
        raise TypeError(
            f"map_kwargs must be JSON-serializable (saved in config.json): {err}"
        ) from None
    layer = resolve_converted(
        attention, chunk_size=chunk_size, local_window=local_window, global_heads=global_heads,
        gradient_surrogate=gradient_surrogate, mixed=mixed, window=window,
        map_kwargs=map_kwargs,
    )  # fmt: skip
    settings = {
        "attention": attention,
        "chunk_size": layer.chunk_size,
        "seed": check_int(seed, "seed", minimum=0),
        "qk_norm": qk_norm,
        "denominator_offset": denominator_offset,
        "mixed": mixed,
        "learn_balance": learn_balance,
        "window": window,
        "local_window": layer.local_window,
        "global_heads": layer.global_heads,
        "gradient_surrogate": layer.gradient_surrogate,
        "sliding_window": sliding_window,
        "softcap": softcap,
        "map_kwargs": dict(map_kwargs),
    }
    return settings, layer


def convert(
    model: nn.Module,
    attention: str = "psf_mixed",
    *,
    chunk_size: int | None = None,
    seed: int = 0,
    qk_norm: bool | None = None,
    denominator_offset: float | None = None,
    mixed: bool = False,
    learn_balance: bool = False,
    window: int | None = None,
    local_window: int | None = None,
    global_heads: int | None = None,
    gradient_surrogate: float | None = None,
    sliding_window: str = "refuse",
    softcap: str = "refuse",
    **map_kwargs,
) -> nn.Module:
    """Replace the self-attention of ``model`` (in place) by polysketch attention; returns it.

    Args:
        model: a transformers decoder-only causal LM (Llama, Qwen2, Mistral, GPT-NeoX, GPT-2
            families; others whose attention modules share their shape).
        attention: ``"softmax"`` (the model's own attention, bit-for-bit up to SDPA rounding),
            ``"polynomial"``, ``psf_random``, ``psf_learned``, ``psf_mixed`` (default), the
            other attention presets (``polysketch.nn.PRESETS``), any
            ``polysketch.features.available()`` name, or a model preset
            (``soft_hash_local``, ``soft_hash_far_local``: its attention beside an exact
            sliding-window softmax branch in every layer, ``hybrid``).
        chunk_size: block of the chunked algorithm and of the mixed forms' blocks (None: a
            model preset's own, else 64).
        seed: base seed of the per-layer, per-head feature maps.
        qk_norm: trainable LayerNorm on q and k per head (None: on for polynomial kernels and
            presets, off for softmax and softmax random features, which use the model's
            ``scaling`` as their temperature).
        denominator_offset: the normalizer's offset (None: 1 for polynomial kernels, else 0).
        mixed: with a feature-map name, psf_mixed's form with that map: exact (q·k)^degree
            inside blocks of ``chunk_size``, the map (e.g. a learnable one) for earlier blocks.
        learn_balance: mixed attention's learned per-head balance (``polysketch.nn.core``).
        window: w of ``attention="sliding_window"`` (exact attention over the last w keys).
        local_window: an exact sliding-window softmax branch over the last w keys beside the
            attention, outputs summed per head (``hybrid``; None: a model preset's own, else
            none). Required by ``soft_hash_far`` (w >= chunk_size), which reads only the
            blocks before each query's own.
        global_heads: with a window branch, the attention runs on query heads 0..g-1 only
            (None: every head; ``hybrid``).
        gradient_surrogate: λ of the training-only surrogate gradient of ``soft_hash_far``
            (exactly 0 in value; None: a model preset's own, else 0).
        sliding_window: what happens to a model's sliding window (Mistral, Qwen3, Phi-3,
            Gemma): ``"refuse"`` (default: ValueError) or ``"full"`` (every layer attends to
            all earlier tokens); see ``policies``. ``softmax`` keeps the window regardless.
        softcap: what happens to attention logit soft-capping (Gemma-2) in kernelized
            modes: ``"refuse"`` (default) or ``"drop"``; ``softmax`` keeps it exactly.
        **map_kwargs: keywords of the feature map (e.g. ``num_features=64``).

    The new parameters (q/k norms, learnable maps) are created in the dtype and on the device
    of the attention module's weights. A converted model can be converted again (the old
    polysketch modules are replaced).
    """
    settings, layer = _check_settings(
        attention, chunk_size, seed, qk_norm, denominator_offset, mixed, map_kwargs,
        learn_balance=learn_balance, window=window, local_window=local_window,
        global_heads=global_heads, gradient_surrogate=gradient_surrogate,
        sliding_window=sliding_window, softcap=softcap,
    )  # fmt: skip
    modules = attention_modules(model)
    config = model.config.get_text_config(decoder=True)
    check_policies(config, attention, sliding_window, softcap)
    num_heads = check_positive_int(config.num_attention_heads, "config.num_attention_heads")
    if layer.global_heads is not None and layer.global_heads > num_heads:
        raise ValueError(f"global_heads={layer.global_heads} > the model's {num_heads} query heads")
    register()
    for module in modules:
        ref = next(module.parameters())
        core = PolysketchAttention(
            layer.attention,
            head_dim=_head_dim(module),
            num_heads=num_heads,
            layer_index=module.layer_idx,
            scaling=float(getattr(module, "scaling", _head_dim(module) ** -0.5)),
            chunk_size=layer.chunk_size,
            qk_norm=settings["qk_norm"],
            denominator_offset=settings["denominator_offset"],
            seed=settings["seed"],
            mixed=settings["mixed"],
            learn_balance=settings["learn_balance"],
            window=settings["window"],
            gradient_surrogate=layer.gradient_surrogate,
            local_window=layer.local_window,
            global_heads=layer.global_heads,
            **layer.map_kwargs,
        )
        core.drop_softcap = settings["softcap"] == "drop"
        if "polysketch" in module._modules:
            del module._modules["polysketch"]
        module.polysketch = core.to(device=ref.device, dtype=ref.dtype)
    setattr(model.config, CONFIG_KEY, settings)
    if config is not model.config:
        setattr(config, CONFIG_KEY, settings)
    model.set_attn_implementation(ATTENTION_NAME)
    _install_generate_cache(model, modules[0].polysketch, configured_window(config) is not None)
    install_cache_guards(model, modules)
    install_position_ids(model)
    return model


def _install_generate_cache(model: nn.Module, core: PolysketchAttention, window: bool) -> None:
    """Make ``generate`` create the cache ``core`` decodes with unless the caller passes one
    (a ``PolysketchCache`` for state attentions; a full ``DynamicCache`` for ``polynomial``
    in a model with sliding layers), and refuse an unsupported one before the prefill."""
    cls_method = type(model)._prepare_cache_for_generation
    if core.form == "softmax":  # the model's own attention and caches
        model.__dict__.pop("_prepare_cache_for_generation", None)
        return

    key = _generate_cache_key()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        default = (
            model_kwargs.get(key) is None
            and generation_config.use_cache is not False
            and generation_config.cache_implementation is None
        )
        if default and core.uses_state_cache:
            model_kwargs[key] = PolysketchCache(self)
        elif default and window:  # the window is dropped: keep every key and value
            from transformers import DynamicCache

            model_kwargs[key] = DynamicCache()
        out = cls_method(self, generation_config, model_kwargs, *args, **kwargs)
        check_cache(model_kwargs.get(key), core)
        return out

    model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)


def _generate_cache_key() -> str:
    """The ``model_kwargs`` key under which ``generate`` keeps its cache: ``past_key_values``
    up to transformers 5.23, ``cache`` from 5.24 (which deprecates ``past_key_values``); the
    first of ``transformers.generation.utils.ALL_CACHE_NAMES`` in both."""
    from transformers.generation import utils

    names = getattr(utils, "ALL_CACHE_NAMES", None)
    return names[0] if names else "past_key_values"


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The polysketch tensors of a saved checkpoint (safetensors, sharded or not; or .bin)."""
    out: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for f in files:
            out.update({k: v for k, v in load_file(str(f)).items() if ".polysketch." in k})
        return out
    for f in sorted(path.glob("pytorch_model*.bin")):
        state = torch.load(f, map_location="cpu", weights_only=True)
        out.update({k: v for k, v in state.items() if ".polysketch." in k})
    return out


class _HeldLoadReport(logging.Filter):
    """Holds back transformers' LOAD REPORT for one path, to be shown only if it matters."""

    def __init__(self, path: str):
        super().__init__()
        self.path, self.held = path, []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "LOAD REPORT" in message and self.path in message:
            self.held.append(record)
            return False
        return True


def _from_pretrained_quietly(model_class, path: str, **kwargs):
    """``from_pretrained`` without its LOAD REPORT when the report only lists the polysketch
    tensors as UNEXPECTED (the original architecture has no place for them; ``load_converted``
    loads them next). Any other finding (missing, mismatched, other unexpected keys) is
    reported as transformers reports it. Returns (model, loading info)."""
    logger = logging.getLogger("transformers.modeling_utils")
    hold = _HeldLoadReport(path)
    logger.addFilter(hold)
    try:
        model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    finally:
        logger.removeFilter(hold)
    only_ours = (
        not info.get("missing_keys")
        and not info.get("mismatched_keys")
        and not info.get("error_msgs")
        and all(".polysketch." in key for key in info.get("unexpected_keys", ()))
    )
    if not only_ours:
        for record in hold.held:
            logger.handle(record)
    return model, info


def load_converted(
    path,
    *,
    model_class=None,
    sliding_window: str | None = None,
    softcap: str | None = None,
    **from_pretrained_kwargs,
) -> nn.Module:
    """Load a model saved after ``convert`` (``save_pretrained``) with its polysketch modules.

    transformers' ``from_pretrained`` builds the original architecture; this then
    ``convert``s it with the settings saved in ``config.json`` and loads the polysketch
    tensors. transformers' LOAD REPORT, which lists those tensors as UNEXPECTED, is silenced
    when they are all it lists (a report of anything else is shown). ``model_class`` defaults
    to ``AutoModelForCausalLM``; extra keywords go to ``from_pretrained``
    (``output_loading_info=True`` returns ``(model, loading_info)`` as there).
    ``sliding_window`` / ``softcap``: the policies of ``convert`` for a model saved before they
    were recorded (the saved ones win otherwise).
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"path must be a directory written by save_pretrained, got {str(path)!r}")
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    register()
    from_pretrained_kwargs.setdefault("attn_implementation", "sdpa")
    want_info = bool(from_pretrained_kwargs.pop("output_loading_info", False))
    model, info = _from_pretrained_quietly(model_class, str(path), **from_pretrained_kwargs)
    settings = polysketch_settings(model)
    if settings is None:
        raise ValueError(f"{str(path)!r} holds no polysketch settings (config.{CONFIG_KEY})")
    convert(
        model,
        settings["attention"],
        chunk_size=settings["chunk_size"],
        seed=settings["seed"],
        qk_norm=settings["qk_norm"],
        denominator_offset=settings["denominator_offset"],
        mixed=settings.get("mixed", False),
        learn_balance=settings.get("learn_balance", False),
        window=settings.get("window"),
        local_window=settings.get("local_window"),
        global_heads=settings.get("global_heads"),
        gradient_surrogate=settings.get("gradient_surrogate"),
        sliding_window=settings.get("sliding_window", sliding_window or "refuse"),
        softcap=settings.get("softcap", softcap or "refuse"),
        **settings["map_kwargs"],
    )
    tensors = _checkpoint_tensors(path)
    expected = {k for k in model.state_dict() if ".polysketch." in k}
    missing = sorted(expected - set(tensors))
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks polysketch tensors, e.g. {missing[:3]}")
    model.load_state_dict({k: tensors[k] for k in expected}, strict=False)
    return (model, info) if want_info else model
