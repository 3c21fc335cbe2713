"""Measure how far training on a dp x cp mesh is from one process: 20 steps of the tiny model
of tests/test_train_mesh.py (2 x 32, T = 64, psf_random, batch 4, fp32, gloo on CPU, forked
ranks), the largest relative difference of the 20 training losses and of the 2 validation
losses against the one-process run, in fp32 and in fp64 (the whole run, model and loss, in
fp64: what is left is the rounding of the algorithm, not AdamW's amplification of fp32
rounding). Writes training.json beside this file.

    PYTHONPATH=src:tests python docs/results/cp/training_equality.py
"""

import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
from test_distributed_harness import run_ranks  # noqa: E402
from test_train_mesh import _rank_train, _rank_train_fp64, _single  # noqa: E402

LAYOUTS = [
    ("cp 2", 2, {}, {"cp": 2}),
    ("dp 2 x cp 2", 4, {}, {"cp": 2}),
    ("FSDP2 dp 2", 2, {}, {"fsdp": True}),
    ("FSDP2 over dp 2 x cp 2", 4, {}, {"cp": 2, "fsdp": True}),
    ("cp 4 (T = 64: 16 per rank)", 4, {}, {"cp": 4}),
    (
        "psf_mixed + short_conv 3, cp 2, grad_accum 2",
        2,
        {"attention": "psf_mixed", "short_conv": 3},
        {"cp": 2, "grad_accum": 2},
    ),
    ("packed, short_conv 3, cp 2", 2, {"short_conv": 3}, {"cp": 2, "pack": True}),
]


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, world, model_kw, train_kw in LAYOUTS:
            single_kw = {k: v for k, v in train_kw.items() if k not in ("cp", "fsdp")}
            row = {"layout": name, "processes": world}
            for dtype, fn in ((torch.float32, _rank_train), (torch.float64, _rank_train_fp64)):
                torch.set_default_dtype(dtype)
                try:
                    want = _single(tmp, model_kw, single_kw)
                finally:
                    torch.set_default_dtype(torch.float32)
                got = run_ranks(world, fn, tmp, model_kw, train_kw, timeout=600)[0]
                tag = "" if dtype == torch.float32 else "_fp64"
                if not tag:  # the fp32 run's first and last training loss
                    row["loss_first"], row["loss_last"] = map(float, want["loss"][[0, -1]])
                for key in ("loss", "val"):
                    rel = ((got[key] - want[key]).abs() / want[key].abs()).max()
                    row[f"max_rel_{key}{tag}"] = float(rel)
            rows.append(row)
            print(json.dumps(row))
    path = os.path.join(os.path.dirname(__file__), "training.json")
    with open(path, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
