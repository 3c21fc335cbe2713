"""polysketch: linear-time kernelized attention.

Layers (imports point down): ``cli``/``train``/``eval`` -> ``nn`` -> ``ops`` -> ``features``
-> ``random``/``_checks``. See README.md for the tour.
"""

from . import features
from ._malloc import hold_freed_memory
from .ops import kernel_attention

__version__ = "0.1.0"

__all__ = ["features", "ops", "kernel_attention", "hold_freed_memory", "__version__"]
