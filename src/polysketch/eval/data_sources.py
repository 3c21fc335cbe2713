"""Moved to ``polysketch.eval.fidelity.data_sources``.

This path re-exports it for one release, with a DeprecationWarning.
"""

import warnings

from .fidelity.data_sources import *  # noqa: F403
from .fidelity.data_sources import __all__  # noqa: F401

warnings.warn(
    "polysketch.eval.data_sources moved to polysketch.eval.fidelity.data_sources; "
    "this path goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
