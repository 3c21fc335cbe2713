"""Feature maps: ``(..., D) -> (..., F)`` with ``s(q, k) ≈ φq(q)·φk(k)``.

Every map is a ``FeatureMap`` subclass registered by name; build one with
``create(name, dim, **kwargs)`` and list names with ``available()``.
"""

# Importing a module registers the maps it defines.
from . import (  # noqa: E402,F401  (imported for registration)
    baselines,
    complex_exp,
    exact,
    fpa,
    hedgehog,
    hybrid,
    hybrid_clustered,
    learned,
    llops,
    polysketch,
    random_features,
    tensorsketch,
)
from .base import FeatureMap, available, create, get_class, register

__all__ = ["FeatureMap", "available", "create", "get_class", "register"]
