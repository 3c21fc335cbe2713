"""LLoPS Table 3 driver (``benchmarks/llops_table3.py``): train exact polynomial models, capture
per-head q/k of first/middle/last layer, measure PSF and LLoPS with ``polysketch approx``."""

import csv
import importlib.util
from pathlib import Path

import torch

from polysketch.eval.llops_table3 import summarize

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_writes_files_and_tables(tmp_path):
    spec = importlib.util.spec_from_file_location("t3", ROOT / "benchmarks" / "llops_table3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--quick", "--degrees", "2", "--out", str(tmp_path), "--threads", "1"]) == 0
    qk = torch.load(tmp_path / "qk" / "qk_p2_layer1_head0_test.pt", weights_only=True)
    assert qk["q"].shape == (64 * 16, 8) and qk["q"].dtype == torch.float64  # 64 seqs x T
    with open(tmp_path / "table3.csv") as f:
        rows = list(csv.DictReader(f))
    # 3 layers (first, middle, last) x 2 heads x 3 maps
    assert {(r["layer"], r["head"], r["map"]) for r in rows} == {
        (str(layer), str(h), m) for layer in (0, 1, 2) for h in (0, 1)
        for m in ("polysketch", "llops", "llops_start")
    }  # fmt: skip
    assert all(float(r["rmae"]) > 0 for r in rows)
    md = (tmp_path / "table3.md").read_text()
    assert "| 2 | PSF (polysketch) | 8 |" in md
    assert "LLoPS (llops, data start + Adam on Eq. 6)" in md
    assert "LLoPS (llops, data start only)" in md
    assert (tmp_path / "table3.png").read_bytes()[:4] == b"\x89PNG"


def test_summarize_averages_heads_then_layers():
    rows = [
        {"p": 2, "map": "llops", "F": 8, "layer": 0, "head": 0, "rmae": 0.1},
        {"p": 2, "map": "llops", "F": 8, "layer": 0, "head": 1, "rmae": 0.3},
        {"p": 2, "map": "llops", "F": 8, "layer": 2, "head": 0, "rmae": 0.6},
    ]
    table = {t["layer"]: t["rmae"] for t in summarize(rows)}
    assert abs(table[0] - 0.2) < 1e-12 and abs(table[2] - 0.6) < 1e-12
    assert abs(table["avg"] - 0.4) < 1e-12
