"""experiments.hrf_table1: HRF Table 1 on UCI data (FLOP model, data, MSE, plot, command line)."""

import csv
import math
import sys

import pytest
import torch
from experiments.hrf_table1 import (
    dataset_mse,
    feature_flops,
    load_dataset,
    main,
    plot_dataset_mse,
)

from polysketch.features import create

PNG = b"\x89PNG\r\n\x1a\n"


def test_feature_flops_model():
    pos = create("positive", 10, num_features=6, seed=0)
    assert feature_flops(pos) == 2 * 6 * 10 + 2 * 6
    fmap = create("hybrid_clustered", 10, num_features=6, seed=0).fit(
        torch.randn(20, 10), torch.randn(20, 10)
    )
    assert feature_flops(fmap) == 2 * 2 * 10 + 2 * 2 * 12 * 10 + fmap.feature_dim
    with pytest.raises(TypeError, match="feature_map"):
        feature_flops("positive")


def test_load_dataset_preprocessing():
    data = load_dataset("wine", radius=1.5)
    assert data.shape == (178, 13) and data.dtype == torch.float64
    assert torch.allclose(data.norm(dim=-1), torch.full((178,), 1.5, dtype=torch.float64))
    assert load_dataset("diabetes").shape == (442, 10)


@pytest.mark.parametrize("match", ["features", "flops"])
def test_dataset_mse_on_wine(match):
    names = ["trig", "positive", "hybrid_angular", "hybrid_clustered"]
    rows = dataset_mse(names, budget=32, match=match, pairs=20, trials=8, progress=False)
    assert [r["map"] for r in rows] == names
    limit = 32 if match == "features" else feature_flops(create("positive", 13, num_features=16))
    for row in rows:
        assert row["dataset"] == "wine" and row["match"] == match and row["budget"] == 32
        assert math.isfinite(row["mse"]) and row["mse"] > 0 and math.isfinite(row["mse_std"])
        assert (row["feature_dim"] if match == "features" else row["flops"]) <= limit
    base = {r["map"]: r for r in rows}
    assert base["positive"]["num_features"] == 16 and base["trig"]["feature_dim"] == 32
    if match == "features":  # hybrid_angular: F = 4m(n + 1) = 20m <= 32 -> m = 1
        assert base["hybrid_angular"]["num_features"] == 1
    else:  # FLOP matching buys the hybrid more base features than feature matching
        assert base["hybrid_angular"]["num_features"] > 1


def test_dataset_mse_without_sklearn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    with pytest.raises(ImportError, match=r"polysketch\[eval\]"):
        dataset_mse("positive", pairs=2, trials=2, progress=False)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="maps"):
        dataset_mse("no_such_map", progress=False)
    with pytest.raises(ValueError, match="match"):
        dataset_mse("positive", match="time", progress=False)
    with pytest.raises(ValueError, match="dataset"):
        dataset_mse("positive", dataset="iris", progress=False)
    with pytest.raises(ValueError, match="budget"):
        dataset_mse("positive", budget=1, progress=False)
    with pytest.raises(ValueError, match="rows"):
        plot_dataset_mse([], "unused.png")


def test_plot_writes_png(tmp_path):
    rows = [
        {"map": m, "dataset": d, "mse": v, "mse_std": v / 4}
        for m, v in (("positive", 1e-2), ("hybrid_angular", 3e-3))
        for d in ("wine", "diabetes")
    ]
    out = plot_dataset_mse(rows, tmp_path / "table1.png")
    data = out.read_bytes()
    assert out == tmp_path / "table1.png" and data[:8] == PNG and len(data) > 2000


def test_main_writes_the_table_and_refuses_a_nonempty_out(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--maps", "trig", "positive", "--dataset", "wine", "diabetes", "--match", "flops",
            "--budget", "8", "--pairs", "5", "--trials", "2", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    with open(out / "datasets.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["dataset"], r["map"]) for r in rows] == [
        ("wine", "trig"), ("wine", "positive"), ("diabetes", "trig"), ("diabetes", "positive")
    ]  # fmt: skip
    assert all(r["match"] == "flops" and math.isfinite(float(r["mse"])) for r in rows)
    assert (out / "datasets.png").read_bytes()[:8] == PNG
    assert f"wrote {out / 'datasets.csv'}" in capsys.readouterr().out

    before = (out / "datasets.csv").read_bytes()
    assert main(argv) == 2  # an earlier run is not replaced unasked
    err = capsys.readouterr().err
    assert "error:" in err and "--overwrite" in err
    assert (out / "datasets.csv").read_bytes() == before
    assert main([*argv, "--overwrite", "--seed", "1"]) == 0
    assert (out / "datasets.csv").read_bytes() != before


def test_main_refuses_bad_arguments(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["--maps", "tensorsketch", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--maps" in err and "'tensorsketch'" in err and not out.exists()
    monkeypatch.setitem(sys.modules, "sklearn", None)
    assert main(["--maps", "positive", "--out", str(out), "--no-progress"]) == 2
    assert "polysketch[eval]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["--dataset", "iris"])
    assert done.value.code == 2
