"""Checkpoints that never lose work, never run code on load, and detect damage.

``save_checkpoint(path, state)`` and ``load_checkpoint(path)`` are the single entry points:
every checkpoint of the package (``polysketch train``, the demo's runs, and later sharded or
context-parallel models) is written and read by them.

Format, version 2: one ``torch.save`` file holding ::

    {"format": "polysketch.checkpoint", "version": 2,
     "sha256": "<64 hex digits>", "state": STATE}

* ``STATE`` is the caller's dict (model, optimizer, scheduler, data position, configs,
  history, ...) plus ``"rng"``: the RNG states of Python (a tuple of ints), NumPy
  (``{"bit_generator": "MT19937", "key": int64 tensor (624,), "pos", "has_gauss",
  "cached_gaussian"}``) and torch (CPU, and every CUDA device), so a resumed run continues
  the very same random streams. Only tensors, dicts, lists, tuples, str, int, float, bool
  and None may appear: ``save_checkpoint`` refuses anything else, naming where it is.
* ``sha256`` is the SHA-256 of a deterministic traversal of ``STATE`` (``state_digest``):
  containers in order (dict items in insertion order, which pickling keeps) with their kind
  and length; each tensor as dtype, shape and raw bytes; each plain leaf as a typed text
  (floats as ``float.hex``); a dict of plain scalars (a history row) as its ``repr``.
  ``load_checkpoint`` recomputes it and refuses a file whose content does not match: a
  flipped bit in tensor data is an error, not a silent change.

Writing is atomic (``polysketch._files.atomic_write``): a crash mid-write leaves the previous
checkpoint intact, and the temporary ``.ckpt.pt.*.tmp`` files of a crashed writer are removed
by ``remove_stale_temporaries`` at the next start. Loading uses
``torch.load(weights_only=True)``: a file whose pickle would import or call anything beyond
tensors and plain containers (a crafted ``__reduce__`` running a command) is refused with a
``CheckpointError`` before anything of it runs. Empty, truncated or otherwise unreadable
files raise ``CheckpointError`` too; every message names the file.

Version 1 (before the safety fixes: the same state, unwrapped, with NumPy's RNG state
pickled as an ``ndarray``) still loads: the NumPy array is rebuilt through an allowlist of
exactly ``numpy.core.multiarray._reconstruct``, ``numpy.ndarray``, ``numpy.dtype`` and the
uint32 dtype class (``torch.serialization.safe_globals``), still under ``weights_only=True``.
It carries no checksum, so it is loaded unverified; the next save writes version 2.

``load_model(path)`` rebuilds the ``TransformerLM`` of a ``polysketch train`` checkpoint (its
``model_config`` and weights, the feature maps' random buffers included), as ``polysketch
generate`` and the experiments in ``experiments/`` load trained models.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import random
import struct
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._files import atomic_write, remove_stale_temporaries

if TYPE_CHECKING:
    from ..nn import ModelSpec

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "CheckpointError",
    "rng_state",
    "set_rng_state",
    "save_checkpoint",
    "load_checkpoint",
    "load_model",
    "state_digest",
    "remove_stale_temporaries",
    "saved_config",
    "stored_model_config",
    "stored_spec",
]

CHECKPOINT_FORMAT = "polysketch.checkpoint"
CHECKPOINT_VERSION = 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded safely and exactly; the message names the file."""


def _numpy_allowlist() -> list:
    """The NumPy globals a version-1 checkpoint's pickled RNG state needs, and no others:
    the array rebuilder, ``ndarray``, ``dtype`` and the uint32 dtype's class (the MT19937 key).
    """
    core = getattr(np, "_core", None) or np.core  # numpy >= 2 | numpy 1.x
    reconstruct = core.multiarray._reconstruct
    allowed = [
        (reconstruct, "numpy.core.multiarray._reconstruct"),  # written by numpy 1.x
        (reconstruct, "numpy._core.multiarray._reconstruct"),  # written by numpy 2.x
        np.ndarray,
        np.dtype,
    ]
    uint32 = type(np.dtype(np.uint32))  # numpy.dtypes.UInt32DType (numpy >= 1.25)
    if uint32 is not np.dtype:
        allowed.append(uint32)
    return allowed


