"""The feature-map contract and the registry of maps.

A feature map turns attention scores into dot products: ``s(q, k) ≈ φq(q)·φk(k)`` (or
``(φq(q)·φk(k))²`` when ``square`` is set), so attention can be computed in time linear in
the sequence length (see ``polysketch.ops``).

Subclasses implement ``_query`` / ``_key`` (or just ``_features`` for symmetric maps),
``feature_dim`` and ``target_kernel``; random maps implement ``_draw(generator)``, which
(re)draws their buffers. The public ``query``/``key`` validate the input (its last dim and its
device against the map's tensors), pick the compute dtype (fp32 internals for bf16/fp16, see
``polysketch._checks.compute_dtype``) and cast the result back to the input dtype.

**Declarations** (class-level data, so that no caller has to probe a constructor's signature):

* ``family``: the kind of kernel the map targets, one of ``FAMILIES``: ``"polynomial"``
  ((x·y)^p and sketches or learned imitations of it), ``"softmax"`` (exp(scale·x·y): random
  features and Hedgehog) or ``"own"`` (a kernel the map defines: elu, taylor).
  ``available(family)`` lists the maps of a family.
* ``hyperparameters``: ``{name: Hyperparameter(default, meaning)}``, exactly the keywords the
  constructor takes (``FeatureMap.takes(name)``); a registered map must declare it.
* The shared keywords ``SHARED_KEYWORDS`` (``degree``, ``num_features``, ``seed``,
  ``generator``) are accepted by EVERY registered map, so one kwargs dict can be swept over
  ``available()``. A shared keyword the map does not declare is handled by the class's
  ``fixed`` declaration: if the map has a fixed value of it (``fixed[name]``, e.g.
  ``tensor_power``'s F = D^p for ``num_features``, ``taylor``'s degree 2), ``None`` or that
  very value is accepted and any other value raises ValueError (a sweep never silently gets a
  different map than it asked for); otherwise the map has no use for it and it is ignored
  (``seed``/``generator`` of deterministic maps, ``degree`` of softmax-kernel maps and elu),
  after checking that a given ``seed`` is a valid seed. ``None`` for a shared keyword always
  means the map's default. Any other undeclared keyword raises TypeError.
* ``fit_keywords``: the keywords of ``fit(q, k, **kw)`` for maps that can be fitted to data.
* ``stable_query`` (numerical range, next paragraph).

**Numerical range: stabilized queries.** In normalized attention without a normalizer offset,
``out_i = Σ_j s_ij v_j / Σ_j s_ij``, a positive factor c_i on query row i multiplies every
s_ij of that row and cancels. ``query_stabilized(x)`` returns ``c(x)·φq(x)`` with c(x) > 0 per
row; maps with ``stable_query = True`` (the softmax-kernel random features, whose query
features carry exp(±‖u‖²/2) and exp(ω·u) factors that over- or underflow for ‖u‖ ≳ 9–13 in
fp32) compute it in log space so that the row's largest |feature| is in [1/2, 1] and
nothing overflows; other maps return ``φq(x)`` unchanged (c = 1). The attention path may use
it ONLY when ``normalize=True`` and ``denominator_offset == 0`` (with an offset or without
normalization c_i does not cancel), and it never shifts keys: a per-key factor reweights keys
and a factor shared by all keys would have to look at other (later) tokens, performer-pytorch's
causal leak. ``polysketch.features.stability.attention_features`` applies this rule and
refuses (ValueError on CPU; ``torch._assert_async`` on accelerators and under
``torch.compile``) what cannot be computed exactly: overflowing key features, overflowing query
features, and normalizers that underflow the denominator guard.
"""

from __future__ import annotations

import itertools
from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from .._checks import check_feature_input, check_positive_int, compute_dtype
from ..random import check_seed, make_generator
from .stability import refuse_features

__all__ = [
    "FAMILIES",
    "SHARED_KEYWORDS",
    "FeatureMap",
    "Fixed",
    "Hyperparameter",
    "register",
    "create",
    "available",
    "get_class",
]

