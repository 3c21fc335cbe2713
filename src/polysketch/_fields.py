"""``documented``: a dataclass field that carries its help text.

The configs (``nn.TransformerConfig``, ``train.TrainConfig``) document each field once, in
``field(metadata={"help": ...})``; the commands generate their flags from the fields
(``polysketch.commands._flags``), so a field, its flag and its help are one thing.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, field
from typing import Any

__all__ = ["documented", "help_of"]


def documented(default: Any = MISSING, *, help: str, default_factory: Any = MISSING) -> Any:
    """``dataclasses.field(default=..., metadata={"help": help})``."""
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def help_of(f: Field) -> str:
    """The help text of a dataclass field ("" when it has none)."""
    return f.metadata.get("help", "")