# ----- RNG states --------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """The RNG states of Python, NumPy and torch (CPU and CUDA), as tensors and plain types."""
    bit_generator, key, pos, has_gauss, gauss = np.random.get_state()  # noqa: NPY002
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": str(bit_generator),
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by ``rng_state`` (or a version-1 checkpoint's)."""
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, Mapping):
        key = np.asarray(numpy_state["key"].cpu().numpy(), dtype=np.uint32)
        numpy_state = (
            numpy_state["bit_generator"],
            key,
            int(numpy_state["pos"]),
            int(numpy_state["has_gauss"]),
            float(numpy_state["cached_gaussian"]),
        )
    np.random.set_state(numpy_state)  # noqa: NPY002
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


# ----- the checksum ------------------------------------------------------------------------
def _where(trail: tuple) -> str:
    return "state" + "".join(f"[{key!r}]" for key in trail)


_SCALARS = (int, float, str, bool, type(None))  # exact types: subclasses do not load back
_MAPPINGS = (dict, OrderedDict)
_SEQUENCES = {list: "L", tuple: "U", torch.Size: "Z"}


def _feed(h, parts: list[bytes], obj, trail: tuple) -> None:
    """Append ``obj``'s typed encoding to ``parts`` (tensor bytes go straight into ``h``).

    Accepts exactly the types ``torch.load(weights_only=True)`` reads back (subclasses such
    as NumPy scalars or enums are refused: they would not load)."""
    kind = type(obj)
    if kind is dict and all(type(k) in _SCALARS and type(v) in _SCALARS for k, v in obj.items()):
        # a flat record (a history row): its repr is exact and typed (floats round-trip,
        # 1 != 1.0 != True, quotes mark strings), one call instead of one per leaf
        data = repr(obj).encode("utf-8", "surrogatepass")
        parts.append(b"R" + struct.pack("<Q", len(data)) + data)
    elif isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.layout != torch.strided or t.is_quantized:
            raise TypeError(f"{_where(trail)}: a {t.layout} tensor cannot be checksummed")
        parts.append(f"T{t.dtype}{tuple(t.shape)};".encode())
        h.update(b"".join(parts))
        parts.clear()
        flat = t.cpu().contiguous().reshape(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy())
    elif kind in _MAPPINGS:
        parts.append(f"D{len(obj)};".encode())
        for key, value in obj.items():
            _feed(h, parts, key, trail)
            _feed(h, parts, value, (*trail, key))
    elif kind in _SEQUENCES:
        parts.append(f"{_SEQUENCES[kind]}{len(obj)};".encode())
        for i, value in enumerate(obj):
            _feed(h, parts, value, (*trail, i))
    elif obj is None or kind is bool:
        parts.append(f"B{obj};".encode())
    elif kind is int:
        parts.append(f"I{obj};".encode())
    elif kind is float:
        parts.append(f"F{obj.hex()};".encode())
    elif kind is str:
        data = obj.encode("utf-8", "surrogatepass")
        parts.append(b"S" + struct.pack("<Q", len(data)) + data)
    elif kind in (torch.dtype, torch.device):
        parts.append(f"O{obj};".encode())
    else:
        raise TypeError(
            f"{_where(trail)} is a {kind.__module__}.{kind.__qualname__}: a checkpoint holds "
            "only tensors, dicts, lists, tuples, str, int, float, bool and None (loading "
            "never unpickles other objects); convert it to one of those (e.g. float(x))"
        )


def state_digest(state: Mapping) -> str:
    """SHA-256 (hex) of the deterministic traversal of ``state`` described in the module doc."""
    h = hashlib.sha256(b"polysketch.checkpoint/2;")
    parts: list[bytes] = []
    _feed(h, parts, state, ())
    h.update(b"".join(parts))
    return h.hexdigest()