FAMILIES = ("polynomial", "softmax", "own")
"""Target families a map declares (``FeatureMap.family``)."""

SHARED_KEYWORDS = ("degree", "num_features", "seed", "generator")
"""Constructor keywords every registered map accepts (see the module docstring)."""


class Hyperparameter(NamedTuple):
    """One declared constructor keyword: its default (as in the signature) and its meaning."""

    default: Any
    meaning: str


class Fixed(NamedTuple):
    """A shared keyword a map does not take but has a fixed value of.

    ``attribute``: the instance attribute holding that value (read after construction);
    ``reason``: what fixes it, for the error message.
    """

    attribute: str
    reason: str


def _check_ignored(cls: type, shared: dict) -> None:
    """Validate shared keywords a map ignores (a bad seed is an error even when unused)."""
    if shared.get("seed") is not None:
        check_seed(shared["seed"])
    generator = shared.get("generator")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")


class _FeatureMapMeta(ABCMeta):
    """Applies a map's declarations to ``Map(dim, **kwargs)`` (see the module docstring)."""

    def __call__(cls, *args, **kwargs):
        declared = cls.hyperparameters
        if declared is None:  # an undeclared (unregistered) subclass: its own signature rules
            return super().__call__(*args, **kwargs)
        shared = {}
        for key in list(kwargs):
            if key in SHARED_KEYWORDS and kwargs[key] is None:
                del kwargs[key]  # None means "the map's default" for every shared keyword
            elif key in SHARED_KEYWORDS and key not in declared:
                shared[key] = kwargs.pop(key)  # ignored, or checked against a fixed value
            elif key not in declared:
                raise TypeError(
                    f"{cls.__name__}() got an unexpected keyword argument {key!r}; it takes "
                    f"{sorted(declared)} and the shared keywords {list(SHARED_KEYWORDS)}"
                )
        _check_ignored(cls, shared)
        fm = super().__call__(*args, **kwargs)
        for key, value in shared.items():
            fixed = cls.fixed.get(key)
            if value is None or fixed is None:
                continue
            value = check_positive_int(value, key)
            own = getattr(fm, fixed.attribute)
            if value != own:
                raise ValueError(
                    f"{key}={value} conflicts with {cls.name or cls.__name__}'s {key}, which is "
                    f"fixed at {own} by {fixed.reason}; leave {key} out (or None) to accept it"
                )
        return fm


