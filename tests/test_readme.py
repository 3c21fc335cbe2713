"""The README is part of the contract: its example runs and its tables match the code."""

import contextlib
import io
import re
from pathlib import Path

from polysketch import features
from polysketch.nn import MODEL_PRESETS, PRESETS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _table_after(marker: str) -> list[list[str]]:
    """Rows (cells stripped) of the markdown table following ``marker``, header excluded."""
    lines = README.split(marker, 1)[1].strip().splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_readme_names_the_two_commands():
    assert "make demo" in README and "make test" in README


def test_quickstart_runs_as_written():
    block = re.search(r"## Quickstart\s+```python\n(.*?)```", README, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README-quickstart", "exec"), {})
    printed = out.getvalue()
    assert "torch.Size([2, 4, 1000, 32])" in printed
    assert "tensor_power" in printed


def test_feature_map_table_lists_every_registered_map():
    rows = _table_after("<!-- feature-map-table: checked by tests/test_readme.py -->")
    names = [row[0].strip("`") for row in rows]
    assert sorted(names) == features.available()
    for row in rows:
        kind = row[4]
        assert features.get_class(row[0].strip("`")).kind.split()[0] in kind


def test_preset_table_matches_the_code():
    rows = _table_after("<!-- preset-table: checked by tests/test_readme.py -->")
    assert {row[0].strip("`"): row[1] for row in rows} == {
        name: preset["description"] for name, preset in PRESETS.items()
    }


def test_model_preset_table_matches_the_code():
    rows = _table_after("<!-- model-preset-table: checked by tests/test_readme.py -->")
    assert {row[0].strip("`"): row[1] for row in rows} == {
        name: preset.description for name, preset in MODEL_PRESETS.items()
    }


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped)."""
    anchors = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            text = re.sub(r"[^\w\- ]", "", text)
            anchors.add(text.replace(" ", "-"))
    return anchors


def _broken_links(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            broken.append(target)
    return broken


def test_results_move_to_docs_and_every_link_resolves():
    """README keeps one short section per measured topic linking to docs/results/README.md,
    which holds the full tables; every relative link (and #anchor) of both resolves."""
    results = ROOT / "docs" / "results" / "README.md"
    measured = README.split("## Measured results", 1)[1].split("\n## ", 1)[0]
    assert "docs/results/README.md" in measured
    assert "| 16384 | 888 / 948 |" in results.read_text()  # the full speed table moved there
    assert "| 16384 | 888 / 948 |" not in README
    assert _broken_links(ROOT / "README.md") == []
    assert _broken_links(results) == []


def test_the_link_checker_finds_broken_links(tmp_path):
    (tmp_path / "a.md").write_text("# Title here\n[ok](a.md#title-here) [bad](b.md) [x](a.md#no)\n")
    assert _broken_links(tmp_path / "a.md") == ["b.md", "a.md#no"]
