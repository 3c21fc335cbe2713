"""Data-parallel training: ``torchrun --nproc_per_node=2 -m polysketch train`` (gloo on CPU)
ends with the parameters of one process trained on the combined batch."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from polysketch.cli import main
from polysketch.train import load_checkpoint
from polysketch.train.distributed import rank_slice

TEXT = "".join(
    f"{i}: all the world's a stage, and all the men and women players\n" for i in range(60)
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(corpus, out, *extra):
    return ["train", "--corpus", str(corpus), "--out", str(out), "--steps", "3",
            "--batch-size", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
            "--block-size", "16", "--chunk-size", "8", "--lr", "1e-2", "--warmup-steps", "1",
            "--eval-interval", "2", "--eval-batches", "2", "--log-interval", "1",
            "--attention", "polysketch", "--device", "cpu", "--no-progress", *extra]  # fmt: skip


def test_two_cpu_ranks_equal_one_process_on_the_combined_batch(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert main(_args(corpus, single)) == 0

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
           "-m", "polysketch", *_args(corpus, ddp, "--grad-accum", "2")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("checkpoint:") == 1  # only rank 0 reports

    a = load_checkpoint(single / "ckpt.pt", restore_rng=False)
    b = load_checkpoint(ddp / "ckpt.pt", restore_rng=False)
    assert a["step"] == b["step"] == 3
    for name, value in a["model"].items():
        torch.testing.assert_close(b["model"][name], value, msg=name)  # fp32 default rtol/atol
    la = [r["loss"] for r in a["history"]["train"]]
    lb = [r["loss"] for r in b["history"]["train"]]
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la))  # mean over both ranks
    assert la[-1] != la[0]  # training happened
    # rank 0 alone wrote the metrics: one train row per step, one val row per evaluation
    lines = (ddp / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 + 2


def test_rank_slices_partition_the_global_batch():
    slices = [rank_slice(12, 3, r, grad_accum=2) for r in range(3)]
    assert [(s.start, s.stop) for s in slices] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="batch_size"):
        rank_slice(10, 4, 0)
    with pytest.raises(ValueError, match="batch_size"):
        rank_slice(8, 2, 0, grad_accum=3)
