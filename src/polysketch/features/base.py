"""The feature-map contract and the registry of maps.

A feature map turns attention scores into dot products: ``s(q, k) ≈ φq(q)·φk(k)`` (or
``(φq(q)·φk(k))²`` when ``square`` is set), so attention can be computed in time linear in
the sequence length (see ``polysketch.ops``).

Subclasses implement ``_query`` / ``_key`` (or just ``_features`` for symmetric maps),
``feature_dim`` and ``target_kernel``; random maps implement ``_draw(generator)``, which
(re)draws their buffers. The public ``query``/``key`` validate the input, pick the compute
dtype (fp32 internals for bf16/fp16, see ``polysketch._checks.compute_dtype``) and cast the
result back to the input dtype.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from .._checks import check_feature_input, check_positive_int, compute_dtype
from ..random import make_generator

__all__ = ["FeatureMap", "register", "create", "available", "get_class"]


class FeatureMap(nn.Module, metaclass=ABCMeta):
    """Base class of every feature map: ``(..., D) -> (..., F)``.

    Class attributes a subclass sets:
        name: the registry name (``create(name, ...)``).
        kind: one of ``"exact"`` (φq·φk equals ``target_kernel`` up to rounding),
            ``"unbiased"`` (random; E[φq·φk] equals ``target_kernel``), ``"learned"``
            (trainable approximation), ``"approximate"`` (deterministic approximation or a
            different kernel, e.g. baselines whose ``target_kernel`` is their own kernel).
        is_random: the map holds random buffers that ``redraw_`` redraws.

    Instance attributes:
        dim (int): D, the input dimension.
        square (bool): effective features are φ⊗φ, i.e. the score is (φq·φk)²; the ops
            never materialize the F² features (their states hold F(⌊F/2⌋+1) pair products).
        nonnegative (bool): every score the map produces is >= 0.
    """

    name: str = ""
    kind: str = "exact"
    is_random: bool = False

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

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """φq(x): (..., D) -> (..., F), same dtype as ``x``."""
        x = check_feature_input(x, self.dim, "x")
        return self._query(x.to(compute_dtype(x.dtype))).to(x.dtype)

    def key(self, x: torch.Tensor) -> torch.Tensor:
        """φk(x): (..., D) -> (..., F), same dtype as ``x``."""
        x = check_feature_input(x, self.dim, "x")
        return self._key(x.to(compute_dtype(x.dtype))).to(x.dtype)

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
        tests and fidelity measurement, not for attention.
        """
        check_feature_input(x, self.dim, "x")
        check_feature_input(y, self.dim, "y")
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError("x and y must have shape (..., T, D)")
        s = self.query(x) @ self.key(y).transpose(-1, -2)
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
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorator


def available() -> list[str]:
    """Sorted names of every registered feature map."""
    return sorted(_REGISTRY)


def get_class(name: str) -> type[FeatureMap]:
    """The class registered under ``name``."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown feature map name {name!r}; available: {available()}")
    return _REGISTRY[name]


def create(name: str, dim: int, **kwargs) -> FeatureMap:
    """Build the feature map registered under ``name`` for input dim ``dim``.

    Keyword arguments (``degree=``, ``num_features=``, ``seed=``, ...) go to its class.
    """
    return get_class(name)(dim, **kwargs)