class FeatureMap(nn.Module, metaclass=_FeatureMapMeta):
    """Base class of every feature map: ``(..., D) -> (..., F)``.

    Class attributes a subclass sets:
        name: the registry name (``create(name, ...)``).
        kind: one of ``"exact"`` (φq·φk equals ``target_kernel`` up to rounding),
            ``"unbiased"`` (random; E[φq·φk] equals ``target_kernel``), ``"learned"``
            (trainable approximation), ``"approximate"`` (deterministic approximation or a
            different kernel, e.g. baselines whose ``target_kernel`` is their own kernel).
        is_random: the map holds random buffers that ``redraw_`` redraws.
        family, hyperparameters, fixed, fit_keywords, stable_query: the declarations of the
            module docstring (a registered map must declare ``family`` and
            ``hyperparameters``).

    Instance attributes:
        dim (int): D, the input dimension.
        square (bool): effective features are φ⊗φ, i.e. the score is (φq·φk)²; the ops
            never materialize the F² features (their states hold F(⌊F/2⌋+1) pair products).
        nonnegative (bool): every score the map produces is >= 0.
    """

    name: str = ""
    kind: str = "exact"
    is_random: bool = False
    family: ClassVar[str] = "own"
    hyperparameters: ClassVar[Mapping[str, Hyperparameter] | None] = None
    fixed: ClassVar[Mapping[str, Fixed]] = {}
    fit_keywords: ClassVar[frozenset[str]] = frozenset()
    stable_query: ClassVar[bool] = False

    @classmethod
    def takes(cls, keyword: str) -> bool:
        """Whether ``keyword`` is one of the map's declared hyperparameters (it changes the map).

        False for a shared keyword the map ignores or has a fixed value of (see the module
        docstring), and for every keyword of an undeclared subclass.
        """
        return cls.hyperparameters is not None and keyword in cls.hyperparameters

    def __init__(self, dim: int, *, square: bool = False, nonnegative: bool = False):
        super().__init__()
        self.dim = check_positive_int(dim, "dim")
        if not isinstance(square, bool):
            raise TypeError(f"square must be a bool, got {type(square).__name__}")
        self.square = square
        self.nonnegative = bool(nonnegative)

    # ----- sizes -------------------------------------------------------------------------
    @property
    @abstractmethod
    def feature_dim(self) -> int:
        """F, the last dimension of ``query(x)`` and ``key(x)``."""

    @property
    def symmetric(self) -> bool:
        """Whether ``query``, ``key`` and ``query_stabilized`` are one function (φq = φk):
        the class defines only ``_features``. Decoding then computes the new token's query
        and key features in one call (``features.stability.attention_features``)."""
        cls = type(self)
        return (
            cls._query is FeatureMap._query
            and cls._key is FeatureMap._key
            and cls._query_stabilized is FeatureMap._query_stabilized
        )

    @property
    def state_dim(self) -> int:
        """F', the size of the decoding state per value dim: F(⌊F/2⌋+1) when ``square`` (the
        symmetric pair layout of ``polysketch.ops.pairs``, about half of F²), else F."""
        f = self.feature_dim
        return f * (f // 2 + 1) if self.square else f

    # ----- features ----------------------------------------------------------------------
    def _features(self, x: torch.Tensor) -> torch.Tensor:
        """Features of a symmetric map, computed in ``x.dtype`` (already the compute dtype)."""
        raise TypeError(f"{type(self).__name__} must define _features, or _query and _key")

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        return self._features(x)

    def _key(self, x: torch.Tensor) -> torch.Tensor:
        return self._features(x)

    def _query_stabilized(self, x: torch.Tensor) -> torch.Tensor:
        """c(x)·φq(x) in the compute dtype, c(x) > 0 per row (default c = 1: ``_query``)."""
        return self._query(x)

    def _reference_tensor(self) -> torch.Tensor | None:
        """One tensor of the map (own buffers/parameters first, else the first nested one)."""
        for t in itertools.chain(self._buffers.values(), self._parameters.values()):
            if t is not None:
                return t
        return next(itertools.chain(self.parameters(), self.buffers()), None)

    def _checked(self, x) -> torch.Tensor:
        """Validate an input of ``query``/``key``: shape (..., D), floating, on the map's device."""
        x = check_feature_input(x, self.dim, "x")
        ref = self._reference_tensor()
        if ref is not None and ref.device != x.device:
            raise ValueError(
                f"x is on {x.device} but feature map {self.name or type(self).__name__!r} holds "
                f"its tensors on {ref.device}: move the map (.to({str(x.device)!r})) or the input"
            )
        return x

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """φq(x): (..., D) -> (..., F), same dtype as ``x``; features that overflow it (or
        come from NaN/Inf inputs) are refused (``features.stability.refuse_features``)."""
        return refuse_features(self, self.unchecked("query", x), "query")

    def key(self, x: torch.Tensor) -> torch.Tensor:
        """φk(x): (..., D) -> (..., F), same dtype as ``x``; refused as ``query``."""
        return refuse_features(self, self.unchecked("key", x), "key")

    def query_stabilized(self, x: torch.Tensor) -> torch.Tensor:
        """c(x)·φq(x) with c(x) > 0 per row: (..., D) -> (..., F), same dtype as ``x``.

        For ``stable_query`` maps the row's largest |feature| is in [1/2, 1] and nothing
        overflows on the way (log-space computation); other maps return ``query(x)``. Use it
        in place of ``query`` only where c cancels: normalized attention with no normalizer
        offset (module docstring). Gradients are exact there: the output is invariant to c.
        Refused as ``query`` where it overflows.
        """
        return refuse_features(self, self.unchecked("query_stabilized", x), "query_stabilized")

    def unchecked(self, role: str, x: torch.Tensor) -> torch.Tensor:
        """``query`` / ``key`` / ``query_stabilized`` (``role``) without the overflow refusal,
        for ``features.stability.attention_features``, which checks the features it returns
        itself (exempting keys a padding mask removes)."""
        x = self._checked(x)
        compute = {"query": self._query, "key": self._key,
                   "query_stabilized": self._query_stabilized}[role]  # fmt: skip
        return compute(x.to(compute_dtype(x.dtype))).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Alias of ``query`` (for symmetric maps query == key)."""
        return self.query(x)

    # ----- kernels -----------------------------------------------------------------------
    @abstractmethod
    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The kernel the map computes or estimates: (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty)."""

    def approx_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The kernel the features give: φq(x)·φk(y), squared when ``square``.

        Shapes: x (..., Tx, D), y (..., Ty, D) -> (..., Tx, Ty). Quadratic in T: meant for
        tests, fitting and fidelity measurement, not for attention; features that overflow
        give inf/NaN here (a fit that diverges sees its loss turn NaN) instead of a refusal.
        """
        check_feature_input(x, self.dim, "x")
        check_feature_input(y, self.dim, "y")
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError("x and y must have shape (..., T, D)")
        s = self.unchecked("query", x) @ self.unchecked("key", y).transpose(-1, -2)
        return s * s if self.square else s

    # ----- randomness --------------------------------------------------------------------
    def _draw(self, generator: torch.Generator) -> None:
        """(Re)draw the random buffers in place from ``generator`` (random maps only)."""

    @torch.no_grad()
    def redraw_(self, generator: torch.Generator | None = None) -> FeatureMap:
        """Redraw the random buffers in place; a no-op for deterministic maps.

        ``generator`` (a CPU ``torch.Generator``) makes the draw reproducible; ``None`` seeds
        a new generator from torch's global RNG. Buffers keep their device and dtype.
        Returns ``self``.
        """
        if self.is_random:
            self._draw(make_generator(None, generator))
        return self

    def _set_buffer(self, name: str, value: torch.Tensor) -> None:
        """Register ``name`` as a buffer, or overwrite it keeping its device and dtype."""
        if name in self._buffers and self._buffers[name] is not None:
            old = self._buffers[name]
            self._buffers[name] = value.to(device=old.device, dtype=old.dtype)
        else:
            self.register_buffer(name, value)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, feature_dim={self.feature_dim}, square={self.square}"


# ----- registry ------------------------------------------------------------------------------
_REGISTRY: dict[str, type[FeatureMap]] = {}


def register(name: str) -> Callable[[type[FeatureMap]], type[FeatureMap]]:
    """Class decorator: register a ``FeatureMap`` subclass under ``name``."""

    def decorator(cls: type[FeatureMap]) -> type[FeatureMap]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"feature map name {name!r} is already registered")
        if not (isinstance(cls, type) and issubclass(cls, FeatureMap)):
            raise TypeError("register() decorates FeatureMap subclasses")
        if cls.hyperparameters is None:
            raise TypeError(f"register({name!r}): {cls.__name__} must declare hyperparameters")
        if cls.family not in FAMILIES:
            raise ValueError(
                f"register({name!r}): family must be one of {FAMILIES}, got {cls.family!r}"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorator


def available(*families: str) -> list[str]:
    """Sorted names of the registered feature maps, or of those of the given ``families``."""
    for family in families:
        if family not in FAMILIES:
            raise ValueError(f"families must be among {FAMILIES}, got {family!r}")
    return sorted(n for n, c in _REGISTRY.items() if not families or c.family in families)


def get_class(name: str) -> type[FeatureMap]:
    """The class registered under ``name``."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown feature map name {name!r}; available: {available()}")
    return _REGISTRY[name]


def create(name: str, dim: int, **kwargs) -> FeatureMap:
    """Build the feature map registered under ``name`` for input dim ``dim``.

    Keyword arguments (``degree=``, ``num_features=``, ``seed=``, ...) go to its class; the
    shared keywords are accepted by every map (module docstring).
    """
    return get_class(name)(dim, **kwargs)
