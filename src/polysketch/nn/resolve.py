"""Names in, specs out: the one place an attention name is resolved.

* ``resolve_attention(attention, head_dim, map_kwargs, ...)`` -> ``AttentionSpec``: a preset
  (``PRESETS``) or a feature-map name, with the user's overrides (``mixed=True`` turns any map
  into mixed attention, PolySketchFormer's psf_mixed form; ``window=`` for
  ``sliding_window``).
* ``resolve_model(config)`` -> ``ModelSpec``: a ``TransformerConfig``'s attention, a model
  preset (``MODEL_PRESETS``) expanded, its window branch and per-head sizes.
* ``parse_attention("NAME:key=value,...")`` and friends: the text form the commands and
  benchmarks read (``taylor:qk_dim=16``, ``soft_hash_1k:num_features=320,local_window=64``).

Everything below (``AttentionCore``, ``Block``, the transformers adapter, sharding, caches)
reads the specs; nothing else reads the preset tables.
"""

from __future__ import annotations

import math

from .._checks import parse_key_values
from ..features import available, get_class
from .presets import MODEL_PRESETS, POLYNOMIAL_MAPS, PRESETS, SOFTMAX_TARGET_MAPS, ModelPreset
from .spec import WINDOW_KERNELS, AttentionSpec, HybridSpec, ModelSpec

__all__ = [
    "MODEL_KEYS",
    "as_spec",
    "config_options",
    "model_preset",
    "parse_attention",
    "preset_chunk_size",
    "resolve_attention",
    "resolve_model",
    "split_attentions",
    "valid_attentions",
    "valid_model_attentions",
]


def valid_attentions() -> list[str]:
    """Every accepted ``attention=`` of one layer: presets, then feature-map names."""
    return list(PRESETS) + [n for n in available() if n not in PRESETS]


def valid_model_attentions() -> list[str]:
    """Every accepted ``TransformerConfig(attention=)``: ``valid_attentions()`` and the model
    presets."""
    return valid_attentions() + list(MODEL_PRESETS)


