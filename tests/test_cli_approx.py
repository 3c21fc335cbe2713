"""End-to-end tests of `polysketch approx` (tiny sizes)."""

import csv
import math

import pytest
import torch

from polysketch.cli import main
from polysketch.commands.approx import POLYNOMIAL_MAPS, default_maps, format_table

PNG = b"\x89PNG\r\n\x1a\n"


def _read(path):
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_approx_polynomial_end_to_end(tmp_path, capsys):
    out = tmp_path / "res"
    argv = [
        "approx",
        "--maps",
        "tensor_power",
        "tensorsketch",
        "llops",
        "elementwise_power",
        "--degrees",
        "2",
        "3",
        "--feature-dims",
        "8",
        "16",
        "--dim",
        "4",
        "--num",
        "32",
        "--trials",
        "2",
        "--fit-steps",
        "5",
        "--max-feature-dim",
        "32",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "rel Frobenius" in text and f"wrote {out / 'results.csv'}" in text
    rows = _read(out / "results.csv")
    ok = [r for r in rows if not r["skipped"]]
    skipped = [r for r in rows if r["skipped"]]
    assert len(ok) == 1 + 3 * 2 * 2  # tensor_power p=2 (p=3 has F=64 > 32), 3 maps x 2 p x 2 F
    assert [(r["map"], r["degree"]) for r in skipped] == [("tensor_power", "3")]
    for r in ok:
        for key in ("rel_frobenius_mean", "rmae_mean", "max_rel_mean", "optimal_rel"):
            assert math.isfinite(float(r[key]))
        assert int(r["state_dim"]) >= 1
    exact = next(r for r in ok if r["map"] == "tensor_power")
    assert float(exact["rel_frobenius_mean"]) < 1e-12
    assert all(r["fitted"] == "5" for r in ok if r["map"] == "llops")
    assert all(r["fitted"] == "0" for r in ok if r["map"] != "llops")  # --fit-maps llops
    assert len(_read(out / "optimal.csv")) > 0
    png = (out / "fidelity.png").read_bytes()
    assert png[:8] == PNG and len(png) > 5000


def test_approx_from_file_and_bad_source(tmp_path, capsys):
    torch.save({"q": torch.randn(20, 3), "k": torch.randn(24, 3)}, tmp_path / "qk.pt")
    argv = [
        "approx",
        "--maps",
        "symmetric_power",
        "--degrees",
        "2",
        "--source",
        str(tmp_path / "qk.pt"),
        "--out",
        str(tmp_path / "res"),  # not tmp_path itself: a non-empty --out is refused
        "--no-progress",
    ]
    assert main(argv) == 0
    rows = _read(tmp_path / "res" / "results.csv")
    assert len(rows) == 1 and float(rows[0]["rel_frobenius_mean"]) < 1e-12
    assert rows[0]["feature_dim"] == "6"  # C(3 + 1, 2)
    argv[argv.index("--source") + 1] = str(tmp_path / "missing.pt")
    argv[argv.index("--out") + 1] = str(tmp_path / "res2")
    assert main(argv) == 2
    assert "source" in capsys.readouterr().err


def test_default_maps_are_registered_polynomial_maps():
    names, skipped = default_maps(POLYNOMIAL_MAPS, 8)
    assert "tensor_power" in names and "tensorsketch" in names
    assert set(names) <= set(POLYNOMIAL_MAPS) and not skipped


def test_format_table_lists_skips():
    rows = [{"map": "m", "degree": 2, "num_features": 4, "skipped": "too big"}]
    text = format_table(rows)
    assert "skipped:" in text and "m p=2 F=4: too big" in text


def test_approx_softmax_angles(tmp_path, capsys):
    argv = [
        "approx",
        "--kernel",
        "softmax",
        "--maps",
        "trig",
        "positive",
        "--num-angles",
        "3",
        "--trials",
        "4",
        "--feature-dims",
        "8",
        "--dim",
        "4",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    assert main(argv) == 0
    rows = _read(tmp_path / "angles.csv")
    assert {r["map"] for r in rows} == {"trig", "positive"} and len(rows) == 6
    assert all(math.isfinite(float(r["mse"])) and r["num_features"] == "8" for r in rows)
    assert (tmp_path / "angles.png").read_bytes()[:8] == PNG
    assert f"wrote {tmp_path / 'angles.csv'}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags", [["--experiment", "datasets"], ["--dataset", "wine"], ["--match", "flops"]]
)
def test_approx_softmax_has_no_table1_flags(tmp_path, capsys, flags):
    """HRF Table 1 on UCI data moved to ``python -m experiments.hrf_table1``: its flags are
    unknown to ``approx`` (argparse's error, exit 2) and nothing is written."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as done:
        main(["approx", "--kernel", "softmax", *flags, "--out", str(out), "--no-progress"])
    assert done.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err and not out.exists()


def test_approx_fit_source_is_used_for_fitting(tmp_path, capsys):
    """LLoPS fitted on --fit-source: q, k in a 2-dim subspace of R^6, where (q·k)² has rank 3,
    fit on other samples of the same subspace -> small held-out error; fit on a different
    subspace -> large error (so the fit really comes from the file)."""
    gen = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=torch.float64))[0]

    def sample(cols, n, path):
        b = basis[:, cols]
        q = torch.randn(n, len(cols), generator=gen, dtype=torch.float64) @ b.T
        k = torch.randn(n, len(cols), generator=gen, dtype=torch.float64) @ b.T
        torch.save({"q": q, "k": k}, path)
        return str(path)

    test = sample([0, 1], 64, tmp_path / "test.pt")
    rmae = {}
    for name, cols in (("same", [0, 1]), ("other", [2, 3])):
        fit = sample(cols, 256, tmp_path / f"fit_{name}.pt")
        argv = [
            "approx",
            "--maps",
            "llops",
            "--degrees",
            "2",
            "--feature-dims",
            "8",
            "--source",
            test,
            "--fit-source",
            fit,
            "--fit-steps",
            "400",
            "--target",
            "polynomial",
            "--out",
            str(tmp_path / name),
            "--no-progress",
        ]
        assert main(argv) == 0
        assert "same samples" not in capsys.readouterr().out
        (row,) = _read(tmp_path / name / "results.csv")
        rmae[name] = float(row["rel_frobenius_mean"])
    assert rmae["same"] < 0.05 and rmae["other"] > 0.5, rmae
    argv[argv.index("--fit-source") + 1] = str(tmp_path / "missing.pt")
    argv[argv.index("--out") + 1] = str(tmp_path / "bad")  # a fresh --out: not refused as full
    assert main(argv) == 2
    assert "--fit-source" in capsys.readouterr().err


def test_approx_fit_init_data_alone_measures_the_closed_form_start(tmp_path):
    """--fit-init data --fit-steps 0: LLoPS at its data start, no Adam steps. On q, k in a
    3-dim subspace, F = 6 = C(3 + 1, 2) monomials reproduce (q·k)² exactly; the constructed
    random draw does not."""
    gen = torch.Generator().manual_seed(1)
    basis = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    paths = {}
    for name, n in (("test", 48), ("fit", 128)):
        q = torch.randn(n, 3, generator=gen, dtype=torch.float64) @ basis.T
        k = torch.randn(n, 3, generator=gen, dtype=torch.float64) @ basis.T
        paths[name] = tmp_path / f"{name}.pt"
        torch.save({"q": q, "k": k}, paths[name])
    base = ["approx", "--maps", "llops", "--degrees", "2", "--feature-dims", "6",
            "--source", str(paths["test"]), "--fit-source", str(paths["fit"]),
            "--target", "polynomial", "--trials", "1", "--no-progress"]  # fmt: skip
    rows = {}
    for label, extra in (("start", ["--fit-init", "data", "--fit-steps", "0"]),
                         ("built", ["--fit-steps", "0"])):  # fmt: skip
        assert main([*base, *extra, "--out", str(tmp_path / label)]) == 0
        (rows[label],) = _read(tmp_path / label / "results.csv")
    assert (rows["start"]["fitted"], rows["start"]["fit_init"]) == ("0", "data")
    assert rows["built"]["fit_init"] == ""
    assert float(rows["start"]["rel_frobenius_mean"]) < 1e-8
    assert float(rows["built"]["rel_frobenius_mean"]) > 0.1


def test_approx_unknown_map_is_an_error_and_writes_nothing(tmp_path, capsys):
    """Issue 43 item 4: a typo'd --maps name is an error line and exit 2, in both modes,
    before any folder or file is written."""
    tiny = ["--dim", "4", "--num", "8", "--trials", "1", "--feature-dims", "8", "--no-progress"]
    out = tmp_path / "poly"
    assert main(["approx", "--maps", "polysketh", "--out", str(out), *tiny]) == 2
    err = capsys.readouterr().err
    assert "polysketch approx: error: --maps" in err and "'polysketh'" in err
    assert "did you mean 'polysketch'" in err
    assert not out.exists()
    out = tmp_path / "soft"
    argv = ["approx", "--kernel", "softmax", "--maps", "positve", "--out", str(out), *tiny]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: --maps" in err and "'positve'" in err and "did you mean 'positive'" in err
    assert not out.exists()
    # a registered map outside softmax mode's family is named as such, not a traceback
    argv = ["approx", "--kernel", "softmax", "--maps", "polysketch", "--out", str(out), *tiny]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "'polysketch'" in err and "softmax" in err and not out.exists()


def test_approx_that_measures_nothing_is_an_error(tmp_path, capsys):
    """Every map skipped (here: F over --max-feature-dim): the skips are shown, nothing is
    written, exit 2."""
    out = tmp_path / "res"
    argv = ["approx", "--maps", "tensor_power", "--degrees", "4", "--dim", "8", "--num", "8",
            "--max-feature-dim", "16", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "skipped:" in captured.out and "tensor_power" in captured.out
    assert "error: nothing was measured" in captured.err
    assert not (out / "results.csv").exists() and not (out / "fidelity.png").exists()
