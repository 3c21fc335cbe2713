"""The report of ``polysketch demo``: three sections measured on this machine.

* ``settings``: ``DemoSizes`` (``FULL``, ``CUDA_FULL``, ``QUICK``) and the compared attention;
* ``quality``, ``fidelity``, ``speed``: ``section_*(args, sizes, report, state) -> dict``;
* ``report``: ``Report`` (Markdown + HTML from one list of blocks), ``machine_info``;
* ``figures``: the loss curves and the fidelity panels.
"""

from .fidelity import MAX_FEATURE_DIM, NOT_CALIBRATED, section_fidelity
from .figures import plot_fidelity_panels, plot_loss_curves
from .quality import section_quality
from .report import Report, load_average, machine_info
from .settings import CUDA_FULL, FULL, QUICK, DemoSizes, polysketch_attention
from .speed import section_speed

__all__ = [
    "CUDA_FULL",
    "FULL",
    "MAX_FEATURE_DIM",
    "NOT_CALIBRATED",
    "QUICK",
    "DemoSizes",
    "Report",
    "load_average",
    "machine_info",
    "plot_fidelity_panels",
    "plot_loss_curves",
    "polysketch_attention",
    "section_fidelity",
    "section_quality",
    "section_speed",
]
