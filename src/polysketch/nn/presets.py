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
from .spec import AttentionSpec, FrozenMap, HybridSpec

__all__ = [
    "AttentionPreset",
    "MAP_ROWS",
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


@dataclass(frozen=True)
class AttentionPreset:
    """A row of ``PRESETS`` (or of ``MAP_ROWS``): the ``AttentionSpec`` fields a name sets.

    ``form``, ``feature_map``, ``map_kwargs``, ``qk_norm``, ``denominator_offset``,
    ``degree`` (of the exact polynomial: the polynomial form, mixed local blocks) and
    ``local`` (mixed: the in-block kernel) as in ``AttentionSpec``. Rules the resolver applies
    to the user's map keywords (``resolve_attention``):

    * ``output_scale_per_feature``: the map's ``output_scale`` defaults to num_features^(-1/2)
      of the resolved keywords (psf_mixed: the public code's features × 1/√r);
    * ``softmax_target`` (set from the map's family): the map's ``scale`` defaults to the
      spec's softmax scale (1/√D unless given), so its target is exp(q·k/√D).

    Every row is validated when the table is built (import time): a spec of it is built, and
    its map must accept its keywords.
    """

    description: str
    form: str
    feature_map: str | None = None
    map_kwargs: Mapping[str, Any] = field(default_factory=dict)
    qk_norm: bool = False
    denominator_offset: float = 0.0
    degree: int = 4
    local: str = "polynomial"
    output_scale_per_feature: bool = False
    softmax_target: bool = False

    def __post_init__(self):
        object.__setattr__(self, "map_kwargs", FrozenMap(self.map_kwargs))
        if self.feature_map is not None:
            if self.feature_map not in available():
                raise ValueError(f"preset map {self.feature_map!r} is not a feature map")
            cls = get_class(self.feature_map)
            unknown = [k for k in self.map_kwargs if not cls.takes(k)]
            if unknown:
                raise ValueError(f"preset keywords {unknown} are not {self.feature_map}'s")
            if self.softmax_target != (self.feature_map in SOFTMAX_TARGET_MAPS):
                raise ValueError(f"softmax_target of a {self.feature_map} row must be "
                                 f"{self.feature_map in SOFTMAX_TARGET_MAPS}")  # fmt: skip
        AttentionSpec(name="row", form=self.form, feature_map=self.feature_map,
                      map_kwargs=self.map_kwargs, qk_norm=self.qk_norm,
                      denominator_offset=self.denominator_offset, degree=self.degree,
                      local=self.local, window=1 if self.form == "window" else None)  # fmt: skip


PRESETS: dict[str, AttentionPreset] = {
    "psf_random": AttentionPreset(
        description=(
            "PolySketchFormer random sketch: LayerNorm on q/k, Gaussian degree-2 polysketch "
            "with r = 32, nonnegative (self-tensored, square) so scores approximate degree 4, "
            "normalizer 1 + Σ, block lower-triangular algorithm with block = chunk_size "
            "(paper: 256)"
        ),
        form="linear", feature_map="polysketch", map_kwargs=_PSF_SKETCH, qk_norm=True,
        denominator_offset=1.0,
    ),  # fmt: skip
    "psf_learned": AttentionPreset(
        description=(
            "PolySketchFormer learned sketch: learned_polysketch (r = 32, expansion 8, 2 "
            "levels), square and nonnegative, LayerNorm on q/k, normalizer 1 + Σ, block = "
            "chunk_size"
        ),
        form="linear", feature_map="learned_polysketch", map_kwargs=_PSF_LEARNED,
        qk_norm=True, denominator_offset=1.0,
    ),  # fmt: skip
    "psf_mixed": AttentionPreset(
        description=(
            "PolySketchFormer mixed: exact local polynomial degree 4 inside blocks of "
            "chunk_size plus the psf_random sketch (Gaussian degree-2, r = 32, square) at the "
            "public code's scale (features × 1/√r) for earlier blocks, LayerNorm on q/k, "
            "shared normalizer 1 + Σ"
        ),
        form="mixed", feature_map="polysketch", map_kwargs=_PSF_SKETCH, qk_norm=True,
        denominator_offset=1.0, degree=4, output_scale_per_feature=True,
    ),  # fmt: skip
    "polynomial": AttentionPreset(
        description=(
            "exact polynomial attention of degree 4 with LayerNorm on q/k and normalizer "
            "1 + Σ (quadratic in T)"
        ),
        form="polynomial", qk_norm=True, denominator_offset=1.0, degree=4,
    ),  # fmt: skip
    "soft_hash_1k": AttentionPreset(
        description=(
            "soft hashing for long context: soft_hash with F = 1024 learned buckets, initial "
            "temperature 4 (learned), LayerNorm on q/k, normalizer Σ (no offset), linear "
            "attention with a 1024 × (E + 1) state per head (1.9× psf_random's)"
        ),
        form="linear", feature_map="soft_hash",
        map_kwargs={"num_features": 1024, "temperature": 4.0}, qk_norm=True,
    ),  # fmt: skip
    "soft_hash_far": AttentionPreset(
        description=(
            "soft hashing of the completed blocks: soft_hash with F = 1920 learned buckets "
            "(equal-norm directions, initial temperature 10, learned), LayerNorm on q/k, "
            "normalizer Σ; each query reads the keys of the blocks of chunk_size before its "
            "own only (mixed attention with local='none'), for use beside an exact window of "
            ">= chunk_size keys (the model preset soft_hash_far_local)"
        ),
        form="mixed", local="none", feature_map="soft_hash",
        map_kwargs={"num_features": 1920, "temperature": 10.0, "unit_directions": True},
        qk_norm=True,
    ),  # fmt: skip
    "softmax": AttentionPreset(
        description="exact softmax attention, scale 1/sqrt(D) (SDPA), no q/k norm (quadratic)",
        form="softmax",
    ),
    "sliding_window": AttentionPreset(
        description=(
            "exact attention over the last w keys (window=w required): softmax with scale "
            "1/sqrt(D), no q/k norm, O(T·w) by blocks, decoded from a KV window of w keys; "
            "kernel=polynomial gives exact (q·k)^degree with LayerNorm on q/k and normalizer "
            "1 + Σ"
        ),
        form="window",
    ),
}
"""Preset name -> ``AttentionPreset`` (the ``AttentionSpec`` fields it sets)."""

_MAP_KEYWORDS = {"polysketch": {"nonnegative": True}}
"""A plain map name's own keyword defaults: ``polysketch`` is nonnegative (PolySketchFormer
never uses unsquared, signed sketch scores in attention)."""


def _map_row(name: str) -> AttentionPreset:
    polynomial = name in POLYNOMIAL_MAPS
    return AttentionPreset(
        description=f"the feature map {name} (polysketch.features), linear attention",
        form="linear", feature_map=name, map_kwargs=_MAP_KEYWORDS.get(name, {}),
        qk_norm=polynomial, denominator_offset=1.0 if polynomial else 0.0,
        softmax_target=name in SOFTMAX_TARGET_MAPS,
    )  # fmt: skip


MAP_ROWS: dict[str, AttentionPreset] = {n: _map_row(n) for n in available() if n not in PRESETS}
"""Every feature-map name as a row (module docstring's defaults): what ``attention=NAME``
computes for a map that is not a preset."""


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
        if self.attention not in PRESETS and self.attention not in MAP_ROWS:
            raise ValueError(f"model preset attention {self.attention!r} is not a name")


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
