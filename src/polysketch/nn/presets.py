"""The preset tables: PolySketchFormer's attentions, ours, and model presets.

``PRESETS`` names an attention (``KernelAttention(attention=...)``, ``TransformerConfig``,
``convert``); ``MODEL_PRESETS`` names a model's attention with the window branch beside it
(``TransformerConfig`` and the commands only). ``polysketch.nn.resolve`` reads these tables,
once, into specs (``polysketch.nn.spec``); nothing else reads them. What each preset is and
what was measured of it: ``docs/results/presets.md`` (paper: PolySketchFormer §4–5).

Defaults for a plain feature-map name (``resolve_attention``): polynomial-kernel maps
(``POLYNOMIAL_MAPS``) get LayerNorm on q/k and offset 1 (PolySketchFormer's 1 + Σ);
``polysketch`` defaults to ``nonnegative=True`` (the paper never uses unsquared, signed sketch
scores in attention); softmax-kernel maps (``SOFTMAX_TARGET_MAPS``) get ``scale=1/√D`` (target
exp(q·k/√D)) and offset 0, no norm; other maps (elu, taylor) no norm and offset 0. The user's
``map_kwargs`` override every default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..features import available, get_class
from .spec import FrozenMap, HybridSpec

__all__ = [
    "PRESETS",
    "MODEL_PRESETS",
    "ModelPreset",
    "POLYNOMIAL_MAPS",
    "SOFTMAX_MAPS",
    "SOFTMAX_TARGET_MAPS",
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
"""The estimators among them (random features of exp(scale·q·k), not learned imitations)."""

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
            "form": "linear",
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
            "form": "linear",
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
            "form": "mixed",
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
            "form": "polynomial",
            "qk_norm": True,
            "denominator_offset": 1.0,
            "degree": 4,
        },
    },
    "soft_hash_1k": {
        "description": (
            "soft hashing for long context: soft_hash with F = 1024 learned buckets, initial "
            "temperature 4 (learned), LayerNorm on q/k, normalizer Σ (no offset), linear "
            "attention with a 1024 × (E + 1) state per head (1.9× psf_random's)"
        ),
        "settings": {
            "form": "linear",
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
            ">= chunk_size keys (the model preset soft_hash_far_local)"
        ),
        "settings": {
            "form": "mixed",
            "local": "none",
            "feature_map": "soft_hash",
            "map_kwargs": {"num_features": 1920, "temperature": 10.0, "unit_directions": True},
            "qk_norm": True,
            "denominator_offset": 0.0,
        },
    },
    "softmax": {
        "description": "exact softmax attention, scale 1/sqrt(D) (SDPA), no q/k norm (quadratic)",
        "settings": {"form": "softmax", "qk_norm": False, "denominator_offset": 0.0},
    },
    "sliding_window": {
        "description": (
            "exact attention over the last w keys (window=w required): softmax with scale "
            "1/sqrt(D), no q/k norm, O(T·w) by blocks, decoded from a KV window of w keys; "
            "kernel=polynomial gives exact (q·k)^degree with LayerNorm on q/k and normalizer "
            "1 + Σ"
        ),
        "settings": {"form": "window", "qk_norm": False, "denominator_offset": 0.0},
    },
}
"""Preset name -> {"description": one line, "settings": the ``AttentionSpec`` fields it sets
(``form``, ``feature_map``, ``map_kwargs``, ``qk_norm``, ``denominator_offset``, ``degree``,
``local``)}."""


@dataclass(frozen=True)
class ModelPreset:
    """A model's attention beside a window branch, by name (``MODEL_PRESETS``).

    ``attention``: the attention preset of every layer; ``map_kwargs``: its feature-map
    keywords (``TransformerConfig.map_kwargs`` override them); ``hybrid``: the window branch
    and the attention's heads, RoPE and values beside it; ``gradient_surrogate``: λ of its
    training-only surrogate gradient; ``chunk_size``: the block its window needs (commands
    whose own default block is longer take it). A ``TransformerConfig`` field of the same
    meaning, where set, wins (``resolve_model``).
    """

    description: str
    attention: str
    hybrid: HybridSpec
    map_kwargs: Mapping[str, Any] = field(default_factory=dict)
    gradient_surrogate: float = 0.0
    chunk_size: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "map_kwargs", FrozenMap(self.map_kwargs))


_SOFT_HASH_FAR_LOCAL = ModelPreset(
    description=(
        "long context with retrieval: one head of soft_hash_far per layer (F = 1920 "
        "equal-norm buckets at initial temperature 10, reading the completed blocks "
        "only; values of 29/32 the head dim) beside an exact sliding-window softmax "
        "branch over the last 64 tokens, blocks of 64, trained with the surrogate "
        "gradient at λ = 50 (exactly 0 in value)"
    ),
    attention="soft_hash_far",
    hybrid=HybridSpec(window=64, heads=1, value_fraction=29 / 32),
    gradient_surrogate=50.0,
    chunk_size=64,
)

MODEL_PRESETS: dict[str, ModelPreset] = {
    "soft_hash_local": ModelPreset(
        description=(
            "long context: one head of soft_hash_1k per layer (global_heads=1) with F = 512 "
            "learned buckets and initial temperature 8 (LayerNorm on q/k, normalizer Σ) beside "
            "an exact sliding-window softmax branch over the last 64 tokens in every layer "
            "(local_window=64: own projections and normalizer, outputs summed)"
        ),
        attention="soft_hash_1k",
        map_kwargs={"num_features": 512, "temperature": 8.0},
        hybrid=HybridSpec(window=64, heads=1),
    ),
    "soft_hash_far_local": _SOFT_HASH_FAR_LOCAL,
    "soft_hash_far_local_tied": replace(
        _SOFT_HASH_FAR_LOCAL,
        description=(
            "soft_hash_far_local with the far branch's output projection starting as its "
            "value projection transposed (global_out_tied: each head's value-output circuit "
            "starts positive semidefinite, so the branch copies what it reads from step 0); "
            "the same model, state and speed, another initialization"
        ),
        hybrid=replace(_SOFT_HASH_FAR_LOCAL.hybrid, out_tied=True),
    ),
    "soft_hash_far_local_balanced": replace(
        _SOFT_HASH_FAR_LOCAL,
        description=(
            "soft_hash_far_local_tied with two far heads per layer of F = 640 buckets each "
            "(initial temperature 6) and the usage balance of features.soft_hash (Eq. 8, "
            "β = 10⁻³) reaching the bucket directions alone (the inputs and τ held out); "
            "two thirds of its far branch's state"
        ),
        map_kwargs={
            "num_features": 640,
            "temperature": 6.0,
            "bucket_balance": 1e-3,
            "bucket_balance_form": "usage",
            "bucket_balance_temperature": False,
            "bucket_balance_inputs": False,
        },
        hybrid=replace(_SOFT_HASH_FAR_LOCAL.hybrid, heads=2, out_tied=True),
    ),
}
"""Model preset name -> ``ModelPreset``. A preset whose settings change by measurement is stored
under a new name (``soft_hash_far_local_tied`` after ``soft_hash_far_local``,
``soft_hash_far_local_balanced`` after it), so that a name keeps meaning what was measured of
it."""
