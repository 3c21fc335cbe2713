"""No command replaces an earlier run unasked; output folders, devices and disks fail clearly.

Every command that writes a folder (train, mqar, linearize, approx, bench, demo) refuses a
non-empty ``--out`` unless ``--overwrite`` (or ``--resume`` for train); a ``--out`` that is a
file, cannot be created or is not writable, a full disk and ``--device cuda`` without CUDA
are each one ``polysketch CMD: error:`` line and exit status 2, never a traceback.
"""

import errno
import os
import stat
from pathlib import Path

import pytest
import torch

from polysketch._files import process_umask
from polysketch.cli import main
from polysketch.train import load_checkpoint, save_checkpoint
from test_cli_checkpoints import error_line as _error_line

TEXT = "".join(f"All the world's a stage, line {i}.\n" for i in range(40))
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--chunk-size", "8", "--batch-size", "4", "--eval-batches", "1",
        "--no-progress"]  # fmt: skip


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def _train(corpus, out, *extra):
    return main(["train", "--corpus", str(corpus), "--out", str(out), "--steps", "2",
                 "--attention", "elu", *TINY, *extra])  # fmt: skip


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _model_dir(tmp_path) -> Path:
    """A folder that passes linearize's --model check without loading anything."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


# argv (without --out) of a fast run of every command that writes an output folder
def _commands(tmp_path, corpus):
    return {
        "train": ["train", "--corpus", str(corpus), "--steps", "1", *TINY],
        "mqar": ["mqar", "--quick", "--attentions", "softmax", "--steps", "1", "--threads", "1"],
        "linearize": ["linearize", "--model", str(_model_dir(tmp_path)), "--data", str(corpus)],
        "approx": [
            "approx",
            "--maps",
            "elu",
            "--degrees",
            "2",
            "--feature-dims",
            "4",
            "--num",
            "8",
            "--no-progress",
        ],  # fmt: skip
        "bench": ["bench", "--quick", "--lengths", "64", "--methods", "sdpa", "--no-progress"],
        "demo": ["demo", "--quick", "--sections", "speed", "--lengths", "64", "--no-progress"],
    }


# ----- a non-empty --out ------------------------------------------------------------------
def test_train_twice_into_one_out_keeps_the_first_run(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert _train(corpus, out) == 0
    before = _snapshot(out)
    assert _train(corpus, out) == 2  # the default is no longer "destroy the earlier run"
    _error_line(capsys, "train", f"--out {out}", "--overwrite", "--resume")
    assert _snapshot(out) == before
    assert _train(corpus, out, "--steps", "3", "--overwrite") == 0  # asked: replaced
    assert load_checkpoint(out / "ckpt.pt", restore_rng=False)["step"] == 3
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--overwrite", *TINY]) == 2
    _error_line(capsys, "train", "--resume", "--overwrite")


@pytest.mark.parametrize("command", ["train", "mqar", "linearize", "approx", "bench", "demo"])
def test_every_command_refuses_a_non_empty_out(tmp_path, corpus, capsys, command):
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.txt").write_text("an earlier run's result")
    argv = _commands(tmp_path, corpus)[command]
    assert main([*argv, "--out", str(out)]) == 2
    _error_line(capsys, command, f"--out {out}", "not empty", "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["earlier.txt"]
    assert (out / "earlier.txt").read_text() == "an earlier run's result"


def test_approx_overwrite_replaces_and_files_follow_the_umask(tmp_path, capsys):
    out = tmp_path / "out"
    argv = [*_commands(tmp_path, None)["approx"], "--out", str(out)]
    assert main(argv) == 0
    assert main(argv) == 2
    assert main([*argv, "--overwrite"]) == 0
    capsys.readouterr()
    mode = stat.S_IMODE((out / "results.csv").stat().st_mode)
    assert mode == 0o666 & ~process_umask()


def test_checkpoint_follows_the_umask(tmp_path, corpus):
    old = os.umask(0o022)
    try:
        assert _train(corpus, tmp_path / "run") == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "run" / "ckpt.pt").stat().st_mode) == 0o644


def test_demo_reuse_mode_keeps_an_earlier_report(tmp_path, capsys):
    out = tmp_path / "report"
    (out / "runs").mkdir(parents=True)
    (out / "README.md").write_text("an earlier report")
    argv = ["demo", "--quick", "--sections", "fidelity", "--out", str(out), "--no-progress"]
    assert main(argv) == 2
    _error_line(capsys, "demo", "README.md", "--overwrite", "runs")
    assert (out / "README.md").read_text() == "an earlier report"


# ----- --resume ---------------------------------------------------------------------------
def test_resume_warns_about_each_flag_it_ignores(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert _train(corpus, out) == 0
    capsys.readouterr()
    argv = ["train", "--out", str(out), "--resume", "--steps", "3", "--lr", "0.5", "--n-layer",
            "3", "--no-rope", "--corpus", "elsewhere.txt", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    flags = [line.split("warning: ", 1)[1].split()[0] for line in warnings]
    assert sorted(flags) == ["--corpus", "--lr", "--n-layer", "--no-rope"]
    assert all(line.startswith("polysketch train: warning: ") for line in warnings)
    assert "lr=0.001" in next(w for w in warnings if "--lr" in w)  # the value that is used
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    assert state["step"] == 3 and state["model_config"]["n_layer"] == 1  # the checkpoint won
    assert state["train_config"]["lr"] == 0.001


def test_resume_applies_recompute_and_changes_no_number(tmp_path, corpus, capsys):
    """--no-recompute with --resume applies (memory against time) and changes no number: the
    run resumed without recomputation ends with the weights, bit for bit, of the same run
    resumed as it was saved (recomputing)."""
    kept, switched = tmp_path / "kept", tmp_path / "switched"
    for out in (kept, switched):
        assert _train(corpus, out) == 0  # 2 steps, recomputing (the default)
    capsys.readouterr()
    resume = ["train", "--resume", "--steps", "4", "--no-progress", "--out"]
    assert main([*resume, str(kept)]) == 0
    assert main([*resume, str(switched), "--no-recompute"]) == 0
    assert "warning:" not in capsys.readouterr().err
    a = load_checkpoint(kept / "ckpt.pt", restore_rng=False)
    b = load_checkpoint(switched / "ckpt.pt", restore_rng=False)
    assert a["model_config"]["recompute"] is True and b["model_config"]["recompute"] is False
    assert a["step"] == b["step"] == 4 and a["model"].keys() == b["model"].keys()
    for name, weight in a["model"].items():
        assert torch.equal(weight, b["model"][name]), name


def test_a_crashed_save_leaves_no_temporary_behind_the_next_start(tmp_path, corpus):
    out = tmp_path / "run"
    assert _train(corpus, out) == 0
    stale = out / ".ckpt.pt.k2j4h1.tmp"
    stale.write_bytes(b"half a checkpoint")
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--no-progress"]) == 0
    assert not stale.exists()
    assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt", "metrics.csv", "metrics.jsonl"]


# ----- --out that is a file, cannot be created, or is not writable; a full disk -----------
@pytest.mark.parametrize("command", ["train", "mqar", "linearize", "approx", "bench", "demo"])
def test_out_that_is_a_file(tmp_path, corpus, capsys, command):
    out = tmp_path / "a_file"
    out.write_text("not a folder")
    assert main([*_commands(tmp_path, corpus)[command], "--out", str(out)]) == 2
    _error_line(capsys, command, str(out), "is a file")
    assert out.read_text() == "not a folder"


def test_out_that_cannot_be_created_or_written(tmp_path, corpus, capsys, monkeypatch):
    out = tmp_path / "locked" / "run"
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self == out:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert _train(corpus, out) == 2
    _error_line(capsys, "train", f"--out {out}", "cannot be created", "Permission denied")
    monkeypatch.setattr(Path, "mkdir", real_mkdir)

    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if Path(p) == out else real_access(p, mode)
    )
    assert _train(corpus, out) == 2
    _error_line(capsys, "train", f"--out {out}", "not writable")


def test_full_disk_while_saving_the_checkpoint(tmp_path, corpus, capsys, monkeypatch):
    real_save = torch.save

    def no_space(obj, f, *args, **kwargs):
        if not hasattr(f, "write"):
            return real_save(obj, f, *args, **kwargs)
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    out = tmp_path / "run"
    assert _train(corpus, out) == 2
    _error_line(capsys, "train", str(out / "ckpt.pt"), "No space left on device")
    assert not (out / "ckpt.pt").exists() and not list(out.glob(".ckpt.pt.*"))


def test_full_disk_while_writing_results(tmp_path, capsys, monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    out = tmp_path / "out"
    assert main([*_commands(tmp_path, None)["approx"], "--out", str(out)]) == 2
    _error_line(capsys, "approx", str(out / "results.csv"), "No space left on device")


# ----- --device ---------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["train", "generate", "mqar", "bench", "demo"])
def test_device_cuda_without_cuda(tmp_path, corpus, capsys, command):
    if command == "generate":
        argv = ["generate", "--checkpoint", str(tmp_path / "ckpt.pt")]
    else:
        argv = [*_commands(tmp_path, corpus)[command], "--out", str(tmp_path / "out")]
    assert main([*argv, "--device", "cuda"]) == 2
    _error_line(capsys, command, "--device cuda", "CUDA is not available", "--device cpu")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_resume_of_a_cuda_run_on_a_machine_without_cuda(tmp_path, corpus, capsys):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    out = tmp_path / "run"
    assert _train(corpus, out) == 0
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    state["train_config"]["device"] = "cuda"  # as if trained on a GPU
    save_checkpoint(out / "ckpt.pt", state)
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--no-progress"]) == 2
    _error_line(capsys, "train", "the checkpoint's", "CUDA is not available")
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--no-progress",
                 "--device", "cpu"]) == 0  # fmt: skip


def test_a_typod_flag_prints_the_commands_usage(capsys):
    """Issue 43: ``train --attenton x`` shows train's usage and names the flag it resembles."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--attenton", "x"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: polysketch train ")
    assert "polysketch train: error: unrecognized arguments: --attenton x" in err
    assert "did you mean --attention?" in err
    with pytest.raises(SystemExit):  # before any command: the top-level usage
        main(["--bogus"])
    assert capsys.readouterr().err.startswith("usage: polysketch [-h]")
