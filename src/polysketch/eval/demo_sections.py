"""Moved to ``polysketch.eval.demo``.

This path re-exports it for one release, with a DeprecationWarning.
"""

import warnings

from .demo.quality import section_quality
from .demo.settings import CUDA_FULL, FULL, QUICK, DemoSizes, polysketch_attention
from .demo.speed import section_speed

__all__ = [
    "DemoSizes",
    "FULL",
    "CUDA_FULL",
    "QUICK",
    "polysketch_attention",
    "section_quality",
    "section_speed",
]

warnings.warn(
    "polysketch.eval.demo_sections moved to polysketch.eval.demo; "
    "this path goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
