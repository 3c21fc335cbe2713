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
3. stores the settings in ``config.polysketch`` (each layer's ``LayerSpec``, resolved by
   ``polysketch.nn.resolve``) so ``load_converted(path)`` rebuilds the modules after
   ``from_pretrained`` and loads their tensors from the checkpoint;
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
from ...nn.resolve import HYBRID_OPTIONS, resolve_converted, split_options
from ...nn.spec import ATTENTION_OPTIONS, LayerSpec
from .attention import ATTENTION_NAME, PolysketchAttention
from .cache import PolysketchCache, check_cache
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


SETTINGS_FORMAT = 2
"""``config.polysketch["format"]``: 2 stores each layer's ``LayerSpec`` (``layers``); settings
without it (format 1, before 2026-12-07) are the keywords convert was called with."""


def _json(value, what: str):
    try:
        json.dumps(value)
    except TypeError as err:
        raise TypeError(f"{what} must be JSON-serializable (saved in config.json): {err}") from None
    return value


def convert(
    model: nn.Module,
    attention: str = "psf_mixed",
    *,
    seed: int = 0,
    sliding_window: str = "refuse",
    softcap: str = "refuse",
    **options,
) -> nn.Module:
    """Replace the self-attention of ``model`` (in place) by polysketch attention; returns it.

    Args:
        model: a transformers decoder-only causal LM (Llama, Qwen2, Mistral, GPT-NeoX, GPT-2
            families; others whose attention modules share their shape).
        attention: ``"softmax"`` (the model's own attention, bit-for-bit up to SDPA rounding),
            ``"polynomial"``, ``psf_random``, ``psf_learned``, ``psf_mixed`` (default), the
            other attention presets (``polysketch.nn.PRESETS``), any
            ``polysketch.features.available()`` name, or a model preset
            (``soft_hash_local``, ``soft_hash_far_local_balanced``, ...: its attention beside
            an exact sliding-window softmax branch in every layer).
        seed: base seed of the per-layer, per-head feature maps.
        sliding_window: what happens to a model's sliding window (Mistral, Qwen3, Phi-3,
            Gemma): ``"refuse"`` (default: ValueError) or ``"full"`` (every layer attends to
            all earlier tokens); see ``policies``. ``softmax`` keeps the window regardless.
        softcap: what happens to attention logit soft-capping (Gemma-2) in kernelized
            modes: ``"refuse"`` (default) or ``"drop"``; ``softmax`` keeps it exactly.
        **options: by name, as ``TransformerConfig`` takes them
            (``polysketch.nn.resolve.split_options``): the attention options
            (``polysketch.nn.ATTENTION_OPTIONS``: ``chunk_size`` (default: a model preset's,
            else 64), ``qk_norm`` (default on for polynomial kernels and presets, off for
            softmax and its random features, which use the model's ``scaling`` as their
            temperature), ``denominator_offset``, ``mixed`` (a map's mixed form: exact
            (q·k)^degree inside blocks, the map before them), ``learn_balance``,
            ``gradient_surrogate``, ``window`` (w of ``sliding_window``)); the window
            branch's (``local_window``: an exact sliding-window softmax over the last w keys
            beside the attention, required by ``soft_hash_far`` with w >= chunk_size;
            ``global_heads``: the attention on query heads 0..g-1 only; ``global_every``:
            only every K-th layer has the attention, the others the window alone; where a
            converted layer differs from a ``TransformerLM`` one:
            ``polysketch.nn.resolve.CONVERTED_DIFFERENCES``); every other keyword goes to the
            feature map (e.g. ``num_features=64``).

    Each layer's ``LayerSpec`` (``polysketch.nn.resolve.resolve_converted``, the model's
    ``scaling`` of that layer) is stored in ``config.polysketch["layers"]`` (saved in
    config.json), from which ``load_converted`` rebuilds the layers. The new parameters (q/k
    norms, learnable maps) are created in the dtype and on the device of the attention
    module's weights. A converted model can be converted again (the old polysketch modules
    are replaced).
    """
    if not isinstance(attention, str):
        raise TypeError(f"attention must be a string, got {type(attention).__name__}")
    seed = check_int(seed, "seed", minimum=0)
    opts, branch, map_kwargs = split_options(options, hybrid=True)
    _json(map_kwargs, "map_kwargs")
    _json(opts, "options")
    modules = attention_modules(model)
    config = model.config.get_text_config(decoder=True)
    num_heads = check_positive_int(config.num_attention_heads, "config.num_attention_heads")
    specs = [
        resolve_converted(
            attention, head_dim=_head_dim(m), num_heads=num_heads,
            scaling=float(getattr(m, "scaling", _head_dim(m) ** -0.5)), map_kwargs=map_kwargs,
            options=opts, branch=branch, layer_index=m.layer_idx, n_layer=len(modules),
        )  # fmt: skip
        for m in modules
    ]
    check_policies(config, _main_attention(specs), sliding_window, softcap)
    settings = {
        "format": SETTINGS_FORMAT,
        "attention": attention,
        "options": {**opts, **branch},
        "map_kwargs": dict(map_kwargs),
        "seed": seed,
        "sliding_window": sliding_window,
        "softcap": softcap,
        "layers": [spec.to_dict() for spec in specs],
    }
    _build(model, modules, specs, settings)
    return model


