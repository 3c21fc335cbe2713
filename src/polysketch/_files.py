"""Files written safely: atomically, durably and with the user's umask.

``atomic_write(path, data)`` writes to a temporary file beside ``path`` (``.{name}.*.tmp``),
flushes and fsyncs it, renames it over ``path`` (``os.replace`` is atomic on POSIX and
Windows) and fsyncs the folder, so a crash mid-write leaves the previous file intact and a
reader never sees half a file. ``mkstemp`` / ``mkdtemp`` create their entries with modes
0600 / 0700; the entries here get the modes a plain ``open`` / ``mkdir`` would give
(0666 / 0777 minus the process umask), so outputs stay readable by whoever the user's umask
allows. ``remove_stale_temporaries(path)`` deletes the temporary files a crashed writer of
``path`` left behind. A failed write raises ``OSError`` naming ``path`` (ENOSPC included).

``write_csv(rows, path)`` writes result rows (dicts) as a CSV file through ``atomic_write``.

This is the one writer of the package: checkpoints (``polysketch.train.checkpoint``) and the
result files of the CLI and of ``polysketch.eval`` (CSV, JSON, PNG) go through it.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "atomic_write",
    "write_csv",
    "replace_dir",
    "remove_stale_temporaries",
    "temporary_pattern",
    "process_umask",
    "file_mode",
    "dir_mode",
]


def process_umask() -> int:
    """The process umask (read from /proc where possible, so it is never changed, even briefly)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc (macOS, Windows): the classic read-and-restore
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0o666 minus the umask."""
    return 0o666 & ~process_umask()


def dir_mode() -> int:
    """The mode ``os.mkdir`` gives a new folder: 0o777 minus the umask."""
    return 0o777 & ~process_umask()


def temporary_pattern(path: str | os.PathLike) -> str:
    """The glob of ``atomic_write``'s temporary files for ``path`` (in ``path``'s folder)."""
    return f".{Path(path).name}.*.tmp"


def _fail(err: OSError, path: Path) -> OSError:
    """``err`` re-raised with ``path`` in its message (a write error names no file)."""
    reason = err.strerror or str(err) or type(err).__name__
    message = f"cannot write {path}: {reason}"
    return OSError(err.errno, message) if err.errno is not None else OSError(message)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the file system allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on folders; the rename is still atomic
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes | Callable[[BinaryIO], None]) -> Path:
    """Write ``data`` (bytes, or a function writing to a binary file) to ``path`` atomically.

    Creates the parent folders. The new file gets mode 0o666 minus the umask. On failure the
    temporary file is removed, an existing ``path`` is left as it was, and an ``OSError``
    naming ``path`` is raised (other exceptions of ``data`` pass through unchanged).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise _fail(err, path) from err
    try:
        with os.fdopen(fd, "wb") as fh:
            if hasattr(os, "fchmod"):
                os.fchmod(fh.fileno(), file_mode())
            if callable(data):
                data(fh)
            else:
                fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise _fail(err, path) from err
        raise
    if not hasattr(os, "fchmod"):  # pragma: no cover - Windows
        os.chmod(path, file_mode())
    _fsync_dir(path.parent)
    return path


def replace_dir(path: str | os.PathLike, fill: Callable[[Path], None]) -> Path:
    """Build a folder with ``fill(tmp)`` beside ``path``, then swap it into ``path``.

    The folder and everything ``fill`` created in it get the modes of a plain ``mkdir`` /
    ``open`` (0o777 / 0o666 minus the umask). An existing ``path`` is moved aside and
    removed only after the new folder is in place; on failure the partial folder is removed.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
        os.chmod(tmp, dir_mode())
    except OSError as err:
        raise _fail(err, path) from err
    try:
        fill(tmp)
        for entry in tmp.rglob("*"):  # writers that use mkstemp themselves leave 0600 files
            if not entry.is_symlink():
                os.chmod(entry, dir_mode() if entry.is_dir() else file_mode())
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise _fail(err, path) from err
        raise
    _fsync_dir(path.parent)
    return path


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Delete the temporary files a crashed ``atomic_write(path, ...)`` left; return them.

    Call it when nothing else writes ``path`` (at the start of the run that owns it).
    """
    path = Path(path)
    if not path.parent.is_dir():
        return []
    removed = []
    for stale in sorted(path.parent.glob(temporary_pattern(path))):
        if stale.is_file() and not stale.is_symlink():
            stale.unlink(missing_ok=True)
            removed.append(stale)
    return removed


def write_csv(
    rows: Iterable[dict],
    path: str | os.PathLike,
    *,
    columns: Sequence[str] | None = None,
    float_format: str | None = None,
) -> Path:
    """Write ``rows`` (dicts) to ``path`` as CSV with a header, atomically (``atomic_write``).

    ``columns``: the header, in order (default: the union of the rows' keys, in first-seen
    order); a row's missing keys are empty cells, and keys outside ``columns`` are left out.
    ``float_format``: a format spec for float cells (e.g. ``".6g"``; default ``str``).
    Creates the parent folders; returns ``path``.
    """
    rows = list(rows)
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=list(columns), restval="", extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        if float_format is not None:
            row = {k: _cell(v, float_format) for k, v in row.items()}
        writer.writerow(row)
    return atomic_write(Path(path), buffer.getvalue().encode())


def _cell(value, float_format: str):
    return format(value, float_format) if isinstance(value, float) else value