def resolve_attention(
    attention: str,
    head_dim: int,
    map_kwargs: dict | None = None,
    *,
    qk_norm: bool | None = None,
    denominator_offset: float | None = None,
    mixed: bool = False,
    window: int | None = None,
    learn_balance: bool = False,
    gradient_surrogate: float = 0.0,
    softmax_scale: float | None = None,
) -> AttentionSpec:
    """Turn ``attention`` (+ user overrides) into an ``AttentionSpec``.

    ``map_kwargs`` override the preset's / defaults' map keywords; for ``"polynomial"`` only
    ``degree`` is accepted, for ``"softmax"`` nothing, for ``"sliding_window"`` ``kernel``
    (``"softmax"`` or ``"polynomial"``) and, with the polynomial kernel, ``degree``;
    ``psf_mixed`` also takes ``degree`` (the local exact degree; 4 by default). ``qk_norm`` /
    ``denominator_offset`` of ``None`` take the default of the preset or map kind.
    ``mixed=True`` turns a feature-map attention into mixed attention (``polysketch.nn.spec``);
    its local degree is ``degree=`` when the map takes no degree (hedgehog), else the map's.
    ``window``: the window of ``"sliding_window"`` (required there, refused elsewhere).
    ``softmax_scale``: the scale of softmax scores, and the ``scale`` given to maps whose
    target is exp(scale·q·k) unless ``map_kwargs`` set it (default 1/√D; the transformers
    integration passes the model's own). ``learn_balance`` / ``gradient_surrogate``: options
    of mixed attention (``AttentionSpec``).
    """
    if not isinstance(attention, str):
        raise TypeError(f"attention must be a string, got {type(attention).__name__}")
    if not isinstance(mixed, bool):
        raise TypeError(f"mixed must be a bool, got {type(mixed).__name__}")
    if not isinstance(learn_balance, bool):
        raise TypeError(f"learn_balance must be a bool, got {type(learn_balance).__name__}")
    if qk_norm is not None and not isinstance(qk_norm, bool):
        raise TypeError(f"qk_norm must be a bool or None, got {type(qk_norm).__name__}")
    kwargs = dict(map_kwargs or {})
    if window is not None and attention != "sliding_window":
        raise ValueError(f'window= is an option of attention="sliding_window", not {attention!r}')
    if mixed:  # psf_mixed's form: its local polynomial needs normalized q, k (and 1 + Σ)
        qk_norm = True if qk_norm is None else qk_norm
        denominator_offset = 1.0 if denominator_offset is None else denominator_offset
    local_degree = None
    if (
        mixed
        and "degree" in kwargs
        and attention in available()
        and not get_class(attention).takes("degree")
    ):
        local_degree = kwargs.pop("degree")  # only the exact local blocks have a degree
    extra: dict = {}
    if attention in PRESETS:
        s = PRESETS[attention]["settings"]
        form, fmap = s["form"], s.get("feature_map")
        degree = 4
        norm_default, offset_default = s["qk_norm"], s["denominator_offset"]
        if form == "window":
            form, extra, norm_default, offset_default, degree = _window_settings(kwargs, window)
        elif s.get("local") == "none":
            if "degree" in kwargs:
                raise ValueError(
                    f"attention={attention!r} has no in-block scores, so no degree: drop "
                    "degree from map_kwargs"
                )
            extra["local"] = "none"
        elif form in ("polynomial", "mixed"):
            degree = kwargs.pop("degree", s["degree"])
        if form in ("polynomial", "softmax") and kwargs:
            raise ValueError(
                f"map_kwargs {sorted(kwargs)} are not accepted by attention={attention!r} "
                "(polynomial takes only degree; softmax takes none)"
            )
        merged = {**s.get("map_kwargs", {}), **kwargs} if fmap else {}
        if attention == "psf_mixed" and "output_scale" not in kwargs:
            merged["output_scale"] = float(merged["num_features"]) ** -0.5  # public code
    elif attention in available():
        form, fmap, degree = "linear", attention, 4
        defaults: dict = {}
        if attention == "polysketch":
            defaults["nonnegative"] = True
        if attention in SOFTMAX_TARGET_MAPS:
            defaults["scale"] = 1.0 / math.sqrt(head_dim)
        merged = {**defaults, **kwargs}
        polynomial = attention in POLYNOMIAL_MAPS
        norm_default, offset_default = polynomial, 1.0 if polynomial else 0.0
    elif attention in MODEL_PRESETS:
        m = MODEL_PRESETS[attention]
        options = "".join(f", {k}={v!r}" for k, v in m.map_kwargs.items())
        heads = f", global_heads={m.hybrid.heads}" if m.hybrid.heads is not None else ""
        raise ValueError(
            f"attention={attention!r} is a model preset ({m.attention}{options} beside an "
            f"exact sliding window of {m.hybrid.window} tokens{heads}): use it in "
            f"TransformerConfig(attention={attention!r}); a single attention layer has no "
            f"window branch, use attention={m.attention!r}{options} there"
        )
    else:
        raise ValueError(f"attention must be one of {valid_attentions()}, got {attention!r}")
    if fmap in SOFTMAX_TARGET_MAPS and softmax_scale is not None and "scale" not in kwargs:
        merged["scale"] = float(softmax_scale)
    if mixed and form != "mixed":
        if form != "linear":
            raise ValueError(
                f"mixed=True needs a feature-map attention, got attention={attention!r}"
            )
        form = "mixed"
        degree = local_degree if local_degree is not None else merged.get("degree", 4)
    return AttentionSpec(
        name=attention,
        form=form,
        feature_map=fmap,
        map_kwargs=merged,
        qk_norm=norm_default if qk_norm is None else qk_norm,
        denominator_offset=offset_default if denominator_offset is None else denominator_offset,
        degree=degree,
        learn_balance=learn_balance,
        gradient_surrogate=gradient_surrogate,
        softmax_scale=softmax_scale,
        **extra,
    )


def as_spec(attention, head_dim: int, map_kwargs: dict | None = None, **options) -> AttentionSpec:
    """``attention`` as an ``AttentionSpec``: resolved by ``resolve_attention`` with
    ``map_kwargs`` and ``options`` when it is a name, returned as it is when it is a spec
    already (then no option may be given beside it: they are part of the spec)."""
    if not isinstance(attention, AttentionSpec):
        return resolve_attention(attention, head_dim, map_kwargs, **options)
    defaults = {
        "qk_norm": None,
        "denominator_offset": None,
        "mixed": False,
        "window": None,
        "learn_balance": False,
        "gradient_surrogate": 0.0,
        "softmax_scale": None,
    }
    given = sorted(k for k, v in options.items() if v != defaults.get(k, object()))
    given += sorted(map_kwargs or {})
    if given:
        raise ValueError(
            f"attention is an AttentionSpec: {given} are part of the spec, not options beside it"
        )
    return attention


