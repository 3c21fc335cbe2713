"""Attention presets of PolySketchFormer and the defaults applied to plain feature-map names.

``resolve_attention(attention, head_dim, map_kwargs, ...)`` turns the ``attention=`` string of
``KernelAttention`` / ``TransformerConfig`` into an ``AttentionSpec``: which algorithm runs
(``"softmax"``, ``"polynomial"``, ``"linear"`` on a feature map, or ``"mixed"``), which map
with which keywords, whether q and k get a LayerNorm, and the normalizer offset.

Presets (``PRESETS``; paper: ``shared/papers/polysketchformer.md``):

* ``psf_random`` — §4: LayerNorm on q and k (public code), the Gaussian degree-2 sketch of
  Ahle et al. with r = 32 (``polysketch``, degree=2, num_features=32,
  projection="gaussian"), self-tensored (``nonnegative=True`` → square → degree 4, Eq. 2,
  Thm 2.5), normalizer 1 + Σ, block lower-triangular algorithm (Thm 3.1) with the layer's
  ``chunk_size`` as block b (the paper uses b = 256). Long context (issue 21,
  ``docs/results/long_context/``): learns no copy from 1024 back on the repeat probe (drop
  0.000 at 300 steps); keeps 0.006 of the weight on an exactly matching key among 4k (the
  sketch's floor, ∝ 1/t).
* ``psf_learned`` — the learned sketch (``learned_polysketch``: two branches of
  LayerNorm→Linear→GELU→Linear blocks, r = 32, expansion 8, 2 levels; square, non-negative),
  LayerNorm on q and k, normalizer 1 + Σ. Long context: 0.001 of the weight on an exact
  match among 4k keys (fitted map); the copy probe was not run.
* ``psf_mixed`` — exact degree-4 polynomial scores inside each block of ``chunk_size`` and
  the ``psf_random`` sketch for all earlier blocks, one shared normalizer 1 + Σ
  (``polysketch.ops.mixed_attention``, the public code's "random_sketch_mixed"), with the
  public code's sketch scale: features × 1/√r (``output_scale``; r follows
  ``num_features``), so the sketched earlier blocks weigh r² less than the exact local
  block. At our unbiased scale the sketch's floor (‖q‖⁴‖k‖⁴/r per key, ``docs/quality_gap.md``)
  summed over the earlier blocks drowned the local block: 2.040 vs 1.989 (softmax 1.995) in
  ``benchmarks/quality.py``; pass ``output_scale=1.0`` for the old behaviour. Long context:
  exact within its block, nothing past it at the probe's budget (copy drop 0.000).
* ``polynomial`` — exact degree-4 polynomial attention with LayerNorm on q and k and
  normalizer 1 + Σ (Eq. 1; quadratic in T). Long context: learns the copy (drop 3.23 at 300
  steps, softmax 3.20 at 200); 0.25 of the weight on an exact match among 4k keys.
* ``soft_hash_1k`` — ours (issue 21 §2, ``docs/results/long_context/screens/``): the
  ``soft_hash`` map (softmax(τ·xW/√D) over F = 1024 learned buckets, τ learned from 4),
  LayerNorm on q and k, normalizer Σ without offset, plain linear attention. The decode state
  is 1024 × (E + 1) per head, 1.9× ``psf_random``'s pair layout. Long context: the one
  linear-time preset that learns the copy from 1024 back (0.67× softmax's drop at 400 steps,
  a perfect copy at 600); 0.045 of the weight on an exact match among 4k keys at init; its
  loss on natural text at context 2048 is 1.22× softmax's after 300 steps (like
  ``psf_random``), and it trains at about 0.3× ``psf_random``'s tokens/s on a CPU. The model
  preset ``soft_hash_local`` runs it with 512 buckets at τ = 8 beside an exact 64-token
  window, which closes the natural-text gap and keeps the copy.
* ``soft_hash_far`` — ours (issue 21 §2): the ``soft_hash`` map with F = 1920 equal-norm buckets
  (``unit_directions``) at initial τ = 10, LayerNorm on q and k, normalizer Σ, read for the keys
  of the blocks of ``chunk_size`` before each query's own only: mixed attention with no in-block
  scores (``ops.mixed_attention(local="none")``), so the linear part skips the b×b×F in-block
  products (about half its cost at F ≫ E). Meant beside an exact window of at least
  ``chunk_size`` keys, which sees the rest (``TransformerConfig`` refuses it without one,
  ``convert`` refuses it); its first block's outputs are 0. Decode state per head F·(E + 1) at
  block boundaries, + (t mod b)·(D + E) between them (the current block's raw keys and values,
  featurized when it completes). Long context (one head beside a 64-token window, values of 64,
  2 × 128 model, ``docs/results/long_context/soft_hash_local/``, 2026-11-25 morning and day):
  0.98 / 0.67 / 0.51× exact degree 4's weight on a match among 4k keys at init (query = key /
  cosine 0.9 / 0.7; mean of four draws, 0.47–0.54 at cosine 0.7); trains at 0.81–0.85×
  ``psf_random``'s tokens/s (4 × 256, T = 2048), 2.00× its state at block boundaries; learned
  the 1024-back copy on seed 2 (0.96× softmax's drop at 400 steps), late on seed 1 (0.41× at
  400, 0.96× at 600) and not on seed 0 (none by 600), so it is not the recommended preset;
  natural text at 2048 0.86–0.91× softmax's loss (seeds 0–2). The soft_hash option
  ``linear_weight`` and the core's ``gradient_surrogate`` give it a gradient towards keys that
  share no bucket with a query; each moved the copy's onset earlier (λ = 10: started on all
  three seeds by 400 steps, ≥ 0.88× softmax's drop on all three by 500), neither to ≥ 0.5× on
  every seed at 400 steps (same page). The model preset ``soft_hash_far_local`` runs it beside
  the window with the surrogate.
* ``softmax`` — exact softmax attention, scale 1/√D (SDPA), no q/k norm.
* ``sliding_window`` — exact attention over the last ``window`` keys only (the local-only
  control of mixed attention): softmax with scale 1/√D and no q/k norm by default, or
  ``kernel="polynomial"`` (exact (q·k)^degree, LayerNorm on q/k, 1 + Σ); O(T·w) by blocks
  (``polysketch.ops.window_attention``), decoded from the last w keys. Long context: none
  past the window, by design.

**Model presets** (``MODEL_PRESETS``; ``TransformerConfig(attention=...)`` and the CLIs, not a
single ``KernelAttention``): an attention preset plus a model option.

* ``soft_hash_local`` — ours, the long-context preset (issue 21 §2): one head of the
  ``soft_hash_1k`` map per layer (``global_heads=1``: q/k of the model's head dim, values of the
  full width) with F = 512 buckets and initial temperature τ = 8 (``map_kwargs``) as the global
  attention, with an exact sliding-window softmax branch of ``n_head`` heads over the last 64 tokens
  beside it in every layer (``TransformerConfig.local_window=64``: its own projections and
  normalizer, outputs summed; BASED's local + global design). The window models the next byte from
  its neighbours, the soft-hash head reads far context with a normalizer of its own. Decode state
  per layer: 512·(n_embd + 1) + H·64·(D + E) floats (1.17× ``psf_random``'s at D = E = 64, H = 2).
  Long context (2 × 128 model, context 2048, seeds 0–2,
  ``docs/results/long_context/soft_hash_local/``): learns the copy from 1024 back through its
  soft_hash head (drop at 400 steps 0.59× / 0.52× / 0.52× softmax's; the branch switched off leaves
  none; none on a fourth seed, 3, where softmax copies at 300 steps); natural-text loss 0.86–0.95×
  that of softmax of the same size after 300 steps; 0.057 of the weight on an exact match among 4k
  keys at init (exact degree 4: 0.25); trains at 0.89–1.00× ``psf_random``'s tokens/s on a CPU (4 ×
  256, T = 2048). Its two-head version (``global_heads=n_head``, the preset until 2026-11-24
  evening) copied at 0.83× / 0.60× / 0.83× at 0.55–0.72× the speed. Evaluated at 32k after training
  at 2048, its loss on [16k, 32k) is −0.06 to +0.15 nats/byte from its first bucket's (softmax's
  rises by 0.33–0.56). Faster forms that learned no copy in 400 steps: 23 × 23 product buckets
  (``factors=2``) with ``local_shared=True`` (``docs/results/long_context/screens/`` 31–36). F =
  1024 at τ = 4 (the first version) copied at 0.98× / 0.33× / 0.90× with 2.1× ``psf_random``'s
  state.
* ``soft_hash_far_local`` — ours, the retrieval preset (issue 21 §2): one ``soft_hash_far`` head
  per layer (F = 1920 equal-norm buckets at initial τ = 10, read for the completed blocks only)
  with values of ⌊29/32 · head dim⌋ (``value_fraction``; 58 for heads of 64) beside the same
  exact 64-token window branch as ``soft_hash_local``, trained with ``gradient_surrogate=50``
  (a training-only gradient, exactly 0 in value, through which a query's gradient reaches keys
  that share no bucket with it; ``nn.core``). Decode state per layer: 1920·(E + 1) at block
  boundaries + (t mod b)·(D + E) between them + the window's H·64·(D + E): at its largest
  1.94× ``psf_random``'s at n_head = 2 (heads of 32, 64 or 128), 1.09× at 4 and 0.66× at 8,
  but 3.7× in a one-head model (``decode_state_size``). Long context (2 × 128 model, context 2048,
  ``docs/results/long_context/soft_hash_local/``, 2026-11-25 and 26): weight on a match among
  4k isotropic keys 0.98 / 0.67 / 0.51× exact degree 4's at init (query = key / cosine 0.9 /
  0.7; mean of four draws) and 0.88–0.97 / 0.61–0.67 / 0.46–0.55× in trained models (λ = 10);
  trains at 0.82–0.96× ``psf_random``'s tokens/s (4 × 256, T = 2048, three runs; the surrogate
  costs the same at any λ > 0). Its λ was 10 until 2026-11-26 evening: copy from 1024 back at
  500 steps 0.89 / 0.88 / 0.98× the largest drop possible on seeds 0 / 1 / 2 (the branch
  switched off leaves none) but none by 700 steps on seed 3; natural text 0.84–0.94× softmax's
  loss of the same size. λ = 30 learned no copy on seed 3 either; λ = 100 copies on all four
  seeds but its natural-text loss is 1.11× softmax's (seed 0). With λ = 50: copy at 500 steps
  0.51 / 0.65 / 0.97 / 0.97× the largest drop possible on seeds 0 / 1 / 2 / 3 (the branch
  switched off leaves none); natural text 0.93 / 0.86 / 0.94× softmax's loss of the same size (seeds
  0–2); trained maps 0.92–0.93 / 0.64–0.65 / 0.51–0.54× exact degree 4 (seed 3). Long-range
  MQAR (T = 1024, F = 128, seeds 0 / 1): 0.109 / 0.081 against BASED's 0.077 / 0.087 at a
  larger state (0.115 with λ = 10 on seed 0).

**Mixed attention with any map** (``mixed=True``, one spelling for ``KernelAttention``,
``TransformerConfig`` and ``integrations.transformers.convert``): the exact local polynomial
(q·k)^degree inside blocks of ``chunk_size`` and the feature map for every earlier block, one
shared normalizer (``polysketch.ops.mixed_attention``); ``psf_mixed`` is its preset with the
``psf_random`` sketch. The local degree is ``degree=`` when the map does not take ``degree``
(``hedgehog``), else the map's own ``degree`` (4 by default); ``qk_norm`` and
``denominator_offset`` default to psf_mixed's (LayerNorm on q/k, 1 + Σ), which the exact
local polynomial needs.

Defaults for a plain feature-map name (``DEFAULTS``): polynomial-kernel maps (``POLYNOMIAL_MAPS``)
get LayerNorm on q/k and offset 1.0 (PolySketchFormer's 1 + Σ); ``polysketch`` defaults to
``nonnegative=True`` (the paper never uses unsquared, signed sketch scores in attention);
softmax-kernel random features (``SOFTMAX_MAPS``) get ``scale=1/√D`` (target exp(q·k/√D))
and offset 0, no norm; other maps (elu, taylor) no norm and offset 0. ``map_kwargs`` given
by the user override every default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..features import available, get_class

__all__ = [
    "PRESETS",
    "MODEL_PRESETS",
    "POLYNOMIAL_MAPS",
    "SOFTMAX_MAPS",
    "SOFTMAX_TARGET_MAPS",
    "AttentionSpec",
    "WINDOW_KERNELS",
    "resolve_attention",
    "valid_attentions",
    "valid_model_attentions",
]

POLYNOMIAL_MAPS = frozenset(available("polynomial"))
"""Maps whose target is a polynomial kernel (declared ``family = "polynomial"``): LayerNorm on
q/k and offset 1 by default."""

SOFTMAX_TARGET_MAPS = frozenset(available("softmax"))
"""Maps whose ``target_kernel`` is exp(scale·q·k) (declared ``family = "softmax"``: random
features and the learned Hedgehog map): ``scale=1/sqrt(D)`` by default, the model's ``scaling``
in the transformers integration. For Hedgehog the scale sets the target of ``fit`` only; its
features do not depend on it."""

SOFTMAX_MAPS = frozenset(n for n in SOFTMAX_TARGET_MAPS if get_class(n).kind != "learned")
"""The estimators among them (random features of exp(scale·q·k), not learned imitations):
``scale=1/sqrt(D)`` by default."""

_PSF_SKETCH = {"degree": 2, "num_features": 32, "projection": "gaussian", "nonnegative": True}
_PSF_LEARNED = {"num_features": 32, "expansion": 8, "levels": 2, "degree": 4}

PRESETS: dict[str, dict] = {
    "psf_random": {
        "description": (
            "PolySketchFormer random sketch: LayerNorm on q/k, Gaussian degree-2 polysketch "
            "with r = 32, nonnegative (self-tensored, square) so scores approximate degree 4, "
            "normalizer 1 + Σ, block lower-triangular algorithm with block = chunk_size "
            "(paper: 256)"
        ),
        "settings": {
            "algorithm": "linear",
            "feature_map": "polysketch",
            "map_kwargs": _PSF_SKETCH,
            "qk_norm": True,
            "denominator_offset": 1.0,
        },
    },
    "psf_learned": {
        "description": (
            "PolySketchFormer learned sketch: learned_polysketch (r = 32, expansion 8, 2 "
            "levels), square and nonnegative, LayerNorm on q/k, normalizer 1 + Σ, block = "
            "chunk_size"
        ),
        "settings": {
            "algorithm": "linear",
            "feature_map": "learned_polysketch",
            "map_kwargs": _PSF_LEARNED,
            "qk_norm": True,
            "denominator_offset": 1.0,
        },
    },
    "psf_mixed": {
        "description": (
            "PolySketchFormer mixed: exact local polynomial degree 4 inside blocks of "
            "chunk_size plus the psf_random sketch (Gaussian degree-2, r = 32, square) at the "
            "public code's scale (features × 1/√r) for earlier blocks, LayerNorm on q/k, "
            "shared normalizer 1 + Σ"
        ),
        "settings": {
            "algorithm": "mixed",
            "feature_map": "polysketch",
            "map_kwargs": _PSF_SKETCH,
            "qk_norm": True,
            "denominator_offset": 1.0,
            "degree": 4,
        },
    },
    "polynomial": {
        "description": (
            "exact polynomial attention of degree 4 with LayerNorm on q/k and normalizer "
            "1 + Σ (quadratic in T)"
        ),
        "settings": {
            "algorithm": "polynomial",
            "qk_norm": True,
            "denominator_offset": 1.0,
            "degree": 4,
        },
    },
    "soft_hash_1k": {
        "description": (
            "soft hashing for long context: soft_hash with F = 1024 learned buckets, initial "
            "temperature 4 (learned), LayerNorm on q/k, normalizer Σ (no offset), linear "
            "attention with a 1024 × (E + 1) state per head (1.9× psf_random's); the only "
            "linear-time preset that learned to copy from 1024 tokens back on the repeat probe"
        ),
        "settings": {
            "algorithm": "linear",
            "feature_map": "soft_hash",
            "map_kwargs": {"num_features": 1024, "temperature": 4.0},
            "qk_norm": True,
            "denominator_offset": 0.0,
        },
    },
    "soft_hash_far": {
        "description": (
            "soft hashing of the completed blocks: soft_hash with F = 1920 learned buckets "
            "(equal-norm directions, initial temperature 10, learned), LayerNorm on q/k, "
            "normalizer Σ; each query reads the keys of the blocks of chunk_size before its "
            "own only (mixed attention with local='none'), for use beside an exact window of "
            ">= chunk_size keys (the model preset soft_hash_local)"
        ),
        "settings": {
            "algorithm": "mixed",
            "local": "none",
            "feature_map": "soft_hash",
            "map_kwargs": {"num_features": 1920, "temperature": 10.0, "unit_directions": True},
            "qk_norm": True,
            "denominator_offset": 0.0,
        },
    },
    "softmax": {
        "description": "exact softmax attention, scale 1/sqrt(D) (SDPA), no q/k norm (quadratic)",
        "settings": {"algorithm": "softmax", "qk_norm": False, "denominator_offset": 0.0},
    },
    "sliding_window": {
        "description": (
            "exact attention over the last w keys (window=w required): softmax with scale "
            "1/sqrt(D), no q/k norm, O(T·w) by blocks, decoded from a KV window of w keys; "
            "kernel=polynomial gives exact (q·k)^degree with LayerNorm on q/k and normalizer "
            "1 + Σ"
        ),
        "settings": {"algorithm": "window", "qk_norm": False, "denominator_offset": 0.0},
    },
}
"""Preset name -> {"description": human-readable text, "settings": what it sets}."""


MODEL_PRESETS: dict[str, dict] = {
    "soft_hash_local": {
        "description": (
            "long context: one head of soft_hash_1k per layer (global_heads=1) with F = 512 "
            "learned buckets and initial temperature 8 (LayerNorm on q/k, normalizer Σ) beside "
            "an exact sliding-window softmax branch over the last 64 tokens in every layer "
            "(local_window=64: own projections and normalizer, outputs summed); learns a copy "
            "from 1024 tokens back and models natural text like softmax at the measured "
            "budget, with a decode state 1.17× psf_random's, training at 0.9× its speed"
        ),
        "attention": "soft_hash_1k",
        "map_kwargs": {"num_features": 512, "temperature": 8.0},
        "local_window": 64,
        "global_heads": 1,
    },
    "soft_hash_far_local": {
        "description": (
            "long context with retrieval: one head of soft_hash_far per layer (F = 1920 "
            "equal-norm buckets at initial temperature 10, reading the completed blocks "
            "only; values of 29/32 the head dim) beside an exact sliding-window softmax "
            "branch over the last 64 tokens, trained with the surrogate gradient at λ = 50 "
            "(exactly 0 in value); at init ≥ 0.5× exact degree 4's weight on a match among 4k "
            "keys, decode state ≤ 2× psf_random's with ≥ 2 heads; learned a copy from 1024 "
            "tokens back on 4 of 4 seeds at 500 steps (0.51× the largest drop on one)"
        ),
        "attention": "soft_hash_far",
        "local_window": 64,
        "chunk_size": 64,
        "global_heads": 1,
        "value_fraction": 29 / 32,
        "gradient_surrogate": 50.0,
    },
}
"""Model preset name -> {"description", "attention": the attention preset of every layer,
"map_kwargs": its feature-map keywords (optional; ``TransformerConfig.map_kwargs`` override
them), "local_window": the window of the branch beside it, "global_heads": the attention's
heads (optional; default n_head), "value_fraction": the attention's per-head values as a
fraction of the model's head dim n_embd / n_head, rounded down (optional; default n_embd /
heads), "gradient_surrogate": λ of its training-only surrogate gradient (optional; default 0),
"chunk_size": the block its window needs (optional: commands whose own default block is
longer take it, ``polysketch.eval.attention_spec.preset_chunk_size``)}
(``TransformerConfig``; each of its fields of the same name, where set, wins)."""


@dataclass(frozen=True)
class AttentionSpec:
    """What a ``KernelAttention`` runs (see ``resolve_attention``)."""

    name: str
    algorithm: str  # "softmax", "polynomial", "linear" or "mixed"
    feature_map: str | None = None
    map_kwargs: dict = field(default_factory=dict)
    qk_norm: bool = False
    denominator_offset: float = 0.0
    degree: int = 4
    local: str = "polynomial"  # "mixed": the in-block kernel (ops.mixed.LOCAL_KERNELS)
    window: int | None = None  # "window": the number of keys each query sees
    window_kernel: str = "softmax"  # "window": "softmax" or "polynomial"


def valid_attentions() -> list[str]:
    """Every accepted ``attention=`` value: presets, then feature-map names."""
    return list(PRESETS) + [n for n in available() if n not in PRESETS]


def valid_model_attentions() -> list[str]:
    """Every accepted ``TransformerConfig(attention=)``: ``valid_attentions()`` and the
    model presets."""
    return valid_attentions() + list(MODEL_PRESETS)


def resolve_attention(
    attention: str,
    head_dim: int,
    map_kwargs: dict,
    *,
    qk_norm: bool | None = None,
    denominator_offset: float | None = None,
    mixed: bool = False,
    window: int | None = None,
    softmax_scale: float | None = None,
) -> AttentionSpec:
    """Turn ``attention`` (+ user overrides) into an ``AttentionSpec``.

    ``map_kwargs`` override the preset's / defaults' map keywords; for ``"polynomial"`` only
    ``degree`` is accepted, for ``"softmax"`` nothing, for ``"sliding_window"`` ``kernel``
    (``"softmax"`` or ``"polynomial"``) and, with the polynomial kernel, ``degree``;
    ``psf_mixed`` also takes ``degree`` (the local exact degree; 4 by default). ``qk_norm`` /
    ``denominator_offset`` of ``None`` take the default of the preset or map kind.
    ``mixed=True`` turns a feature-map attention into mixed attention (module docstring).
    ``window``: the window of ``"sliding_window"`` (required there, refused elsewhere).
    ``softmax_scale``: the ``scale`` given to maps whose target is exp(scale·q·k) unless
    ``map_kwargs`` set it (default 1/√D; the transformers integration passes the model's own).
    """
    if not isinstance(attention, str):
        raise TypeError(f"attention must be a string, got {type(attention).__name__}")
    if not isinstance(mixed, bool):
        raise TypeError(f"mixed must be a bool, got {type(mixed).__name__}")
    kwargs = dict(map_kwargs)
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
        algorithm, fmap = s["algorithm"], s.get("feature_map")
        degree = 4
        norm_default, offset_default = s["qk_norm"], s["denominator_offset"]
        if algorithm == "window":
            algorithm, extra, norm_default, offset_default, degree = _window_settings(
                kwargs, window
            )
        elif s.get("local") == "none":
            if "degree" in kwargs:
                raise ValueError(
                    f"attention={attention!r} has no in-block scores, so no degree: drop "
                    "degree from map_kwargs"
                )
            extra["local"] = "none"
        elif algorithm in ("polynomial", "mixed"):
            degree = kwargs.pop("degree", s["degree"])
        if algorithm in ("polynomial", "softmax") and kwargs:
            raise ValueError(
                f"map_kwargs {sorted(kwargs)} are not accepted by attention={attention!r} "
                "(polynomial takes only degree; softmax takes none)"
            )
        merged = {**s.get("map_kwargs", {}), **kwargs} if fmap else {}
        if attention == "psf_mixed" and "output_scale" not in kwargs:
            merged["output_scale"] = float(merged["num_features"]) ** -0.5  # public code
    elif attention in available():
        algorithm, fmap, degree = "linear", attention, 4
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
        options = "".join(f", {k}={v!r}" for k, v in m.get("map_kwargs", {}).items())
        heads = f", global_heads={m['global_heads']}" if "global_heads" in m else ""
        raise ValueError(
            f"attention={attention!r} is a model preset ({m['attention']}{options} beside an "
            f"exact sliding window of {m['local_window']} tokens{heads}): use it in "
            f"TransformerConfig"
            f"(attention={attention!r}); a single attention layer has no window branch, use "
            f"attention={m['attention']!r}{options} there"
        )
    else:
        raise ValueError(f"attention must be one of {valid_attentions()}, got {attention!r}")
    if fmap in SOFTMAX_TARGET_MAPS and softmax_scale is not None and "scale" not in kwargs:
        merged["scale"] = float(softmax_scale)
    if mixed and algorithm != "mixed":
        if algorithm != "linear":
            raise ValueError(
                f"mixed=True needs a feature-map attention, got attention={attention!r}"
            )
        algorithm = "mixed"
        degree = local_degree if local_degree is not None else merged.get("degree", 4)
    return AttentionSpec(
        name=attention,
        algorithm=algorithm,
        feature_map=fmap,
        map_kwargs=merged,
        qk_norm=norm_default if qk_norm is None else bool(qk_norm),
        denominator_offset=offset_default if denominator_offset is None else denominator_offset,
        degree=degree,
        **extra,
    )


WINDOW_KERNELS = ("softmax", "polynomial")


def _window_settings(kwargs: dict, window) -> tuple:
    """(algorithm, extra spec fields, qk_norm default, offset default, degree) of
    ``"sliding_window"``; pops ``kernel`` and ``degree`` from ``kwargs``."""
    if window is None:
        raise ValueError(
            'attention="sliding_window" needs window=w (the number of most recent keys each '
            "query attends to, itself included)"
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