def _main_attention(specs: list[LayerSpec]):
    """The attention the layers were converted to (a layer that ``global_every`` leaves to its
    window alone computes the window's)."""
    full = [s for s in specs if s.window_attention is not None]
    return (full or specs)[0].attention


def _build(model, modules, specs, settings) -> None:
    """Attach each layer's ``PolysketchAttention`` and switch the model to it."""
    config = model.config.get_text_config(decoder=True)
    num_heads = check_positive_int(config.num_attention_heads, "config.num_attention_heads")
    register()
    for module, spec in zip(modules, specs, strict=True):
        ref = next(module.parameters())
        core = PolysketchAttention(spec, head_dim=_head_dim(module), num_heads=num_heads,
                                   layer_index=module.layer_idx, seed=settings["seed"])  # fmt: skip
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


def _format1_options(settings: dict, sliding_window, softcap) -> dict:
    """``convert``'s keywords from settings stored before 2026-12-07 (format 1: the options
    convert took, each written out, None where not given)."""
    names = (*ATTENTION_OPTIONS, *HYBRID_OPTIONS)
    out = {k: v for k, v in settings.items() if k in names and v is not None}
    return {**out, **settings["map_kwargs"], "seed": settings["seed"],
            "sliding_window": settings.get("sliding_window", sliding_window or "refuse"),
            "softcap": settings.get("softcap", softcap or "refuse")}  # fmt: skip


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
    if settings.get("format", 1) >= 2:
        specs = [LayerSpec.from_dict(d) for d in settings["layers"]]
        modules = attention_modules(model)
        if len(specs) != len(modules):
            raise ValueError(f"{str(path)!r} stores {len(specs)} layer specs for a model of "
                             f"{len(modules)} attention layers")  # fmt: skip
        settings.setdefault("sliding_window", sliding_window or "refuse")
        settings.setdefault("softcap", softcap or "refuse")
        config = model.config.get_text_config(decoder=True)
        check_policies(config, _main_attention(specs), settings["sliding_window"],
                       settings["softcap"])  # fmt: skip
        _build(model, modules, specs, settings)
    else:  # format 1: the keywords convert was called with
        convert(model, settings["attention"], **_format1_options(settings, sliding_window,
                                                                 softcap))  # fmt: skip
    tensors = _checkpoint_tensors(path)
    expected = {k for k in model.state_dict() if ".polysketch." in k}
    missing = sorted(expected - set(tensors))
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks polysketch tensors, e.g. {missing[:3]}")
    model.load_state_dict({k: tensors[k] for k in expected}, strict=False)
    return (model, info) if want_info else model
