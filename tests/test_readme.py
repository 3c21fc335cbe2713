"""The README is part of the contract: its example runs and its tables match the code."""

import contextlib
import io
import re
from pathlib import Path

from polysketch import features
from polysketch.nn import PRESETS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


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