# ----- save / load -------------------------------------------------------------------------
def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Atomically write ``state`` (plus ``rng_state()`` under ``"rng"``) to ``path``.

    Writes format version 2 (module docstring). Raises ``TypeError`` naming the entry when
    ``state`` holds anything but tensors and plain values, ``OSError`` naming ``path`` when
    the write fails (the previous file at ``path`` is then left intact).
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    payload = dict(state)
    payload.setdefault("rng", rng_state())
    wrapped = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "sha256": state_digest(payload),
        "state": payload,
    }
    return atomic_write(Path(path), lambda fh: torch.save(wrapped, fh))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    for line in text.splitlines():
        if any(cue in line.lower() for cue in ("global", "unsupported", "but got")):
            return line.strip()
    if not text:
        return type(err).__name__
    return text.splitlines()[0].split(". ")[0].strip()  # torch appends paragraphs of advice


def _read(path: Path) -> Any:
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is damaged: the file is empty (0 bytes)")
    try:
        with torch.serialization.safe_globals(_numpy_allowlist()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only" in str(err).lower() or "weights_only" in str(err).lower():
            raise CheckpointError(
                f"checkpoint {path} was refused: loading it would import or call objects that "
                f"a polysketch checkpoint never holds ({_first_line(err)}); it may have been "
                "crafted to run code. Nothing of it was executed."
            ) from None
        raise CheckpointError(
            f"checkpoint {path} is damaged (truncated, empty or corrupt): {_first_line(err)}"
        ) from None
    except (PermissionError, IsADirectoryError) as err:
        raise CheckpointError(f"checkpoint {path} cannot be read: {err.strerror}") from None
    except Exception as err:  # torch.load's errors on a broken file are of any type
        detail = _first_line(err)
        if detail != type(err).__name__:
            detail = f"{type(err).__name__}: {detail}"
        raise CheckpointError(
            f"checkpoint {path} is damaged (truncated or not a torch file): {detail}"
        ) from None


def _to_device(obj, device: torch.device):
    """``obj`` with every tensor moved to ``device`` (what ``torch.load``'s map_location does)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(_to_device(v, device) for v in obj)
    return obj


def load_checkpoint(
    path: str | os.PathLike, *, map_location="cpu", restore_rng: bool = True
) -> dict:
    """Read a checkpoint written by ``save_checkpoint``; restore its RNG states if asked.

    The file is read and verified on the CPU; ``map_location`` (a device) then receives every
    tensor but the RNG states. Returns the ``state`` dict that was saved (with ``"rng"``).
    Raises ``FileNotFoundError`` for a missing file and ``CheckpointError`` (a ``ValueError``
    naming the file) for a file that is refused (code on load), damaged (empty, truncated,
    checksum mismatch), written by a newer format version, or not a polysketch checkpoint.
    """
    path = Path(path)
    if map_location is not None and not isinstance(map_location, (str, torch.device)):
        raise TypeError(
            "map_location must be a device (str or torch.device), got "
            f"{type(map_location).__name__}"
        )
    device = torch.device(map_location) if map_location is not None else torch.device("cpu")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    obj = _read(path)
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"checkpoint {path} is not a polysketch checkpoint (holds a {type(obj).__name__})"
        )
    if "format" in obj:
        if obj.get("format") != CHECKPOINT_FORMAT or not isinstance(obj.get("version"), int):
            raise CheckpointError(f"checkpoint {path} has an unknown format {obj.get('format')!r}")
        if obj["version"] > CHECKPOINT_VERSION:
            raise CheckpointError(
                f"checkpoint {path} has format version {obj['version']}; this polysketch reads "
                f"versions <= {CHECKPOINT_VERSION}: upgrade polysketch"
            )
        state = obj.get("state")
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint {path} is damaged: its state is not a dict")
        try:
            digest = state_digest(state)
        except TypeError as err:
            raise CheckpointError(f"checkpoint {path} is damaged: {err}") from None
        if digest != obj.get("sha256"):
            raise CheckpointError(
                f"checkpoint {path} is corrupt: its content does not match the sha256 stored "
                "in it (a damaged copy or disk): restore it from a backup or train again"
            )
    else:  # version 1: the state itself, no checksum (see the module docstring)
        state = obj
    if restore_rng and "rng" in state:
        set_rng_state(state["rng"])
    if device.type != "cpu":  # verified on the CPU, then moved (the RNG states stay there)
        state = {k: v if k == "rng" else _to_device(v, device) for k, v in state.items()}
    return state


def saved_config(config_class, saved: Mapping) -> dict:
    """A checkpoint's config dict (``model_config``, ``train_config``) with today's defaults
    for the fields of the dataclass ``config_class`` that it predates.

    A field added to ``TransformerConfig`` or ``TrainConfig`` defaults to the behaviour of
    the releases before it (``local_window=None``, ``pack=False``, ...), so a run saved
    before the field existed is the same run with that default: resuming or reusing it
    compares this dict, not the stored one, with the current config.
    """
    defaults = {}
    for f in dataclasses.fields(config_class):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return {**defaults, **saved}


def stored_model_config(config) -> dict:
    """The ``model_config`` a checkpoint stores for the ``TransformerConfig`` ``config``, or a
    checkpoint's stored ``model_config`` (a mapping) in today's form, so that the two compare
    equal for the same run.

    That is ``asdict(config)`` with today's defaults for the fields a stored one predates
    (``saved_config``) and the training-only ``gradient_surrogate`` written out
    (``config.resolve().attention.gradient_surrogate``: a model preset's λ where the field is None).
    A preset's weights and shapes are checked when its state dict loads, but its λ only shapes later
    updates: stored resolved, a resumed run keeps the λ it was trained with when the preset's
    changes. A stored config of an older version holds None there and takes the current preset's. A
    mapping with a field this version does not know is returned as ``saved_config`` gives it (it
    equals no config of today).
    """
    from ..nn import TransformerConfig

    if isinstance(config, Mapping):
        saved = saved_config(TransformerConfig, config)
        try:
            config = TransformerConfig(**saved)
        except TypeError:
            return saved
    try:
        lam = config.resolve().attention.gradient_surrogate
    except (TypeError, ValueError):  # not a config of today's models: compares as it is
        return dataclasses.asdict(config)
    return {**dataclasses.asdict(config), "gradient_surrogate": lam}


def stored_spec(state: Mapping | None, path) -> ModelSpec | None:
    """The ``ModelSpec`` a checkpoint stores (``model_spec``: what its model computed, kept
    when a preset of the same name changes later), or None for a checkpoint written before
    specs were stored (its ``model_config`` is resolved instead; ``stored_model_config``
    wrote out the one preset value that could change under it, λ). ``CheckpointError`` when
    the stored spec does not parse."""
    from ..nn import ModelSpec

    if state is None or state.get("model_spec") is None:
        return None
    data = state["model_spec"]
    block = (state.get("model_config") or {}).get("chunk_size")
    if isinstance(data, Mapping) and block is not None:  # specs before 2026-12-07: the block
        data = dict(data)  # was the config's, not the spec's: carried into both attentions
        for key in ("attention", "window_attention"):
            if isinstance(data.get(key), Mapping) and "chunk_size" not in data[key]:
                data[key] = {**data[key], "chunk_size": block}
    try:
        return ModelSpec.from_dict(data)
    except (TypeError, ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint {path}: its model_spec does not parse ({err})") from None


def load_model(path: str | os.PathLike, device: str | torch.device | None = None):
    """``(model, state)``: the ``TransformerLM`` of a ``polysketch train`` checkpoint, in eval
    mode on ``device`` (default: cuda if available, else cpu), and the checkpoint's state.

    The RNG states are not restored. Raises ``CheckpointError`` (a ``ValueError`` naming the
    file) for a refused, damaged or foreign checkpoint, or one whose ``model_config`` does not
    fit its weights; ``FileNotFoundError`` for a missing file.
    """
    from ..nn import TransformerConfig, TransformerLM

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    state = load_checkpoint(path, map_location=device, restore_rng=False)
    if "model_config" not in state or "model" not in state:
        raise CheckpointError(f"checkpoint {path} was not written by `polysketch train`")
    try:
        config = TransformerConfig(**state["model_config"]).validate()
        model = TransformerLM(config, stored_spec(state, path))
        model.load_state_dict(state["model"])
    except (TypeError, ValueError, RuntimeError, KeyError) as err:
        detail = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        raise CheckpointError(
            f"checkpoint {path}: its model_config does not fit its weights "
            f"({type(err).__name__}: {detail})"
        ) from None
    return model.to(device).eval(), state
