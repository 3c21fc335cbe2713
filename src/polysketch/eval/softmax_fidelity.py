"""Moved to ``polysketch.eval.fidelity.softmax``.

This path re-exports it for one release, with a DeprecationWarning.
"""

import warnings

from .fidelity.softmax import *  # noqa: F403
from .fidelity.softmax import __all__  # noqa: F401

warnings.warn(
    "polysketch.eval.softmax_fidelity moved to polysketch.eval.fidelity.softmax; "
    "this path goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
