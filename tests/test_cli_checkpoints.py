"""``generate --checkpoint`` and ``train --resume`` on crafted, damaged, mismatched and old files.

Each refusal is one ``polysketch CMD: error:`` line naming the file, exit status 2; a crafted
pickle never runs (the marker file its payload would create stays absent).
"""

import shutil

import pytest
import torch

from polysketch.cli import main
from polysketch.train import load_checkpoint, save_checkpoint
from test_train_checkpoint import crafted_checkpoint, legacy_checkpoint

TEXT = "".join(f"Some text to learn from, line {i}.\n" for i in range(40))
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--chunk-size", "8", "--batch-size", "4", "--eval-batches", "1",
        "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint written by ``polysketch train`` (2 steps of a tiny model)."""
    root = tmp_path_factory.mktemp("trained")
    corpus = root / "corpus.txt"
    corpus.write_text(TEXT)
    out = root / "run"
    argv = ["train", "--corpus", str(corpus), "--out", str(out), "--steps", "2",
            "--attention", "elu", *TINY]  # fmt: skip
    assert main(argv) == 0
    return out


@pytest.fixture
def run_copy(trained, tmp_path):
    """A fresh copy of the trained run folder (tests damage it)."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def _generate(path):
    return main(["generate", "--checkpoint", str(path), "--prompt", "Some", "--max-new-tokens",
                 "4", "--temperature", "0", "--device", "cpu"])  # fmt: skip


def _resume(out):
    return main(["train", "--out", str(out), "--resume", "--steps", "3", "--no-progress",
                 "--device", "cpu"])  # fmt: skip


def error_line(capsys, command, *needles):
    """The one ``polysketch COMMAND: error:`` line on stderr, holding every needle."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"polysketch {command}: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("command", ["generate", "resume"])
def test_crafted_pickle_is_refused_and_never_runs(run_copy, tmp_path, capsys, command):
    marker = tmp_path / "pwned"
    path = crafted_checkpoint(run_copy / "ckpt.pt", marker)
    rc = _generate(path) if command == "generate" else _resume(run_copy)
    assert rc == 2
    error_line(capsys, "generate" if command == "generate" else "train", str(path), "refused")
    assert not marker.exists()


def _flip_first_weight(path):
    state = load_checkpoint(path, restore_rng=False)
    weight = state["model"]["lm_head.weight"].contiguous()
    needle = weight.numpy().tobytes()[:64]
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0
    data[at + 5] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["empty", "truncated", "flipped bit"])
@pytest.mark.parametrize("command", ["generate", "resume"])
def test_damaged_checkpoint_gives_oneerror_line(run_copy, capsys, command, damage):
    path = run_copy / "ckpt.pt"
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-300])
    else:
        _flip_first_weight(path)
    rc = _generate(path) if command == "generate" else _resume(run_copy)
    assert rc == 2
    word = "corrupt" if damage == "flipped bit" else "damaged"
    error_line(capsys, "generate" if command == "generate" else "train", str(path), word)


@pytest.mark.parametrize("command", ["generate", "resume"])
def test_model_config_that_does_not_fit_the_weights(run_copy, capsys, command):
    path = run_copy / "ckpt.pt"
    state = load_checkpoint(path, restore_rng=False)
    state["model_config"]["n_embd"] = 32  # a consistent file (valid checksum), wrong config
    save_checkpoint(path, state)
    rc = _generate(path) if command == "generate" else _resume(run_copy)
    assert rc == 2
    error_line(capsys, "generate" if command == "generate" else "train", str(path))


def test_optimizer_state_in_another_parameter_order_is_refused(run_copy, capsys):
    """Adam's moments are stored by parameter position: a checkpoint whose parameters come in
    another order (a layer's submodules registered differently) must be refused at resume,
    naming the parameter, never trained with another parameter's moments (it failed mid-step
    with a size mismatch when the sizes differed, and would have been silent where equal)."""
    path = run_copy / "ckpt.pt"
    state = load_checkpoint(path, restore_rng=False)
    moments = state["optimizer"]["state"]
    first, last = min(moments), max(moments)
    moments[first], moments[last] = moments[last], moments[first]
    save_checkpoint(path, state)
    assert _resume(run_copy) == 2
    error_line(capsys, "train", str(path), "optimizer state", "another order")


def test_checkpoint_with_unknown_config_keys(run_copy, capsys):
    path = run_copy / "ckpt.pt"
    state = load_checkpoint(path, restore_rng=False)
    state["model_config"]["no_such_field"] = 1
    save_checkpoint(path, state)
    assert _generate(path) == 2
    error_line(capsys, "generate", str(path), "no_such_field")
    assert _resume(run_copy) == 2
    error_line(capsys, "train", str(path), "no_such_field")


def test_checkpoint_written_before_format_2_still_generates_and_resumes(run_copy, capsys):
    path = run_copy / "ckpt.pt"
    assert _generate(path) == 0
    want = capsys.readouterr().out
    state = load_checkpoint(path, restore_rng=False)
    del state["rng"]
    legacy_checkpoint(path, state)  # pickled NumPy state, no checksum
    assert "format" not in torch.load(path, weights_only=False)
    assert _generate(path) == 0
    assert capsys.readouterr().out == want
    assert _resume(run_copy) == 0
    resumed = torch.load(path, weights_only=True)  # rewritten as format 2
    assert resumed["version"] == 2 and resumed["state"]["step"] == 3
