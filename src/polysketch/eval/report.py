"""Moved to ``polysketch.eval.demo.report`` (the tables to ``polysketch.eval.tables``).

This path re-exports it for one release, with a DeprecationWarning.
"""

import warnings

from .demo.figures import plot_fidelity_panels, plot_loss_curves
from .demo.report import Report, machine_info
from .tables import fmt, format_table, markdown_table

__all__ = [
    "Report",
    "fmt",
    "format_table",
    "markdown_table",
    "machine_info",
    "plot_loss_curves",
    "plot_fidelity_panels",
]

warnings.warn(
    "polysketch.eval.report moved to polysketch.eval.demo.report (fmt, format_table, "
    "markdown_table: polysketch.eval.tables); this path goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
