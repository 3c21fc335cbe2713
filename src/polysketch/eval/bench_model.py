"""Moved to ``polysketch.eval.bench.model``.

This path re-exports it for one release, with a DeprecationWarning.
"""

import warnings

from .bench.model import *  # noqa: F403
from .bench.model import __all__  # noqa: F401

warnings.warn(
    "polysketch.eval.bench_model moved to polysketch.eval.bench.model; "
    "this path goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
