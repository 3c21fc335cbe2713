"""``torchrun --nproc-per-node 2 -m polysketch train --cp 2`` (gloo on CPU) trains the model
of one process to rounding, and the command refuses what it cannot run with an error line."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from polysketch.cli import main
from polysketch.train import load_checkpoint

TEXT = "".join(
    f"{i}: all the world's a stage, and all the men and women players\n" for i in range(60)
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(corpus, out, *extra):
    return ["train", "--corpus", str(corpus), "--out", str(out), "--steps", "4",
            "--batch-size", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
            "--block-size", "17", "--chunk-size", "8", "--lr", "1e-2", "--warmup-steps", "1",
            "--eval-interval", "2", "--eval-batches", "2", "--log-interval", "1",
            "--attention", "psf_random", "--short-conv", "3", "--device", "cpu",
            "--no-progress", *extra]  # fmt: skip


def test_torchrun_cp2_equals_one_process(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    single, cp = tmp_path / "single", tmp_path / "cp"
    assert main(_args(corpus, single)) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
           "-m", "polysketch", *_args(corpus, cp, "--cp", "2")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("checkpoint:") == 1  # only rank 0 reports
    a = load_checkpoint(single / "ckpt.pt", restore_rng=False)
    b = load_checkpoint(cp / "ckpt.pt", restore_rng=False)
    assert b["train_config"]["cp"] == 2 and a["step"] == b["step"] == 4
    for name, value in a["model"].items():  # AdamW moves a weight whose gradient is at the
        # rounding level by up to ~lr per step: 1e-2 x lr absolute (measured: 2.4e-5 at most)
        torch.testing.assert_close(b["model"][name], value, rtol=0, atol=1e-4, msg=name)
    la = torch.tensor([r["loss"] for r in a["history"]["train"]])
    lb = torch.tensor([r["loss"] for r in b["history"]["train"]])
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=0)
    # the cp-2 run continues on ONE process (the layout is the launch's, not the checkpoint's)
    more = ["train", "--out", "", "--resume", "--steps", "6", "--no-progress"]
    for out in (single, cp):
        more[2] = str(out)
        assert main(more) == 0
    a = load_checkpoint(single / "ckpt.pt", restore_rng=False)
    b = load_checkpoint(cp / "ckpt.pt", restore_rng=False)
    assert a["step"] == b["step"] == 6 and b["train_config"]["cp"] == 1
    la = torch.tensor([r["loss"] for r in a["history"]["train"]])
    lb = torch.tensor([r["loss"] for r in b["history"]["train"]])
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--cp", "2"], "cp=2 must divide the number of processes (1)"),
        (["--fsdp"], "fsdp: sharding parameters needs several processes"),
        (["--cp", "2", "--attention", "softmax"], "attention='softmax'"),
        (["--fsdp", "--compile"], "compile is not supported with fsdp"),
    ],
)
def test_cli_refuses_layouts_it_cannot_run(tmp_path, capsys, extra, message):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    args = _args(corpus, tmp_path / "out", *extra)
    if "softmax" in extra:
        args.remove("psf_random")
        args.remove("--attention")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "polysketch train: error:" in err and message in err, err