def _window_settings(kwargs: dict, window) -> tuple:
    """(form, extra spec fields, qk_norm default, offset default, degree) of
    ``"sliding_window"``; pops ``kernel`` and ``degree`` from ``kwargs``."""
    if "window" in kwargs:
        raise ValueError(
            'window is not a feature-map keyword: give attention="sliding_window" its window as '
            "window=w (TransformerConfig, KernelAttention, convert; polysketch train --window W)"
        )
    if window is None:
        raise ValueError(
            'attention="sliding_window" needs window=w (the number of most recent keys each '
            "query attends to, itself included; polysketch train --window W)"
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    kernel = kwargs.pop("kernel", "softmax")
    if kernel not in WINDOW_KERNELS:
        raise ValueError(f"kernel must be one of {WINDOW_KERNELS}, got {kernel!r}")
    degree = 4
    if kernel == "polynomial":
        degree = kwargs.pop("degree", 4)
    if kwargs:
        raise ValueError(
            f'map_kwargs {sorted(kwargs)} are not accepted by attention="sliding_window" '
            '(it takes kernel="softmax"|"polynomial" and, with the polynomial kernel, degree)'
        )
    polynomial = kernel == "polynomial"
    extra = {"window": window, "window_kernel": kernel}
    return "window", extra, polynomial, 1.0 if polynomial else 0.0, degree


def model_preset(name) -> ModelPreset | None:
    """The ``ModelPreset`` named ``name`` (``MODEL_PRESETS``), or None for any other name
    (an attention preset, a feature map, softmax): how the layers outside ``nn`` (``convert``,
    the CLI) ask whether a name carries a window branch."""
    return MODEL_PRESETS.get(name) if isinstance(name, str) else None


def resolve_model(config) -> ModelSpec:
    """A ``TransformerConfig``'s ``ModelSpec``: its attention (a model preset expanded, the
    config's fields of the same meaning winning), the window branch beside it and the
    attention's heads, per-head sizes and RoPE (``polysketch.nn.spec``). Raises ValueError /
    TypeError naming the field when the combination is not one the model can run."""
    preset = MODEL_PRESETS.get(config.attention)
    name = config.attention if preset is None else preset.attention
    base = HybridSpec(window=1) if preset is None else preset.hybrid  # window: placeholder
    window = config.local_window if config.local_window is not None else (
        None if preset is None else base.window
    )  # fmt: skip
    lam = config.gradient_surrogate
    if lam is None:
        lam = 0.0 if preset is None else preset.gradient_surrogate
    map_kwargs = {**({} if preset is None else preset.map_kwargs), **config.map_kwargs}
    hybrid = None
    head_dim = config.n_embd // config.n_head
    if window is None:
        global_fields = ("global_heads", "global_every", "global_rope", "global_out_init",
                         "global_out_tied")  # fmt: skip
        for field_name in global_fields:
            if getattr(config, field_name) is not None:
                raise ValueError(_needs_window(field_name))
        if config.local_shared:
            raise ValueError("local_shared=True needs a sliding-window branch (local_window)")
        heads, rope, value_dim = config.n_head, config.rope, config.value_dim
    else:
        if name in ("softmax", "sliding_window"):
            raise ValueError(
                f"local_window adds a sliding-window branch beside a linear-time attention; "
                f"attention={config.attention!r} already sees the local keys exactly"
            )
        pick = {  # the config's field where set, else the preset's
            "heads": config.global_heads if config.global_heads is not None else base.heads,
            "every": config.global_every if config.global_every is not None else base.every,
            "rope": config.global_rope if config.global_rope is not None else base.rope,
            "shared": config.local_shared if config.local_shared is not None else base.shared,
            "out_init": (
                config.global_out_init if config.global_out_init is not None else base.out_init
            ),
            "out_tied": (
                config.global_out_tied if config.global_out_tied is not None else base.out_tied
            ),
        }
        hybrid = HybridSpec(window=window, value_fraction=base.value_fraction, **pick)
        if hybrid.rope and not config.rope:
            raise ValueError("global_rope=True with rope=False: RoPE is off in the model")
        if hybrid.every is not None and hybrid.every > config.n_layer:
            raise ValueError(f"global_every={hybrid.every} > n_layer={config.n_layer} leaves "
                             "no layer with the global attention")  # fmt: skip
        heads = config.n_head if hybrid.heads is None else hybrid.heads
        rope = config.rope if hybrid.rope is None else hybrid.rope
        hybrid = HybridSpec(**{**hybrid.to_dict(), "heads": heads, "rope": rope})
        value_dim = config.value_dim
        if value_dim is None and hybrid.value_fraction is not None:
            value_dim = max(1, math.floor(hybrid.value_fraction * head_dim))
        if hybrid.shared and value_dim is not None:
            raise ValueError("local_shared=True shares one q/k/v projection between the "
                             "branches: value_dim must stay None (the heads' width)")  # fmt: skip
        if hybrid.shared and heads != config.n_head:
            raise ValueError(f"local_shared=True needs global_heads = n_head ({config.n_head}): "
                             f"the branches share one q/k/v projection, got {heads}")  # fmt: skip
    if config.n_embd % heads:
        raise ValueError(f"n_embd={config.n_embd} must be divisible by global_heads={heads}")
    qk_dim = config.qk_dim
    if heads != config.n_head and qk_dim is None:  # the model's head dim, not n_embd / g
        qk_dim = head_dim
    attention = resolve_attention(
        name, qk_dim or config.n_embd // heads, map_kwargs, qk_norm=config.qk_norm,
        mixed=config.mixed, window=config.window, learn_balance=config.learn_balance,
        gradient_surrogate=lam,
    )  # fmt: skip
    if (
        attention.form == "mixed"
        and attention.local == "none"
        and (window is None or window < config.chunk_size)
    ):
        fix = (
            "a model preset that carries one, e.g. soft_hash_far_local_balanced"
            if window is None
            else f"chunk_size <= {window}, or local_window >= {config.chunk_size}"
        )
        raise ValueError(
            f"attention={name!r} reads only the blocks of chunk_size={config.chunk_size} "
            f"before each query's own: it needs an exact window of >= chunk_size keys beside "
            f"it, got local_window={window} ({fix})"
        )
    local = None if hybrid is None else resolve_attention("sliding_window", head_dim,
                                                            window=hybrid.window)  # fmt: skip
    return ModelSpec(attention=attention, heads=heads, qk_dim=qk_dim, value_dim=value_dim,
                     rope=rope, hybrid=hybrid, window_attention=local)  # fmt: skip


def _needs_window(field_name: str) -> str:
    what = {
        "global_heads": "sets the heads of the attention beside a sliding-window branch",
        "global_every": "leaves some layers to the sliding-window branch alone",
        "global_rope": "sets RoPE of the attention beside a sliding-window branch",
        "global_out_init": "scales the initial output projection of the attention beside a "
        "sliding-window branch",
        "global_out_tied": "ties the initial output projection of the attention beside a "
        "sliding-window branch to its values",
    }[field_name]
    return f"{field_name} {what}: it needs local_window"


# ----- the text form: NAME[:key=value,...] -------------------------------------------------------
MODEL_KEYS = (
    "qk_dim", "value_dim", "short_conv", "chunk_size", "qk_norm", "rope", "mixed",
    "learn_balance", "window", "local_window", "local_shared", "global_heads", "global_every",
    "global_rope", "global_out_init", "global_out_tied", "gradient_surrogate", "recompute",
)  # fmt: skip
"""Keys of a text spec that configure the model (``TransformerConfig``) rather than the map."""


def parse_attention(spec: str) -> tuple[str, dict, dict]:
    """``"NAME[:key=value,...]"`` -> (NAME, model options, map keywords).

    NAME is one of ``valid_model_attentions()``; keys in ``MODEL_KEYS`` go to the model, the
    rest to the feature map; values are Python literals where they parse as one (``256``,
    ``1e-3``, ``True``), else strings. Raises ValueError naming the spec when it does not
    parse or NAME is unknown.
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
    """A comma-separated list of text specs -> the specs, each checked by ``parse_attention``.

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
    """``TransformerConfig`` keywords of a text spec: ``attention``, ``map_kwargs`` and the
    model options, over ``defaults`` (e.g. ``chunk_size=64``; the spec's own options win)."""
    name, model_opts, map_kwargs = parse_attention(spec)
    return {**defaults, **model_opts, "attention": name, "map_kwargs": map_kwargs}


def preset_chunk_size(spec: str) -> int | None:
    """The block length ``chunk_size`` of a text spec: its own ``chunk_size=`` option, else
    the one its model preset carries (``ModelPreset.chunk_size``: soft_hash_far_local's
    attention reads only the blocks before each query's own, so its block may not exceed its
    window), else None (the command's default applies)."""
    name, model_opts, _ = parse_attention(spec)
    if "chunk_size" in model_opts:
        return model_opts["chunk_size"]
    preset = model_preset(name)
    return None if preset is None else preset.chunk_size
