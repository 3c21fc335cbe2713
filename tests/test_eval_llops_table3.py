"""LLoPS Table 3 (``python -m experiments.llops_table3``): train exact polynomial models, capture
per-head q/k of first/middle/last layer, measure PSF and LLoPS as ``polysketch approx`` does."""

import csv

import pytest
import torch
from experiments.llops_table3 import captured_files, main, summarize


def test_quick_run_writes_files_and_tables(tmp_path):
    assert main(["--quick", "--degrees", "2", "--out", str(tmp_path), "--threads", "1"]) == 0
    qk = torch.load(tmp_path / "qk" / "qk_p2_layer1_head0_test.pt", weights_only=True)
    assert qk["q"].shape == (64 * 16, 8) and qk["q"].dtype == torch.float64  # 64 seqs x T
    with open(tmp_path / "table3.csv") as f:
        rows = list(csv.DictReader(f))
    # 3 layers (first, middle, last) x 2 heads x 4 maps
    assert {(r["layer"], r["head"], r["map"]) for r in rows} == {
        (str(layer), str(h), m) for layer in (0, 1, 2) for h in (0, 1)
        for m in ("polysketch", "llops", "llops_start", "eq7_fitted")
    }  # fmt: skip
    assert all(float(r["rmae"]) > 0 for r in rows)
    # the in-sample optimum on the test matrix bounds the fitted one measured there
    assert all(float(r["rel_frobenius"]) >= float(r["optimal_rel"]) * (1 - 1e-9) for r in rows)
    md = (tmp_path / "table3.md").read_text()
    assert "| 2 | PSF (polysketch) | 8 |" in md
    assert "LLoPS (llops, data start + Adam on Eq. 6)" in md
    assert "LLoPS (llops, data start only)" in md
    assert "Eq. 7 optimum on the fitting samples" in md
    assert (tmp_path / "table3.png").read_bytes()[:4] == b"\x89PNG"

    # --reuse-captures: no training, the same files measured again, the same numbers
    (tmp_path / "table3.csv").rename(tmp_path / "first.csv")
    args = ["--quick", "--degrees", "2", "--out", str(tmp_path), "--reuse-captures"]
    assert main(args) == 0
    with open(tmp_path / "table3.csv") as f:
        again = list(csv.DictReader(f))
    assert [(r["map"], r["layer"], r["head"], r["rmae"]) for r in again] == [
        (r["map"], r["layer"], r["head"], r["rmae"]) for r in rows
    ]
    assert "reused from" in (tmp_path / "table3.md").read_text()


def test_captured_files_needs_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no captured q/k for p = 2"):
        captured_files(tmp_path, degree=2)
    qk = {"q": torch.zeros(2, 4), "k": torch.zeros(2, 4)}
    torch.save(qk, tmp_path / "qk_p2_layer3_head1_test.pt")
    with pytest.raises(FileNotFoundError, match="fitting file"):
        captured_files(tmp_path, degree=2)
    (tmp_path / "qk_p2_layer3_head1_fit.pt").write_bytes(b"")
    assert captured_files(tmp_path, degree=2) == [
        (3, 1, tmp_path / "qk_p2_layer3_head1_test.pt", tmp_path / "qk_p2_layer3_head1_fit.pt")
    ]


def test_summarize_averages_heads_then_layers():
    rows = [
        {"p": 2, "map": "llops", "F": 8, "layer": 0, "head": 0, "rmae": 0.1},
        {"p": 2, "map": "llops", "F": 8, "layer": 0, "head": 1, "rmae": 0.3},
        {"p": 2, "map": "llops", "F": 8, "layer": 2, "head": 0, "rmae": 0.6},
    ]
    table = {t["layer"]: t["rmae"] for t in summarize(rows)}
    assert abs(table[0] - 0.2) < 1e-12 and abs(table[2] - 0.6) < 1e-12
    assert abs(table["avg"] - 0.4) < 1e-12
