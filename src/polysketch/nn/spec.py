"""Typed, frozen specs of what a layer computes: an attention name resolved once.

``polysketch.nn.resolve`` turns the names and options a user gives (``TransformerConfig``,
``KernelAttention(attention=...)``, ``convert(model, attention=...)``, a CLI ``NAME:k=v``
string) into these values at the edge; everything below reads them and nothing re-reads the
preset tables (``polysketch.nn.presets``).

* ``AttentionSpec``: what one attention core computes (``AttentionCore``). Its ``form`` is

  - ``"linear"``: s_ij = φq(q_i)·φk(k_j) (squared when the map is ``square``), normalized
    linear attention (``ops.linear_attention``);
  - ``"mixed"``: exact local scores inside blocks of ``chunk_size`` (``local``: the degree-p
    polynomial, ``"relu"``, or ``"none"`` = no in-block scores) and the map for every earlier
    block, one normalizer (``ops.mixed_attention``);
  - ``"window"``: an exact kernel (``window_kernel``) over the last ``window`` keys
    (``ops.window_attention``);
  - ``"softmax"`` / ``"polynomial"``: the exact quadratic kernels (PolySketchFormer Eq. 1).

  (``form`` is the nn-level choice; ``ops``' ``algorithm=`` names how a linear form is
  computed: chunked, blocks, Triton.)
* ``HybridSpec``: a sliding-window softmax branch beside every layer's attention (BASED's
  local + global design; ``Block``): its window, the attention's heads, the layers that have
  the attention (``every``), RoPE on the attention's q/k, its per-head values, whether the
  branches share one projection, the scale of the attention's output projection at init.
* ``ModelSpec``: a ``TransformerLM``'s attention and hybrid, with the per-head sizes resolved.
* ``LayerSpec``: what one converted layer of a Hugging Face model computes (the model's own
  projections): its attention, the exact window beside it, the query heads the attention
  runs on (``polysketch.nn.resolve.resolve_converted``).

**Options.** The fields of ``AttentionSpec`` marked as options (``OPTION_FIELDS``) are what a
user may set beside a name, everywhere by the same keyword: ``TransformerConfig`` fields of the
same name, ``KernelAttention(..., **options)``, ``convert(model, name, **options)``, a text
spec's ``NAME:key=value``. ``ATTENTION_OPTIONS`` adds ``mixed`` (the mixed form with a map).
Adding an option is: a field here (with ``_option``), its use where it acts, and a
``TransformerConfig`` field for the command line (``docs/models.md``, "Adding an option").

Each spec validates itself when built and converts to and from a plain dict
(``to_dict``/``from_dict``), which is how checkpoints store it: a checkpoint keeps what its
model computed even when a preset of the same name changes later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from polysketch._checks import check_float

__all__ = [
    "ATTENTION_OPTIONS",
    "DEFAULT_CHUNK_SIZE",
    "FORMS",
    "LayerSpec",
    "OPTION_FIELDS",
    "LOCAL_KERNELS",
    "WINDOW_KERNELS",
    "AttentionSpec",
    "FrozenMap",
    "HybridSpec",
    "ModelSpec",
]

FORMS = ("linear", "mixed", "window", "softmax", "polynomial")
DEFAULT_CHUNK_SIZE = 64
"""The block ``chunk_size`` of a model's attention when neither its name (a model preset's
``chunk_size``) nor the user sets one: ``TransformerLM``, ``KernelAttention``, ``convert``, the
commands. (The ops, ``polysketch.ops.linear_attention``, keep the paper's 256 as their own.)"""
LOCAL_KERNELS = ("polynomial", "relu", "none")
WINDOW_KERNELS = ("softmax", "polynomial")


class FrozenMap(Mapping):
    """A read-only mapping (keys sorted, so equal specs compare and print alike) that copies,
    pickles and compares as the dict it holds: a spec's ``map_kwargs``."""

    __slots__ = ("_data",)

    def __init__(self, mapping: Mapping[str, Any] | None = None):
        data = dict(mapping or {})
        object.__setattr__(self, "_data", {k: data[k] for k in sorted(data)})

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self._data) == dict(other)

    def __hash__(self) -> int:
        return hash(repr(self._data))

    def __repr__(self) -> str:
        return repr(self._data)

    def __setattr__(self, name, value):
        raise AttributeError("a FrozenMap is read-only")

    def __reduce__(self):
        return FrozenMap, (self._data,)


def _frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return mapping if isinstance(mapping, FrozenMap) else FrozenMap(mapping)


