"""Feature maps: ``(..., D) -> (..., F)`` with ``s(q, k) ≈ φq(q)·φk(k)``.

Every map is a ``FeatureMap`` subclass registered by name; build one with
``create(name, dim, **kwargs)`` and list names with ``available()`` (or ``available(family)``).
Each map declares its target ``family``, its ``hyperparameters`` and how it treats the shared
keywords (``base``). Beside the maps: ``fitting`` (fitting a map to data), ``optimal_rank``
(the Eckart–Young optimum a map is measured against) and ``stability`` (stabilized queries and
the range checks of the attention path).
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
    soft_hash,
    tensorsketch,
)
from .base import (
    FAMILIES,
    SHARED_KEYWORDS,
    FeatureMap,
    Fixed,
    Hyperparameter,
    available,
    create,
    get_class,
    register,
)

__all__ = [
    "FAMILIES",
    "SHARED_KEYWORDS",
    "FeatureMap",
    "Fixed",
    "Hyperparameter",
    "available",
    "create",
    "get_class",
    "register",
]
