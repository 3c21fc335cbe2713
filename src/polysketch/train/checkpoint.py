"""Checkpoints that never lose work and resume exactly.

A checkpoint is one ``torch.save`` file written atomically: the bytes go to a temporary file
in the same folder, are flushed and fsync'ed, and the file is renamed over the target
(``os.replace`` is atomic on POSIX and Windows), so a crash mid-write leaves the previous
checkpoint intact. It holds whatever state dicts the caller passes (model — including the
feature maps' random buffers —, optimizer, scheduler, data position, ...) plus the RNG states
of Python, NumPy and torch (CPU and every CUDA device), so that resuming continues the very
same random streams.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state", "save_checkpoint", "load_checkpoint"]


def rng_state() -> dict[str, Any]:
    """The RNG states of Python, NumPy and torch (CPU and CUDA)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002 (legacy global state is what we save)
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by ``rng_state``."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Atomically write ``state`` (plus ``rng_state()`` under ``"rng"``) to ``path``."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(state)
    payload.setdefault("rng", rng_state())
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    # make the rename itself durable
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(dir_fd)
    return path


def load_checkpoint(
    path: str | os.PathLike, *, map_location="cpu", restore_rng: bool = True
) -> dict:
    """Read a checkpoint written by ``save_checkpoint``; restore its RNG states if asked."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    state = torch.load(path, map_location=map_location, weights_only=False)
    if restore_rng and "rng" in state:
        set_rng_state(state["rng"])
    return state
