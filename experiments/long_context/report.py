"""Where each long-context table is written: a CSV that grows row by row, and its summaries.

Every table of ``benchmarks/long_context.py`` is one folder (``--out``) holding

* ``TABLE.csv``: one line per measured unit (e.g. one map × context × draw), appended and
  flushed as soon as it is measured, so a table stopped halfway keeps what it finished;
* ``TABLE.settings.json``: the settings the rows were measured with;
* ``TABLE.md`` and ``TABLE.png``: the summary table (with the command, seeds and CPU time)
  and its plot, rewritten from the whole CSV at the end of every run.

``ResultCSV(..., reuse=True)`` continues a table across sessions: rows whose key columns are
already in the CSV are skipped, and the stored settings must equal this run's (otherwise the
rows would mix two experiments). A reused CSV whose columns are the first of this run's (the
table has gained columns at its end since) is rewritten with the new header, its rows empty in
the new columns; any other difference in columns is refused. Without ``reuse`` an existing CSV
is never overwritten unless ``overwrite=True`` is passed.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["ResultCSV", "markdown_table", "parse_value", "fmt", "spec_label"]


def parse_value(text: str):
    """A CSV cell back as int, float or str ('' stays '')."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def fmt(value, spec: str = ".3g") -> str:
    """A cell for a markdown table: '-' for missing or NaN, numbers with ``spec``."""
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return format(value, spec)
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def spec_label(spec: str) -> str:
    """A plot label for an attention spec: ``NAME:k=v,k2=v2`` on one line per part, so
    options that change the model (``local_window=64``) are not cut off."""
    return spec.replace(":", "\n").replace(",", "\n")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A GitHub markdown table (cells already formatted as strings)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class ResultCSV:
    """An append-only CSV of result rows, resumable with ``reuse`` (module docstring).

    Args:
        path: the CSV file (its folder is created).
        columns: every column, in order; rows may omit some (written empty).
        key: the columns that identify a unit of work (``has``).
        settings: JSON-able settings the rows depend on, stored beside the CSV.
        reuse: continue an existing CSV (its settings must match, and its header match or be
            the start of ``columns``: then the file gains the new columns, empty in its rows).
        overwrite: start over even if the CSV exists.

    Raises ValueError naming ``--reuse`` / ``--overwrite`` when the CSV exists and neither is
    given, or when a reused CSV's columns or settings differ from this run's.
    """

    def __init__(
        self,
        path,
        columns: Sequence[str],
        key: Sequence[str],
        *,
        settings: dict,
        reuse: bool = False,
        overwrite: bool = False,
    ):
        self.path = Path(path)
        self.columns = list(columns)
        self.key = list(key)
        missing = [k for k in self.key if k not in self.columns]
        if missing:
            raise ValueError(f"key columns {missing} are not among the columns")
        self.settings_path = self.path.with_suffix(".settings.json")
        self.rows: list[dict] = []
        settings = json.loads(json.dumps(settings))  # as it will read back
        if self.path.exists() and not overwrite:
            if not reuse:
                raise ValueError(
                    f"{self.path} exists: pass --reuse to continue it (rows already there "
                    "are skipped) or --overwrite to start over"
                )
            self._load(settings)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w", newline="") as f:
                csv.DictWriter(f, self.columns).writeheader()
            self.settings_path.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
        self._done = {self._key_of(r) for r in self.rows}

    def _load(self, settings: dict) -> None:
        with open(self.path, newline="") as f:
            reader = csv.DictReader(f)
            stored_columns = list(reader.fieldnames or [])
            if stored_columns != self.columns[: len(stored_columns)] or not stored_columns:
                raise ValueError(
                    f"--reuse: {self.path} has columns {reader.fieldnames}, this run writes "
                    f"{self.columns}; use another --out or --overwrite"
                )
            rows = list(reader)
        self.rows = [{k: parse_value(row.get(k) or "") for k in self.columns} for row in rows]
        stored = (
            json.loads(self.settings_path.read_text()) if self.settings_path.is_file() else None
        )
        if stored != settings:
            diff = sorted(
                k
                for k in set(stored or {}) | set(settings)
                if (stored or {}).get(k) != settings.get(k)
            )
            raise ValueError(
                f"--reuse: {self.path} was measured with other settings (differing: {diff}); "
                "use the same options, another --out, or --overwrite"
            )
        if len(stored_columns) < len(self.columns):  # new columns at the end: empty in old rows
            tmp = self.path.with_suffix(".csv.tmp")
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, self.columns)
                writer.writeheader()
                writer.writerows({k: row.get(k) or "" for k in self.columns} for row in rows)
            tmp.replace(self.path)

    def reload(self) -> None:
        """Read the rows again from the file: with those another process appended to it since
        (two runs writing one folder, a cell each), so that a report drawn now shows both."""
        with open(self.path, newline="") as f:
            rows = list(csv.DictReader(f))
        self.rows = [{k: parse_value(row.get(k) or "") for k in self.columns} for row in rows]
        self._done = {self._key_of(r) for r in self.rows}

    def _key_of(self, row: dict) -> tuple:
        return tuple(str(parse_value(str(row[k]))) for k in self.key)

    def has(self, row: dict) -> bool:
        """Whether a row with ``row``'s key values is already in the table."""
        return self._key_of(row) in self._done

    def add(self, row: dict) -> None:
        """Append ``row`` to the CSV now (flushed) and to ``rows``."""
        extra = [k for k in row if k not in self.columns]
        if extra:
            raise ValueError(f"row has columns {extra} that the table does not")
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow({k: row.get(k, "") for k in self.columns})
        parsed = {k: parse_value(str(row.get(k, ""))) for k in self.columns}
        self.rows.append(parsed)
        self._done.add(self._key_of(parsed))