def _option(default, help: str):
    """A field a user may set beside an attention name (``OPTION_FIELDS``)."""
    return field(default=default, metadata={"option": help})


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention core computes (module docstring). Built by ``resolve_attention``.

    Fields: ``name`` (what the user named: a preset or a feature map), ``form``,
    ``feature_map`` (a ``features.available()`` name, for the linear and mixed forms),
    ``map_kwargs`` (its keywords, read-only), ``qk_norm`` (LayerNorm on q and k),
    ``denominator_offset`` (1 for PolySketchFormer's 1 + Σ), ``degree`` (of the exact
    polynomial: the polynomial form, mixed local blocks, a polynomial window), ``local`` (the
    mixed form's in-block kernel), ``window`` / ``window_kernel`` (the window form),
    ``learn_balance`` (mixed: a learned per-head weight of the far blocks), and
    ``gradient_surrogate`` (λ of a training-only gradient of mixed attention without in-block
    scores, exactly 0 in value; ``AttentionCore``), ``softmax_scale`` (the scale of softmax
    scores, exact or windowed; None: 1/√D), ``chunk_size`` (the block b of the block
    algorithm and of the mixed form's blocks).
    """

    name: str
    form: str
    feature_map: str | None = None
    map_kwargs: Mapping[str, Any] = field(default_factory=dict)
    qk_norm: bool = _option(False, "LayerNorm on q and k (default: the attention's)")
    denominator_offset: float = _option(
        0.0, "added to the normalizer (default: 1 for polynomial kernels, else 0)")
    degree: int = 4
    local: str = "polynomial"
    window: int | None = _option(
        None, "keys each query sees with attention=sliding_window (itself included)")
    window_kernel: str = "softmax"
    learn_balance: bool = _option(
        False, "mixed attention: a learned per-head weight of the far blocks")
    gradient_surrogate: float = _option(
        0.0, "λ of the training-only surrogate gradient of attention without in-block scores")
    softmax_scale: float | None = _option(
        None, "scale of softmax scores and of softmax-kernel maps (default: 1/√D)")
    chunk_size: int = _option(
        DEFAULT_CHUNK_SIZE, "block of the chunked algorithm and of mixed blocks")

    def __post_init__(self):
        object.__setattr__(self, "map_kwargs", _frozen(self.map_kwargs))
        scale = self.softmax_scale
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
                raise ValueError(f"softmax_scale must be a float > 0 or None, got {scale!r}")
            object.__setattr__(self, "softmax_scale", float(scale))
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {self.form!r}")
        if (self.feature_map is None) == (self.form in ("linear", "mixed")):
            raise ValueError(
                f"the {self.form} form {'needs' if self.feature_map is None else 'takes no'} "
                f"feature map, got feature_map={self.feature_map!r}"
            )
        if self.local not in LOCAL_KERNELS:
            raise ValueError(f"local must be one of {LOCAL_KERNELS}, got {self.local!r}")
        if self.window_kernel not in WINDOW_KERNELS:
            raise ValueError(f"kernel must be one of {WINDOW_KERNELS}, got {self.window_kernel!r}")
        if (self.window is not None) != (self.form == "window"):
            raise ValueError(
                'window= is an option of attention="sliding_window" (the window form), got '
                f"window={self.window!r} for attention={self.name!r}"
            )
        if self.window is not None and (
            isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1
        ):
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or self.degree < 1:
            raise ValueError(f"degree must be an int >= 1, got {self.degree!r}")
        b = self.chunk_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {b!r}")
        for name in ("qk_norm", "learn_balance"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        offset = self.denominator_offset
        if isinstance(offset, bool) or not isinstance(offset, (int, float)):
            raise TypeError(f"denominator_offset must be a float, got {offset!r}")
        if not math.isfinite(offset):
            raise ValueError(f"denominator_offset must be finite, got {offset!r}")
        object.__setattr__(self, "denominator_offset", float(offset))
        lam = self.gradient_surrogate
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not lam >= 0:
            raise ValueError(f"gradient_surrogate must be a float >= 0, got {lam!r}")
        object.__setattr__(self, "gradient_surrogate", float(lam))
        if self.learn_balance and (self.form != "mixed" or self.local == "none"):
            raise ValueError(
                "learn_balance=True weighs the far blocks against exact local blocks: it needs "
                f"mixed attention with in-block scores (mixed=True or psf_mixed), got "
                f"attention={self.name!r} ({self.describe_form()})"
            )
        if self.gradient_surrogate and (self.form != "mixed" or self.local != "none"):
            raise ValueError(
                "gradient_surrogate needs mixed attention without in-block scores (local='none', "
                f"e.g. soft_hash_far), got attention={self.name!r} ({self.describe_form()})"
            )

    def describe_form(self) -> str:
        """The form, with the mixed form's in-block kernel: ``"mixed, local='none'"``."""
        return f"{self.form}, local={self.local!r}" if self.form == "mixed" else self.form

    @property
    def needs_causal(self) -> bool:
        """Whether it is defined only for causal attention (mixed blocks, the window)."""
        return self.form in ("mixed", "window")

    def to_dict(self) -> dict:
        """A plain, JSON-friendly dict (``from_dict`` inverts it)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return out | {"map_kwargs": dict(self.map_kwargs)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AttentionSpec:
        """The spec of ``to_dict``; unknown keys are refused (ValueError naming them)."""
        return cls(**_known(cls, data, "AttentionSpec"))


@dataclass(frozen=True)
class HybridSpec:
    """A sliding-window softmax branch beside every layer's attention (``Block``).

    ``window``: the keys each query of the branch sees (itself included). ``heads``: the
    attention's heads beside it (None: the model's n_head). ``every``: only layers k-1,
    2k-1, ... have the attention, the others the window alone (None: every layer). ``rope``:
    RoPE on the attention's q/k (None: the model's ``rope``). ``value_fraction``: the
    attention's per-head values as a fraction of the model's head dim, rounded down (None: the
    attention's default width). ``shared``: the branches read one q/k/v projection and share
    the output projection. ``out_init``: the attention's output projection starts at
    ``out_init`` × the model's residual-output initialization (``TransformerLM._init_weights``;
    0: zero, so the attention adds nothing at step 0 and its value–output circuit starts
    neutral; the window branch keeps the model's); 1 with ``shared``. ``out_tied``: the
    attention's output projection starts instead as its value projection transposed,
    W_o = c·W_vᵀ with c = ``out_init`` / √(2·n_layer) (so its entries keep the drawn RMS):
    each head's value–output circuit, the map x ↦ W_o,h W_v,h x of the residual stream, is then
    c·W_v,hᵀ W_v,h, positive semidefinite at step 0, so a value read from a key raises the
    residual's component along that key's own input (the value half of the mimetic
    initialization, W_v W_o ≈ I, of Trockman & Kolter 2023, "Mimetic initialization of
    self-attention layers"); False with ``shared``.
    A ``ModelSpec`` holds it with ``heads`` and ``rope`` resolved.
    """

    window: int
    heads: int | None = None
    every: int | None = None
    rope: bool | None = None
    value_fraction: float | None = None
    shared: bool = False
    out_init: float = 1.0
    out_tied: bool = False

    def __post_init__(self):
        for name in ("window", "heads", "every"):
            value = getattr(self, name)
            if value is None and name != "window":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                what = {"window": "local_window", "heads": "global_heads",
                        "every": "global_every"}[name]  # fmt: skip
                raise ValueError(f"{what} must be an int >= 1, got {value!r}")
        if self.rope is not None and not isinstance(self.rope, bool):
            raise TypeError(f"global_rope must be a bool or None, got {self.rope!r}")
        if not isinstance(self.shared, bool):
            raise TypeError(f"local_shared must be a bool, got {self.shared!r}")
        fraction = self.value_fraction
        if fraction is not None and not (isinstance(fraction, (int, float)) and fraction > 0):
            raise ValueError(f"value_fraction must be a float > 0, got {fraction!r}")
        scale = check_float(self.out_init, "global_out_init", minimum=0.0)
        object.__setattr__(self, "out_init", scale)
        if self.shared and scale != 1:
            raise ValueError(
                f"global_out_init={scale!r} with local_shared=True: the branches share one "
                "output projection, which cannot start at another scale for one of them"
            )
        if not isinstance(self.out_tied, bool):
            raise TypeError(f"global_out_tied must be a bool, got {self.out_tied!r}")
        if self.shared and self.out_tied:
            raise ValueError(
                "global_out_tied=True with local_shared=True: the branches share one output "
                "projection, which cannot start tied to one branch's values"
            )

    def has_global(self, layer_index: int) -> bool:
        """Whether layer ``layer_index`` has the attention beside its window (``every``)."""
        return self.every is None or (layer_index + 1) % self.every == 0

    def to_dict(self) -> dict:
        """The fields as a dict; ``out_init`` only where it is not 1 and ``out_tied`` only
        where it is True (a checkpoint that does not use them stays readable by versions
        without the fields)."""
        out = asdict(self)
        if out["out_init"] == 1:
            del out["out_init"]
        if not out["out_tied"]:
            del out["out_tied"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HybridSpec:
        return cls(**_known(cls, data, "HybridSpec"))


@dataclass(frozen=True)
class ModelSpec:
    """A ``TransformerLM``'s attention, resolved (``resolve_model``).

    ``attention``: every layer's attention (the global branch beside a window).
    ``heads``: its heads. ``qk_dim`` / ``value_dim``: its per-head query/key and value sizes
    (None: the layer's default, n_embd / heads). ``rope``: RoPE on its q and k.
    ``hybrid``: the window branch beside it (``heads`` and ``rope`` resolved) or None, and
    ``window_attention`` that branch's attention (exact softmax over the last w keys).
    """

    attention: AttentionSpec
    heads: int
    qk_dim: int | None = None
    value_dim: int | None = None
    rope: bool = True
    hybrid: HybridSpec | None = None
    window_attention: AttentionSpec | None = None

    def __post_init__(self):
        if (self.hybrid is None) != (self.window_attention is None):
            raise ValueError("a ModelSpec has a window_attention exactly when it has a hybrid")

    def has_global(self, layer_index: int) -> bool:
        """Whether layer ``layer_index`` runs ``attention`` (``HybridSpec.every``)."""
        return self.hybrid is None or self.hybrid.has_global(layer_index)

    def to_dict(self) -> dict:
        return {
            "attention": self.attention.to_dict(),
            "heads": self.heads,
            "qk_dim": self.qk_dim,
            "value_dim": self.value_dim,
            "rope": self.rope,
            "hybrid": None if self.hybrid is None else self.hybrid.to_dict(),
            "window_attention": (
                None if self.window_attention is None else self.window_attention.to_dict()
            ),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        data = _known(cls, data, "ModelSpec")
        hybrid, window = data.get("hybrid"), data.get("window_attention")
        return cls(**{
            **data,
            "attention": AttentionSpec.from_dict(data["attention"]),
            "hybrid": None if hybrid is None else HybridSpec.from_dict(hybrid),
            "window_attention": None if window is None else AttentionSpec.from_dict(window),
        })  # fmt: skip


@dataclass(frozen=True)
class LayerSpec:
    """What one converted layer computes (``polysketch.nn.resolve.resolve_converted``): the
    model's own q/k/v/o projections and RoPE, then

        O_h = W_h + G_h,

    W_h the exact ``window_attention`` over the last w keys (none: W = 0) on every query head,
    G_h ``attention`` on query heads h < ``global_heads`` (None: every head; G_h = 0 beyond).
    ``attention`` carries the layer's own softmax scale (the model's ``scaling``, which may
    differ by layer). A converted model's ``config.json`` stores one per layer.
    """

    attention: AttentionSpec
    window_attention: AttentionSpec | None = None
    global_heads: int | None = None

    def __post_init__(self):
        if not isinstance(self.attention, AttentionSpec):
            raise TypeError(f"attention must be an AttentionSpec, got {self.attention!r}")
        w = self.window_attention
        if w is not None and (not isinstance(w, AttentionSpec) or w.form != "window"):
            raise ValueError(f"window_attention must be a window-form AttentionSpec, got {w!r}")
        g = self.global_heads
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ValueError(f"global_heads must be an int >= 1 or None, got {g!r}")
        if g is not None and w is None:
            raise ValueError("global_heads sets the heads of the attention beside a "
                             "sliding-window branch: it needs local_window")  # fmt: skip

    def to_dict(self) -> dict:
        w = self.window_attention
        return {"attention": self.attention.to_dict(),
                "window_attention": None if w is None else w.to_dict(),
                "global_heads": self.global_heads}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerSpec:
        data = _known(cls, data, "LayerSpec")
        w = data.get("window_attention")
        return cls(attention=AttentionSpec.from_dict(data["attention"]),
                   window_attention=None if w is None else AttentionSpec.from_dict(w),
                   global_heads=data.get("global_heads"))  # fmt: skip


OPTION_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(AttentionSpec) if "option" in f.metadata
)
"""The ``AttentionSpec`` fields a user may set beside a name (module docstring)."""

ATTENTION_OPTIONS: tuple[str, ...] = (*OPTION_FIELDS, "mixed")
"""Every attention option a name takes: ``OPTION_FIELDS`` and ``mixed`` (a feature map's
mixed form: exact local blocks, the map before them; sets ``form``)."""


def option_help(name: str) -> str:
    """The one-line help of attention option ``name`` (for the command line)."""
    if name == "mixed":
        return "mixed attention with the feature map (exact local blocks, psf_mixed's form)"
    return next(f.metadata["option"] for f in fields(AttentionSpec) if f.name == name)


def _known(cls, data: Mapping[str, Any], what: str) -> dict:
    if not isinstance(data, Mapping):
        raise TypeError(f"{what} must be read from a dict, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{what}: unknown fields {unknown} (known: {sorted(names)})")
    return dict(data)
