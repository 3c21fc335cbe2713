"""Flags generated from config dataclasses, and a TOML config file read before them.

``add_config_flags(group, cls)`` adds one ``--field-name`` per field of a dataclass whose
fields are ``documented`` (``polysketch._fields``): the type from the annotation (``bool``:
``--x`` / ``--no-x``; ``int``, ``float``, ``str``, their ``| None`` forms; ``tuple[float,
float]``: two values), the help from the field, the default from the dataclass. Every
generated flag has ``default=SUPPRESS``: the namespace holds exactly the flags the user gave,
which is what a config file and ``--resume`` need to know (``given``).

``read_config(path, sections)``: a TOML file of ``[section]`` tables whose keys are field
names (``[model] n_layer = 4``); unknown sections or keys are refused naming them. The
command's values are the dataclass defaults, then the file's, then the flags given.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from .._fields import help_of

__all__ = ["add_config_flags", "given", "read_config"]


def _base_type(annotation) -> tuple[type, bool]:
    """(the type a flag parses, whether None is allowed) of a field annotation."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return inner[0], True
    return annotation, False


def _default_text(f) -> str:
    if f.default is not MISSING:
        return repr(f.default)
    if f.default_factory is not MISSING:
        return repr(f.default_factory())
    return "required"


def add_config_flags(
    group,
    cls,
    *,
    skip: Iterable[str] = (),
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[str]:
    """Add ``--field-name`` flags for the fields of dataclass ``cls`` (module docstring).

    ``skip``: fields without a flag (set by the command). ``options``: per field, argparse
    keywords that replace the generated ones (``choices``, ``nargs``/``const``, ``metavar``,
    a ``flag`` name). Returns the fields that got a flag (their ``dest`` is the field name).
    """
    hints = typing.get_type_hints(cls)
    options = options or {}
    added = []
    for f in fields(cls):
        if f.name in skip:
            continue
        extra = dict(options.get(f.name, {}))
        flag = extra.pop("flag", "--" + f.name.replace("_", "-"))
        base, _ = _base_type(hints[f.name])
        text = f"{help_of(f)} (default: {_default_text(f)})".replace("%", "%%")
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": text}
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is tuple:
            elem = typing.get_args(base)
            metavar = tuple(f"{f.name.upper()}_{i}" for i in range(len(elem)))
            kw.update(type=elem[0], nargs=len(elem), metavar=metavar)
        elif base in (int, float, str):
            kw["type"] = base
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no flag for a field of type {base!r}")
        kw.update(extra)
        group.add_argument(flag, **kw)
        added.append(f.name)
    return added


def given(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The values of the flags among ``names`` that the user gave (generated flags only)."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def read_config(path: str | Path, sections: Mapping[str, Iterable[str]]) -> dict[str, dict]:
    """The tables of a TOML config file: {section: {key: value}} for ``sections`` (each with
    the keys it accepts); ValueError naming an unknown section or key, or a file that does not
    parse; FileNotFoundError for a missing file."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError("--config needs Python >= 3.11 or the tomli package") from None
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {path} does not exist")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"--config {path} is not TOML: {err}") from None
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ValueError(f"--config {path}: unknown tables {unknown} (known: {sorted(sections)})")
    out: dict[str, dict] = {}
    for name, keys in sections.items():
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise ValueError(f"--config {path}: [{name}] must be a table")
        bad = sorted(set(table) - set(keys))
        if bad:
            raise ValueError(f"--config {path}: unknown keys {bad} in [{name}] (known: "
                             f"{sorted(keys)})")  # fmt: skip
        out[name] = dict(table)
    return out
