"""A small report builder: one list of blocks rendered as Markdown (README.md) and HTML.

``Report`` collects headings, paragraphs, tables, images (PNG files inside the report folder,
referenced by relative path), preformatted text and notes; ``write(out_dir)`` writes
``README.md`` and ``index.html`` from the same blocks, so both show the same numbers and
pictures (both written atomically).
``machine_info`` records what the numbers were measured on (with the load average,
``load_average``). Cells are formatted as in ``polysketch.eval.tables`` (``fmt``: a missing
value is ``-``, NaN is ``n/a``).
"""

from __future__ import annotations

import datetime as _dt
import html
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..._files import atomic_write
from ..tables import cells, markdown_table

__all__ = ["Report", "load_average", "machine_info"]


def load_average() -> float | None:
    """The 1-minute load average (processes running or waiting for a CPU), None if unknown."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def machine_info() -> dict:
    """CPU count, load average, torch version and threads, platform, Python, polysketch
    version, date."""
    import torch

    from ... import __version__

    return {
        "cpu_count": os.cpu_count(),
        "load_1min": load_average(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "polysketch": __version__,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
    }


@dataclass
class _Block:
    kind: str  # heading, paragraph, table, image, pre, note
    text: str = ""
    level: int = 2
    headers: tuple = ()
    rows: list = field(default_factory=list)


class Report:
    """An ordered list of blocks rendered to Markdown and HTML (module docstring)."""

    def __init__(self, title: str):
        self.title = str(title)
        self.blocks: list[_Block] = []

    def heading(self, text: str, level: int = 2) -> None:
        self.blocks.append(_Block("heading", str(text), level=int(level)))

    def paragraph(self, text: str) -> None:
        self.blocks.append(_Block("paragraph", str(text)))

    def note(self, text: str) -> None:
        """A highlighted remark (e.g. a section that could not run, and why)."""
        self.blocks.append(_Block("note", str(text)))

    def table(self, headers: Sequence[str], rows: Sequence[Sequence]) -> None:
        rows = [list(r) for r in rows]
        for r in rows:
            if len(r) != len(headers):
                raise ValueError(f"rows must have {len(headers)} cells, got {len(r)}")
        self.blocks.append(_Block("table", headers=tuple(headers), rows=rows))

    def image(self, path: str, caption: str = "") -> None:
        """A PNG at ``path``, relative to the report folder."""
        self.blocks.append(_Block("image", str(caption), headers=(str(path),)))

    def pre(self, text: str) -> None:
        self.blocks.append(_Block("pre", str(text)))

    def images(self) -> list[str]:
        """Relative paths of every image block."""
        return [b.headers[0] for b in self.blocks if b.kind == "image"]

    # ----- rendering ---------------------------------------------------------------------------
    def to_markdown(self) -> str:
        parts = [f"# {self.title}"]
        for b in self.blocks:
            if b.kind == "heading":
                parts.append("#" * b.level + " " + b.text)
            elif b.kind == "paragraph":
                parts.append(b.text)
            elif b.kind == "note":
                parts.append("> **Note:** " + b.text.replace("\n", "\n> "))
            elif b.kind == "table":
                parts.append(markdown_table(b.headers, b.rows))
            elif b.kind == "image":
                parts.append(f"![{b.text}]({b.headers[0]})" + (f"\n\n*{b.text}*" if b.text else ""))
            elif b.kind == "pre":
                fence = "````" if "```" in b.text else "```"
                parts.append(f"{fence}text\n{b.text}\n{fence}")
        return "\n\n".join(parts) + "\n"

    def to_html(self) -> str:
        e = html.escape
        body = [f"<h1>{e(self.title)}</h1>"]
        for b in self.blocks:
            if b.kind == "heading":
                level = min(max(b.level, 1), 6)
                body.append(f"<h{level}>{e(b.text)}</h{level}>")
            elif b.kind == "paragraph":
                body.append(f"<p>{_inline_html(b.text)}</p>")
            elif b.kind == "note":
                body.append(f'<p class="note"><b>Note:</b> {_inline_html(b.text)}</p>')
            elif b.kind == "table":
                head = "".join(f"<th>{e(h)}</th>" for h in b.headers)
                rows = "".join(
                    "<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>"
                    for row in cells(b.rows)
                )
                body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
            elif b.kind == "image":
                src = e(b.headers[0], quote=True)
                cap = f"<figcaption>{e(b.text)}</figcaption>" if b.text else ""
                body.append(
                    f'<figure><img src="{src}" alt="{e(b.text, quote=True)}">{cap}</figure>'
                )
            elif b.kind == "pre":
                body.append(f"<pre>{e(b.text)}</pre>")
        return _HTML.format(title=e(self.title), body="\n".join(body))

    def write(self, out_dir) -> tuple[Path, Path]:
        """Write ``README.md`` and ``index.html`` into ``out_dir``; return their paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        md, page = out / "README.md", out / "index.html"
        atomic_write(md, self.to_markdown().encode("utf-8"))
        atomic_write(page, self.to_html().encode("utf-8"))
        return md, page


def _inline_html(text: str) -> str:
    """Escape, then turn Markdown `code` spans into <code> (the only inline markup used)."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


_HTML = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 60em; margin: 2em auto; padding: 0 1em;
       line-height: 1.45; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }}
th {{ background: #f3f3f3; }}
td:first-child, th:first-child {{ text-align: left; }}
pre {{ background: #f6f6f6; padding: 0.8em; overflow-x: auto; white-space: pre-wrap; }}
figure {{ margin: 1em 0; }} img {{ max-width: 100%; }}
figcaption {{ font-style: italic; font-size: 0.9em; }}
.note {{ background: #fff6dd; border-left: 4px solid #e0b000; padding: 0.5em 0.8em; }}
</style>
</head>
<body>
{body}
</body>
</html>
"""
