"""Moved to ``polysketch.eval.bench.report``.

This path re-exports it for one release, with a DeprecationWarning.
"""

import warnings

from .bench.report import *  # noqa: F403
from .bench.report import __all__  # noqa: F401

warnings.warn(
    "polysketch.eval.bench_report moved to polysketch.eval.bench.report; "
    "this path goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
