"""A small report builder: one list of blocks rendered as Markdown (README.md) and HTML.

``Report`` collects headings, paragraphs, tables, images (PNG files inside the report folder,
referenced by relative path), preformatted text and notes; ``write(out_dir)`` writes
``README.md`` and ``index.html`` from the same blocks, so both show the same numbers and
pictures. ``format_table`` gives the aligned plain-text version printed to the terminal.
``machine_info`` records what the numbers were measured on.

Numbers are formatted by ``fmt`` (3 significant digits, scientific when tiny or huge); a
missing value renders as ``-``; an undefined one (NaN) as ``n/a``, so a report never shows
``nan``/``inf`` where a reader expects a measurement.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Report",
    "fmt",
    "format_table",
    "markdown_table",
    "machine_info",
    "plot_loss_curves",
    "plot_fidelity_panels",
]


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


def _cells(rows: Sequence[Sequence]) -> list[list[str]]:
    return [[fmt(c) for c in row] for row in rows]


def format_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """Aligned plain-text table (for the terminal)."""
    body = _cells(rows)
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
    lines += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in _cells(rows)]
    return "\n".join(lines)


def machine_info() -> dict:
    """CPU count, torch version and threads, platform, Python, polysketch version, date."""
    import torch

    from .. import __version__

    return {
        "cpu_count": os.cpu_count(),
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
                    for row in _cells(b.rows)
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
        md.write_text(self.to_markdown(), encoding="utf-8")
        page.write_text(self.to_html(), encoding="utf-8")
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


# ----- figures of the demo report (drawn with polysketch.eval.plots helpers) ----------------------
def plot_loss_curves(runs: dict[str, dict], path, *, smooth: int = 20) -> Path:
    """Training loss (moving average over ``smooth`` steps) and validation loss vs step.

    ``runs``: label -> history of ``polysketch.train.train`` (``"train"``/``"val"`` rows with
    ``step`` and ``loss``). One colour per run; solid = train, dashed with dots = validation.
    """
    from .plots import pyplot, save_png, subplots

    fig, (ax,) = subplots(1, panel_size=(7.0, 4.2))
    colors = pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, history) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        steps = [r["step"] for r in history["train"]]
        losses = [r["loss"] for r in history["train"]]
        w = max(1, min(int(smooth), len(losses)))
        avg = [
            sum(losses[max(0, j - w + 1) : j + 1]) / (j + 1 - max(0, j - w + 1))
            for j in range(len(losses))
        ]
        ax.plot(steps, avg, color=color, lw=1.4, label=f"{label} train (avg of {w})")
        val = history.get("val", [])
        if val:
            ax.plot(
                [r["step"] for r in val], [r["loss"] for r in val], "o--", color=color, ms=4,
                label=f"{label} validation",
            )  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_png(fig, path)


def plot_fidelity_panels(
    panels: dict[str, tuple[list[dict], list[tuple[int, float]]]], path
) -> Path:
    """Relative Frobenius error vs state dim, one panel per data source, one line per map.

    ``panels``: title -> (rows of ``polysketch.eval.fidelity.evaluate_map``/``sweep``,
    [(rank, optimal relative error)] of the Eckart–Young bound, drawn dashed black).
    """
    from .plots import log_axes, save_png, subplots

    fig, axes = subplots(len(panels), ncols=2)
    for ax, (title, (rows, optimum)) in zip(axes, panels.items(), strict=True):
        ok = [r for r in rows if not r.get("skipped")]
        for name in dict.fromkeys(r["map"] for r in ok):
            pts = sorted(
                (r["state_dim"], r["rel_frobenius_mean"], r["rel_frobenius_std"])
                for r in ok
                if r["map"] == name
            )
            pts = [p for p in pts if math.isfinite(p[1]) and p[1] > 0]
            if pts:
                xs, ys, es = zip(*pts, strict=True)
                ax.errorbar(xs, ys, yerr=es, marker="o", ms=3, capsize=2, lw=1.2, label=name)
        opt = sorted((r, e) for r, e in optimum if math.isfinite(e) and e > 0)
        if opt:
            xs, ys = zip(*opt, strict=True)
            ax.plot(xs, ys, "k--", lw=1.5, label="optimal rank-m (SVD)")
        log_axes(ax)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("state dim (effective features)")
        ax.set_ylabel("relative Frobenius error")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "no results", ha="center", va="center", transform=ax.transAxes)
    return save_png(fig, path)
