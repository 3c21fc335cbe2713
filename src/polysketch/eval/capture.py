"""Moved to ``polysketch.eval.fidelity.capture``.

This path re-exports it for one release, with a DeprecationWarning.
"""

import warnings

from .fidelity.capture import *  # noqa: F403
from .fidelity.capture import __all__  # noqa: F401

warnings.warn(
    "polysketch.eval.capture moved to polysketch.eval.fidelity.capture; "
    "this path goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
