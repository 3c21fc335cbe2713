"""Result tables as text: one cell format, aligned plain text (terminal) and Markdown.

Numbers are formatted by ``fmt`` (3 significant digits, scientific when tiny or huge); a
missing value renders as ``-``; an undefined one (NaN) as ``n/a``, so a table never shows
``nan``/``inf`` where a reader expects a measurement. CSV files are written by
``polysketch._files.write_csv``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["fmt", "cells", "format_table", "markdown_table"]


def fmt(value, digits: int = 3) -> str:
    """A table cell: ints as is, floats to ``digits`` significant digits, None -> "-"."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}"
    return str(value)


def cells(rows: Sequence[Sequence]) -> list[list[str]]:
    """Every cell of ``rows`` formatted by ``fmt``."""
    return [[fmt(c) for c in row] for row in rows]


def format_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """Aligned plain-text table (for the terminal)."""
    body = cells(rows)
    lines = [list(headers), *body]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    out = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    ]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """GitHub-flavoured Markdown table."""
    lines = [
        "| " + " | ".join(_md_escape(h) for h in headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in cells(rows)]
    return "\n".join(lines)
