"""Moved to ``polysketch.eval.demo.fidelity``.

This path re-exports it for one release, with a DeprecationWarning.
"""

import warnings

from .demo.fidelity import MAX_FEATURE_DIM, NOT_CALIBRATED, section_fidelity

__all__ = ["MAX_FEATURE_DIM", "NOT_CALIBRATED", "section_fidelity"]

warnings.warn(
    "polysketch.eval.demo_fidelity moved to polysketch.eval.demo.fidelity; "
    "this path goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
