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
  ``chunk_size`` as block b (the paper uses b = 256).
* ``psf_learned`` — the learned sketch (``learned_polysketch``: two branches of
  LayerNorm→Linear→GELU→Linear blocks, r = 32, expansion 8, 2 levels; square, non-negative),
  LayerNorm on q and k, normalizer 1 + Σ.
* ``psf_mixed`` — exact degree-4 polynomial scores inside each block of ``chunk_size`` and
  the ``psf_random`` sketch for all earlier blocks, one shared normalizer 1 + Σ
  (``polysketch.ops.mixed_attention``, the public code's "random_sketch_mixed"), with the
  public code's sketch scale: features × 1/√r (``output_scale``; r follows
  ``num_features``), so the sketched earlier blocks weigh r² less than the exact local
  block. At our unbiased scale the sketch's floor (‖q‖⁴‖k‖⁴/r per key, ``docs/quality_gap.md``)
  summed over the earlier blocks drowned the local block: 2.040 vs 1.989 (softmax 1.995) in
  ``benchmarks/quality.py``; pass ``output_scale=1.0`` for the old behaviour.
* ``polynomial`` — exact degree-4 polynomial attention with LayerNorm on q and k and
  normalizer 1 + Σ (Eq. 1; quadratic in T).
* ``softmax`` — exact softmax attention, scale 1/√D (SDPA), no q/k norm.

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
    "POLYNOMIAL_MAPS",
    "SOFTMAX_MAPS",
    "SOFTMAX_TARGET_MAPS",
    "AttentionSpec",
    "resolve_attention",
    "valid_attentions",
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
    "softmax": {
        "description": "exact softmax attention, scale 1/sqrt(D) (SDPA), no q/k norm (quadratic)",
        "settings": {"algorithm": "softmax", "qk_norm": False, "denominator_offset": 0.0},
    },
}
"""Preset name -> {"description": human-readable text, "settings": what it sets}."""


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


def valid_attentions() -> list[str]:
    """Every accepted ``attention=`` value: presets, then feature-map names."""
    return list(PRESETS) + [n for n in available() if n not in PRESETS]


def resolve_attention(
    attention: str,
    head_dim: int,
    map_kwargs: dict,
    *,
    qk_norm: bool | None = None,
    denominator_offset: float | None = None,
) -> AttentionSpec:
    """Turn ``attention`` (+ user overrides) into an ``AttentionSpec``.

    ``map_kwargs`` override the preset's / defaults' map keywords; for ``"polynomial"`` only
    ``degree`` is accepted, for ``"softmax"`` nothing; ``psf_mixed`` also takes ``degree``
    (the local exact degree; 4 by default). ``qk_norm`` / ``denominator_offset`` of ``None``
    take the default of the preset or map kind.
    """
    if not isinstance(attention, str):
        raise TypeError(f"attention must be a string, got {type(attention).__name__}")
    kwargs = dict(map_kwargs)
    if attention in PRESETS:
        s = PRESETS[attention]["settings"]
        algorithm, fmap = s["algorithm"], s.get("feature_map")
        degree = 4
        if algorithm in ("polynomial", "mixed"):
            degree = kwargs.pop("degree", s["degree"])
        if algorithm in ("polynomial", "softmax") and kwargs:
            raise ValueError(
                f"map_kwargs {sorted(kwargs)} are not accepted by attention={attention!r} "
                "(polynomial takes only degree; softmax takes none)"
            )
        merged = {**s.get("map_kwargs", {}), **kwargs} if fmap else {}
        norm_default, offset_default = s["qk_norm"], s["denominator_offset"]
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
    else:
        raise ValueError(f"attention must be one of {valid_attentions()}, got {attention!r}")
    return AttentionSpec(
        name=attention,
        algorithm=algorithm,
        feature_map=fmap,
        map_kwargs=merged,
        qk_norm=norm_default if qk_norm is None else bool(qk_norm),
        denominator_offset=offset_default if denominator_offset is None else denominator_offset,
        degree=degree,
    )
