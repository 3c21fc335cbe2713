"""Names in, specs out: the one place an attention name is resolved.

* ``resolve_attention(attention, head_dim, map_kwargs, options)`` -> ``AttentionSpec``: a
  preset (``PRESETS``) or a feature-map name (``MAP_ROWS``), with the user's attention options
  (``ATTENTION_OPTIONS``: the option fields of ``AttentionSpec`` and ``mixed=True``, which
  turns any map into mixed attention, PolySketchFormer's psf_mixed form), one mapping checked
  against those fields.
* ``resolve_model(config)`` -> ``ModelSpec``: a ``TransformerConfig``'s attention, a model
  preset (``MODEL_PRESETS``) expanded, its window branch and per-head sizes.
* ``resolve_converted(attention, ...)`` -> ``LayerSpec``: what one converted layer of a Hugging
  Face model computes, from the same names, presets and options, with the differences a
  layer that keeps the model's own projections has (``CONVERTED_DIFFERENCES``).
* ``parse_attention("NAME:key=value,...")`` and friends: the text form the commands and
  benchmarks read (``taylor:qk_dim=16``, ``soft_hash_1k:num_features=320,local_window=64``).

Everything below (``AttentionCore``, ``Block``, the transformers adapter, sharding, caches)
reads the specs; nothing else reads the preset tables.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from .._checks import check_positive_int, parse_key_values
from ..features import get_class
from .presets import MAP_ROWS, MODEL_PRESETS, PRESETS, AttentionPreset, ModelPreset
from .spec import (
    ATTENTION_OPTIONS,
    OPTION_FIELDS,
    WINDOW_KERNELS,
    AttentionSpec,
    HybridSpec,
    LayerSpec,
    ModelSpec,
)

__all__ = [
    "CONVERTED_DIFFERENCES",
    "HYBRID_OPTIONS",
    "MODEL_KEYS",
    "as_spec",
    "check_options",
    "config_options",
    "model_preset",
    "parse_attention",
    "preset_chunk_size",
    "resolve_attention",
    "resolve_converted",
    "resolve_model",
    "split_attentions",
    "split_options",
    "valid_attentions",
    "valid_model_attentions",
]

HYBRID_OPTIONS = ("local_window", "local_shared", "global_heads", "global_every", "global_rope",
                  "global_out_init", "global_out_tied")  # fmt: skip
"""The options of the window branch beside an attention (``HybridSpec``; ``TransformerConfig``
fields; ``convert`` takes them too, by ``CONVERTED_DIFFERENCES``)."""


def valid_attentions() -> list[str]:
    """Every accepted ``attention=`` of one layer: presets, then feature-map names."""
    return list(PRESETS) + list(MAP_ROWS)


def valid_model_attentions() -> list[str]:
    """Every accepted ``TransformerConfig(attention=)``: ``valid_attentions()`` and the model
    presets."""
    return valid_attentions() + list(MODEL_PRESETS)


def check_options(options: Mapping | None, allowed=None, what="attention") -> dict:
    """``options`` as a dict, every key one of ``allowed`` (default ``ATTENTION_OPTIONS``;
    ValueError naming the unknown keys and the known ones)."""
    allowed = ATTENTION_OPTIONS if allowed is None else allowed
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"{what} options must be a mapping, got {type(options).__name__}")
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {what} options {unknown}: the options are {list(allowed)} "
                         "(polysketch.nn.ATTENTION_OPTIONS; feature-map keywords go to "
                         "map_kwargs)")  # fmt: skip
    return dict(options)


def split_options(keywords: Mapping, hybrid: bool = False) -> tuple[dict, dict, dict]:
    """One keyword mapping (``KernelAttention(**kw)``, ``convert(model, name, **kw)``) ->
    (attention options, window-branch options, feature-map keywords): a key is an attention
    option when it is in ``ATTENTION_OPTIONS``, a window-branch option when ``hybrid`` and in
    ``HYBRID_OPTIONS``, else a keyword of the feature map."""
    options, branch, maps = {}, {}, {}
    for key, value in keywords.items():
        if key in ATTENTION_OPTIONS:
            options[key] = value
        elif hybrid and key in HYBRID_OPTIONS:
            branch[key] = value
        else:
            maps[key] = value
    return options, branch, maps


def _row(attention) -> AttentionPreset:
    """The table row of an attention name (ValueError for a model preset or an unknown name)."""
    if not isinstance(attention, str):
        raise TypeError(f"attention must be a string, got {type(attention).__name__}")
    row = PRESETS.get(attention) or MAP_ROWS.get(attention)
    if row is not None:
        return row
    if attention in MODEL_PRESETS:
        m = MODEL_PRESETS[attention]
        options = "".join(f", {k}={v!r}" for k, v in m.map_kwargs.items())
        heads = f", global_heads={m.hybrid.heads}" if m.hybrid.heads is not None else ""
        raise ValueError(
            f"attention={attention!r} is a model preset ({m.attention}{options} beside an "
            f"exact sliding window of {m.hybrid.window} tokens{heads}): use it in "
            f"TransformerConfig(attention={attention!r}); a single attention layer has no "
            f"window branch, use attention={m.attention!r}{options} there"
        )
    raise ValueError(f"attention must be one of {valid_attentions()}, got {attention!r}")


def resolve_attention(
    attention: str,
    head_dim: int,
    map_kwargs: Mapping | None = None,
    options: Mapping | None = None,
    **more_options,
) -> AttentionSpec:
    """Turn ``attention`` (a preset or a feature-map name) and the user's overrides into an
    ``AttentionSpec``.

    ``map_kwargs`` override the row's map keywords; for ``"polynomial"`` only ``degree`` is
    accepted, for ``"softmax"`` nothing, for ``"sliding_window"`` ``kernel`` (``"softmax"`` or
    ``"polynomial"``) and, with the polynomial kernel, ``degree``; the mixed forms take
    ``degree`` (the local exact degree; 4 by default). ``options`` (and ``more_options``, the
    same mapping as keywords) are attention options, each a key of ``ATTENTION_OPTIONS``
    (``polysketch.nn.spec``; an unknown key is refused naming them); None means not given (the
    row's default). ``mixed=True`` turns a feature-map attention into mixed attention; its
    local degree is ``degree=`` when the map takes no degree (hedgehog), else the map's.
    ``window``: the window of ``"sliding_window"`` (required there, refused elsewhere).
    ``softmax_scale``: the scale of softmax scores, and the ``scale`` of maps whose target is
    exp(scale·q·k) unless ``map_kwargs`` set it (default 1/√D; the transformers integration
    passes the model's own). ``chunk_size``: the block (default ``DEFAULT_CHUNK_SIZE``).
    """
    row = _row(attention)
    opts = check_options({**(options or {}), **more_options})
    mixed = opts.get("mixed") or False
    qk_norm, offset = opts.get("qk_norm"), opts.get("denominator_offset")
    window, softmax_scale = opts.get("window"), opts.get("softmax_scale")
    for name in ("mixed", "learn_balance"):
        if opts.get(name) is not None and not isinstance(opts[name], bool):
            raise TypeError(f"{name} must be a bool, got {type(opts[name]).__name__}")
    if qk_norm is not None and not isinstance(qk_norm, bool):
        raise TypeError(f"qk_norm must be a bool or None, got {type(qk_norm).__name__}")
    kwargs = dict(map_kwargs or {})
    if window is not None and row.form != "window":
        raise ValueError(f'window= is an option of attention="sliding_window", not {attention!r}')
    if mixed:  # psf_mixed's form: its local polynomial needs normalized q, k (and 1 + Σ)
        qk_norm = True if qk_norm is None else qk_norm
        offset = 1.0 if offset is None else offset
    local_degree = None
    if mixed and "degree" in kwargs and row.feature_map is not None and row.form == "linear" \
            and not get_class(row.feature_map).takes("degree"):  # fmt: skip
        local_degree = kwargs.pop("degree")  # only the exact local blocks have a degree
    form, fmap, degree, extra = row.form, row.feature_map, row.degree, {}
    norm_default, offset_default = row.qk_norm, row.denominator_offset
    if form == "window":
        form, extra, norm_default, offset_default, degree = _window_settings(kwargs, window)
    elif row.local == "none":
        if "degree" in kwargs:
            raise ValueError(
                f"attention={attention!r} has no in-block scores, so no degree: drop "
                "degree from map_kwargs"
            )
        extra["local"] = "none"
    elif form in ("polynomial", "mixed"):
        degree = kwargs.pop("degree", row.degree)
    if form in ("polynomial", "softmax") and kwargs:
        raise ValueError(
            f"map_kwargs {sorted(kwargs)} are not accepted by attention={attention!r} "
            "(polynomial takes only degree; softmax takes none)"
        )
    merged = {**row.map_kwargs, **kwargs} if fmap else {}
    if row.output_scale_per_feature and "output_scale" not in kwargs:
        merged["output_scale"] = float(merged["num_features"]) ** -0.5  # public code
    if row.softmax_target and "scale" not in kwargs:
        merged["scale"] = (
            float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )
    if mixed and form != "mixed":
        if form != "linear":
            raise ValueError(
                f"mixed=True needs a feature-map attention, got attention={attention!r}"
            )
        form = "mixed"
        degree = local_degree if local_degree is not None else merged.get("degree", 4)
    # every other option field is the spec's as given (None: its default): adding such an
    # option needs no line here (polysketch.nn.spec, "Options")
    passed = {k: v for k, v in opts.items()
              if k in OPTION_FIELDS and k not in _DEFAULTED and v is not None}  # fmt: skip
    return AttentionSpec(
        name=attention,
        form=form,
        feature_map=fmap,
        map_kwargs=merged,
        qk_norm=norm_default if qk_norm is None else qk_norm,
        denominator_offset=offset_default if offset is None else offset,
        degree=degree,
        **extra,
        **passed,
    )


_DEFAULTED = ("qk_norm", "denominator_offset", "window")
"""The option fields whose default depends on the row (or on ``mixed``): set above."""


def as_spec(attention, head_dim: int, map_kwargs: Mapping | None = None,
            options: Mapping | None = None) -> AttentionSpec:  # fmt: skip
    """``attention`` as an ``AttentionSpec``: resolved by ``resolve_attention`` with
    ``map_kwargs`` and ``options`` (only those the caller gave) when it is a name, returned as
    it is when it is a spec already (then nothing may be given beside it: it is all in the
    spec)."""
    if not isinstance(attention, AttentionSpec):
        return resolve_attention(attention, head_dim, map_kwargs, options)
    given = sorted({**(options or {}), **(map_kwargs or {})})
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
    (an attention preset, a feature map, softmax)."""
    return MODEL_PRESETS.get(name) if isinstance(name, str) else None


def _expand(name: str, map_kwargs: Mapping | None, options: Mapping):
    """(attention name, map keywords, attention options, the preset's ``HybridSpec`` or None)
    of ``name``: a model preset's attention, keywords and options under the user's (a user's
    option of None is not given), or the name as it is."""
    preset = model_preset(name)
    opts = {k: v for k, v in options.items() if v is not None}
    if preset is None:
        return name, dict(map_kwargs or {}), opts, None
    if opts.get("mixed"):
        raise ValueError(
            f"mixed=True changes the form of an attention; the model preset "
            f"attention={name!r} sets its own ({preset.attention} beside a window)"
        )
    own = {"gradient_surrogate": preset.gradient_surrogate, "chunk_size": preset.chunk_size}
    own = {k: v for k, v in own.items() if v is not None}
    return preset.attention, {**preset.map_kwargs, **(map_kwargs or {})}, {**own, **opts}, \
        preset.hybrid  # fmt: skip


def _check_exact_beside_window(attention: str, name: str) -> None:
    """A window branch goes beside a linear-time attention only (ValueError for an exact one:
    softmax, the window itself, exact polynomial attention)."""
    form = _row(name).form
    if form in ("softmax", "window", "polynomial"):
        why = ("sees every key exactly" if form == "polynomial"
               else "already sees the local keys exactly")  # fmt: skip
        raise ValueError(
            f"local_window adds an exact sliding-window branch beside a linear-time attention; "
            f"attention={attention!r} {why}"
        )


def _check_far_window(spec: AttentionSpec, name: str, window: int | None) -> None:
    """An attention that reads only the blocks before each query's own (mixed, no in-block
    scores) needs an exact window of >= chunk_size keys beside it (ValueError naming the fix)."""
    if spec.form != "mixed" or spec.local != "none":
        return
    b = spec.chunk_size
    if window is not None and window >= b:
        return
    fix = (f"local_window >= {b}, or a model preset that carries one, e.g. "
           "soft_hash_far_local_balanced" if window is None
           else f"chunk_size <= {window}, or local_window >= {b}")  # fmt: skip
    raise ValueError(
        f"attention={name!r} reads only the blocks of chunk_size={b} before each query's own: "
        f"it needs an exact window of >= chunk_size keys beside it, got local_window={window} "
        f"({fix})"
    )


def resolve_model(config) -> ModelSpec:
    """A ``TransformerConfig``'s ``ModelSpec``: its attention (a model preset expanded, the
    config's fields of the same meaning winning: every ``ATTENTION_OPTIONS`` field the config
    has, by name), the window branch beside it and the attention's heads, per-head sizes and
    RoPE (``polysketch.nn.spec``). Raises ValueError / TypeError naming the field when the
    combination is not one the model can run."""
    given = {k: getattr(config, k) for k in ATTENTION_OPTIONS if hasattr(config, k)}
    name, map_kwargs, opts, base = _expand(config.attention, config.map_kwargs, given)
    window = config.local_window if config.local_window is not None else (
        None if base is None else base.window
    )  # fmt: skip
    base = HybridSpec(window=1) if base is None else base  # window: placeholder
    hybrid = None
    head_dim = config.n_embd // config.n_head
    if window is None:
        for field_name in ("global_heads", "global_every", "global_rope", "global_out_init",
                           "global_out_tied"):  # fmt: skip
            if getattr(config, field_name) is not None:
                raise ValueError(_needs_window(field_name))
        if config.local_shared:
            raise ValueError(_needs_window("local_shared"))
        heads, rope, value_dim = config.n_head, config.rope, config.value_dim
    else:
        _check_exact_beside_window(config.attention, name)
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
    attention = resolve_attention(name, qk_dim or config.n_embd // heads, map_kwargs, opts)
    _check_far_window(attention, name, window)
    local = None
    if hybrid is not None:
        local = resolve_attention("sliding_window", head_dim, None,
                                  {"window": hybrid.window, "chunk_size": attention.chunk_size})
    return ModelSpec(attention=attention, heads=heads, qk_dim=qk_dim, value_dim=value_dim,
                     rope=rope, hybrid=hybrid, window_attention=local)  # fmt: skip


CONVERTED_DIFFERENCES = {
    "global_heads": "a converted layer cannot add heads: the attention reads the model's own "
    "q, k, v of query heads 0..g-1 (the others are the window alone; g above the model's query "
    "heads is refused); by default, and for a model preset's heads, every query head",
    "softmax_scale": "a converted layer's softmax scale is the model's own scaling of that "
    "layer: refused when given",
    "value_fraction": "the values are the model's own v of each head (a model preset's value "
    "width does not apply)",
    "global_out_init": "a converted layer has no output projection of its own (the model's "
    "o_proj follows both branches): refused when given, a preset's is not applied",
    "global_out_tied": "as global_out_init: refused when given, a preset's (the tied presets) "
    "is not applied, so they convert as their untied form",
    "local_shared": "the branches always share the model's projections (the shared form): "
    "True is what it is, False is refused",
    "global_rope": "the attention reads the model's rotated q, k: False is refused",
}
"""Where a converted layer (``resolve_converted``) differs from a ``TransformerLM`` layer of the
same name and options, by design; every other (name, option) pair is accepted or refused
alike (``tests/test_resolve_parity.py`` asserts both)."""


def resolve_converted(
    attention: str,
    *,
    head_dim: int,
    num_heads: int,
    scaling: float,
    map_kwargs: Mapping | None = None,
    options: Mapping | None = None,
    branch: Mapping | None = None,
    layer_index: int = 0,
    n_layer: int = 1,
) -> LayerSpec:
    """What layer ``layer_index`` of a converted model computes: ``attention`` (a model preset,
    an attention preset or a feature-map name) with the user's map keywords, attention
    options (``ATTENTION_OPTIONS``) and window-branch options (``branch``: ``local_window``,
    ``global_heads``, ``global_every`` and the others of ``HYBRID_OPTIONS`` by
    ``CONVERTED_DIFFERENCES``), on a layer of ``num_heads`` query heads of ``head_dim`` whose
    softmax scale is ``scaling`` (the model's; maps whose target is exp(s·q·k) get it as
    their ``scale``, the window's softmax too).

    A model preset is expanded as ``resolve_model`` expands it (its map keywords, λ, block
    and window, under the user's). A layer that ``global_every`` leaves without the attention
    computes the window alone. Raises ValueError / TypeError naming the option for what a
    converted layer cannot compute."""
    opts = check_options(options)
    branch = check_options(branch, HYBRID_OPTIONS, "window-branch")
    for key in ("local_window", "global_heads", "global_every"):
        if branch.get(key) is not None:
            check_positive_int(branch[key], key)
    if opts.get("softmax_scale") is not None:
        raise ValueError("softmax_scale of a converted layer is the model's own scaling")
    name, kwargs, opts, base = _expand(attention, map_kwargs, opts)
    for key in ("global_out_init", "global_out_tied"):
        if branch.get(key) is not None:
            raise ValueError(f"{key}: {CONVERTED_DIFFERENCES[key]}")
    if branch.get("local_shared") is False:
        raise ValueError(f"local_shared=False: {CONVERTED_DIFFERENCES['local_shared']}")
    rope = branch.get("global_rope", None if base is None else base.rope)
    if rope is False:
        raise ValueError(f"global_rope=False: {CONVERTED_DIFFERENCES['global_rope']}")
    window = branch.get("local_window")
    if window is None and base is not None:
        window = base.window
    every = branch.get("global_every")
    if every is None and base is not None:
        every = base.every
    heads = branch.get("global_heads")  # a preset's heads: every query head (module docstring)
    if window is None:
        for key in ("global_heads", "global_every", "global_rope"):
            if branch.get(key) is not None:
                raise ValueError(_needs_window(key))
        if branch.get("local_shared"):
            raise ValueError(_needs_window("local_shared"))
    else:
        HybridSpec(window=window, heads=heads, every=every)  # checks the values
        _check_exact_beside_window(attention, name)
        if every is not None and every > n_layer:
            raise ValueError(f"global_every={every} > the model's {n_layer} layers leaves no "
                             "layer with the global attention")  # fmt: skip
        if heads is not None and heads > num_heads:
            raise ValueError(f"global_heads={heads} > the model's {num_heads} query heads")
    spec = resolve_attention(name, head_dim, kwargs, {**opts, "softmax_scale": float(scaling)})
    _check_far_window(spec, attention, window)
    if window is None:
        return LayerSpec(attention=spec)
    local = resolve_attention("sliding_window", head_dim, None,
                              {"window": window, "chunk_size": spec.chunk_size,
                               "softmax_scale": float(scaling)})  # fmt: skip
    if every is not None and (layer_index + 1) % every:  # global_every: the window alone
        return LayerSpec(attention=local)
    return LayerSpec(attention=spec, window_attention=local, global_heads=heads)


def _needs_window(field_name: str) -> str:
    what = {
        "global_heads": "sets the heads of the attention beside a sliding-window branch",
        "global_every": "leaves some layers to the sliding-window branch alone",
        "global_rope": "sets RoPE of the attention beside a sliding-window branch",
        "global_out_init": "scales the initial output projection of the attention beside a "
        "sliding-window branch",
        "global_out_tied": "ties the initial output projection of the attention beside a "
        "sliding-window branch to its values",
    }
    if field_name == "local_shared":
        return "local_shared=True needs a sliding-window branch (local_window)"
    return f"{field_name} {what[field_name]}: it needs local_window"


# ----- the text form: NAME[:key=value,...] -------------------------------------------------------
MODEL_KEYS = ("qk_dim", "value_dim", "short_conv", "rope", "recompute", *ATTENTION_OPTIONS,
              *HYBRID_OPTIONS)  # fmt: skip
"""Keys of a text spec that configure the model (``TransformerConfig``) rather than the map:
its structure, the attention options and the window branch's."""


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
    """The block length ``chunk_size`` a text spec sets: its own ``chunk_size=`` option, else
    the one its model preset carries (``ModelPreset.chunk_size``: soft_hash_far_local's
    attention reads only the blocks before each query's own, so its block may not exceed its
    window), else None (``DEFAULT_CHUNK_SIZE``, or a command's own, applies)."""
    name, model_opts, _ = parse_attention(spec)
    return _expand(name, None, {"chunk_size": model_opts.get("chunk_size")})[2].get("chunk_size")
