"""What every command does the same way: its output folder, its device, its error line.

* ``prepare_out_dir(path, overwrite=...)``: a command that writes a folder (``--out``) never
  replaces an earlier run's results unasked. A non-empty folder is refused unless the user
  passes ``--overwrite`` (or ``--resume`` for ``polysketch train``); a path that is a file,
  or a folder that cannot be created or written, is refused too. Every refusal is a
  ``ValueError`` whose message names the flag and the fix.
* ``check_device(spec)``: ``--device cuda`` on a machine without CUDA (or any device torch
  cannot use) is refused before any work, naming the flag.
* ``fail(command, message)``: the one error line (``polysketch CMD: error: ...`` on stderr)
  and exit status 2; ``warn`` prints a ``warning:`` line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = [
    "ERROR_EXIT",
    "add_overwrite_argument",
    "check_device",
    "fail",
    "io_error",
    "prepare_out_dir",
    "warn",
]

ERROR_EXIT = 2


def fail(command: str, message) -> int:
    """Print ``polysketch COMMAND: error: MESSAGE`` to stderr; return the exit status 2."""
    print(f"polysketch {command}: error: {message}", file=sys.stderr)
    return ERROR_EXIT


def warn(command: str, message) -> None:
    """Print ``polysketch COMMAND: warning: MESSAGE`` to stderr."""
    print(f"polysketch {command}: warning: {message}", file=sys.stderr)


def io_error(err: OSError, out) -> str:
    """``err``'s message, naming the output folder when the error names no file (ENOSPC)."""
    text = str(err)
    if err.filename is None and "cannot write" not in text:
        text += f" (while writing into --out {out})"
    return text


def add_overwrite_argument(parser: argparse.ArgumentParser, what: str = "results") -> None:
    """``--overwrite``: allow writing into a non-empty ``--out`` (replacing its files)."""
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help=f"write into a non-empty --out, replacing the {what} there (without it, a "
        "non-empty --out is refused so that no earlier run is lost)",
    )


def prepare_out_dir(
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    flag: str = "--out",
    allow: Iterable[str] = (),
    hint: str = "",
) -> Path:
    """Create the output folder ``path`` or check that writing into it loses nothing.

    Refused (``ValueError`` naming ``flag``): ``path`` is a file; ``path`` holds entries
    other than the names in ``allow`` and ``overwrite`` is false; ``path`` cannot be created
    or written. ``hint`` is appended to the non-empty refusal (e.g. "pass --resume to
    continue it"). Returns ``path`` as a ``Path``, created.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder: choose another {flag}")
    if path.is_dir() and not overwrite:
        allowed = set(allow)
        entries = sorted(p.name for p in path.iterdir() if p.name not in allowed)
        if entries:
            shown = ", ".join(entries[:4])
            if len(entries) > 4:
                shown += f" and {len(entries) - 4} more"
            raise ValueError(
                f"{flag} {path} is not empty (it holds {shown}): pass --overwrite to replace "
                f"its results{hint}, or choose another {flag}"
            )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"{flag} {path} cannot be created ({err.strerror or err}): choose another {flag}"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} is not writable: choose another {flag}")
    return path


def check_device(spec, flag: str = "--device") -> str | None:
    """Return ``spec`` if torch can compute on that device here; else a ValueError naming flag.

    ``None`` (the command's default) passes. ``cuda`` needs ``torch.cuda.is_available()``
    and an index below the device count; ``mps`` and other accelerator types need their
    backend's ``is_available()``.
    """
    if spec is None:
        return None
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"{flag} must be a torch device such as cpu or cuda, got {spec!r}"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch has no CUDA build" if torch.version.cuda is None else "no GPU seen"
            raise ValueError(f"{flag} {spec}: CUDA is not available here ({why}): use {flag} cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"{flag} {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"{flag} {spec}: MPS is not available here: use {flag} cpu")
    elif device.type == "meta":
        raise ValueError(f"{flag} meta holds no data and computes nothing: use {flag} cpu")
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None)
        available = getattr(backend, "is_available", None)
        if available is None or not available():
            raise ValueError(f"{flag} {spec}: {device.type} is not available here: use {flag} cpu")
    return spec
