"""Checkpoint format 2: no code runs on load, a checksum catches damage, old files still load."""

import os
import random
import shlex
import stat

import numpy as np
import pytest
import torch

from polysketch._files import atomic_write, process_umask, remove_stale_temporaries
from polysketch.train import CheckpointError, load_checkpoint, save_checkpoint
from polysketch.train.checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, state_digest


class RunsCommand:
    """Unpickling this runs a shell command (the classic crafted-checkpoint payload)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def crafted_checkpoint(path, marker):
    """A file shaped like a checkpoint whose pickle would create ``marker`` when loaded."""
    payload = {"model": {"w": torch.ones(2)}, "model_config": {},
               "evil": RunsCommand(f"touch {shlex.quote(str(marker))}")}  # fmt: skip
    torch.save(payload, path)
    assert not marker.exists()
    return path


def legacy_checkpoint(path, state):
    """A checkpoint as the code before format 2 wrote it: the state itself, no checksum,
    NumPy's RNG state pickled as an ndarray tuple (np.random.get_state())."""
    payload = dict(state)
    payload["rng"] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002
        "torch": torch.get_rng_state(),
    }
    torch.save(payload, path)
    return path


def _draws():
    return (random.random(), np.random.rand(), torch.rand(()).item())  # noqa: NPY002


def test_round_trip_restores_every_rng_and_holds_no_pickled_objects(tmp_path):
    path = tmp_path / "ckpt.pt"
    model = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    state = {"model": model, "step": 7, "history": [{"loss": 0.5, "split": "train"}],
             "cfg": (1, None, True)}  # fmt: skip
    np.random.normal()  # noqa: NPY002  (a cached Gaussian is part of NumPy's legacy state)
    save_checkpoint(path, state)
    expected = _draws()
    _draws()  # move every stream on
    loaded = load_checkpoint(path)
    assert _draws() == expected
    assert loaded["step"] == 7 and loaded["cfg"] == (1, None, True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert loaded["model"]["b"].dtype == torch.bfloat16
    # the file itself: format 2, plain types only (loads with weights_only and no allowlist)
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == CHECKPOINT_FORMAT and raw["version"] == CHECKPOINT_VERSION == 2
    assert raw["sha256"] == state_digest(raw["state"])
    assert isinstance(raw["state"]["rng"]["numpy"]["key"], torch.Tensor)


def test_legacy_checkpoint_with_pickled_numpy_state_still_loads(tmp_path):
    path = legacy_checkpoint(tmp_path / "old.pt", {"model": {"w": torch.ones(3)}, "step": 2})
    expected = _draws()
    loaded = load_checkpoint(path)
    assert _draws() == expected  # the NumPy ndarray state went through the allowlist
    assert loaded["step"] == 2 and torch.equal(loaded["model"]["w"], torch.ones(3))


def test_crafted_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = crafted_checkpoint(tmp_path / "ckpt.pt", marker)
    with pytest.raises(CheckpointError, match="refused") as err:
        load_checkpoint(path, restore_rng=False)
    assert str(path) in str(err.value) and "system" in str(err.value)
    assert not marker.exists()


def _flip_bit_in(path, needle: bytes):
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0
    data[at + len(needle) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_flipped_bit_in_tensor_data_is_detected(tmp_path):
    weights = torch.linspace(0.1, 7.3, 64, dtype=torch.float64)
    path = save_checkpoint(tmp_path / "ckpt.pt", {"model": {"w": weights}})
    _flip_bit_in(path, weights.numpy().tobytes())
    with pytest.raises(CheckpointError, match="corrupt") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("damage", ["empty", "truncated", "junk"])
def test_damaged_files_raise_an_error_naming_the_file(tmp_path, damage):
    path = save_checkpoint(tmp_path / "ckpt.pt", {"model": {"w": torch.randn(100)}})
    data = path.read_bytes()
    path.write_bytes({"empty": b"", "truncated": data[: len(data) // 2],
                      "junk": b"not a checkpoint" * 10}[damage])  # fmt: skip
    with pytest.raises(CheckpointError, match="damaged") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


def test_newer_versions_and_foreign_files_are_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"format": CHECKPOINT_FORMAT, "version": 99, "sha256": "", "state": {}}, path)
    with pytest.raises(CheckpointError, match="version 99"):
        load_checkpoint(path)
    torch.save([torch.ones(1)], path)
    with pytest.raises(CheckpointError, match="not a polysketch checkpoint"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_checkpoint(tmp_path / "missing.pt")


def test_save_refuses_objects_loading_would_have_to_unpickle(tmp_path):
    path = tmp_path / "ckpt.pt"
    with pytest.raises(TypeError, match=r"state\['metadata'\]\['when'\]"):
        save_checkpoint(path, {"metadata": {"when": object()}})
    with pytest.raises(TypeError, match=r"state\['history'\]\[0\]\['loss'\] is a numpy"):
        save_checkpoint(path, {"history": [{"loss": np.float64(0.5)}]})  # would not load back
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary left
    state = {"shape": torch.Size([2, 3]), "dtype": torch.float16, "device": torch.device("cpu")}
    save_checkpoint(path, state)
    loaded = load_checkpoint(path, restore_rng=False)
    assert {k: loaded[k] for k in state} == state and type(loaded["shape"]) is torch.Size


def test_digest_sees_values_types_and_order():
    base = {"a": torch.ones(2), "b": [1, 2.0, "x", None]}
    variants = [
        {"a": torch.ones(2, dtype=torch.float64), "b": [1, 2.0, "x", None]},
        {"a": torch.ones(1, 2), "b": [1, 2.0, "x", None]},
        {"a": torch.ones(2), "b": [1, 2, "x", None]},
        {"a": torch.ones(2), "b": (1, 2.0, "x", None)},
        {"b": [1, 2.0, "x", None], "a": torch.ones(2)},
        {"a": torch.ones(2), "b": [1, 2.0, "x", False]},
    ]
    digests = {state_digest(v) for v in variants}
    assert len(digests) == len(variants) and state_digest(base) not in digests
    assert state_digest(base) == state_digest({"a": torch.ones(2), "b": [1, 2.0, "x", None]})


def test_atomic_write_follows_the_umask_and_names_the_file_on_failure(tmp_path):
    path = atomic_write(tmp_path / "sub" / "out.bin", b"data")
    assert path.read_bytes() == b"data"
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~process_umask()
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", {"x": 1})
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o666 & ~process_umask()

    def no_space(fh):
        fh.write(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match=r"cannot write .*out\.bin: No space left") as err:
        atomic_write(path, no_space)
    assert err.value.errno == 28
    assert path.read_bytes() == b"data"  # the previous file is intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.bin"]


def test_umask_is_followed_under_a_strict_umask(tmp_path):
    old = os.umask(0o077)
    try:
        path = atomic_write(tmp_path / "private.bin", b"x")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        os.umask(old)
    path = atomic_write(tmp_path / "shared.bin", b"x")
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~old


def test_stale_temporaries_are_removed(tmp_path):
    target = tmp_path / "ckpt.pt"
    stale = [tmp_path / ".ckpt.pt.abc123.tmp", tmp_path / ".ckpt.pt.x.tmp"]
    for p in stale:
        p.write_bytes(b"half a checkpoint")
    keep = [tmp_path / "ckpt.pt", tmp_path / ".other.pt.x.tmp", tmp_path / "notes.tmp"]
    for p in keep:
        p.write_bytes(b"keep")
    assert remove_stale_temporaries(target) == sorted(stale)
    assert sorted(tmp_path.iterdir()) == sorted(keep)
