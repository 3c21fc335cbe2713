"""``benchmarks/gpu_profile.py`` (where an attention call's time goes on a GPU) as a CPU dry
run: the plumbing, the table and the per-row notes, so the script cannot rot between leases."""

import csv

import gpu_profile
import pytest


def test_smoke_run_writes_the_table_and_the_top_ops(tmp_path, capsys):
    out = tmp_path / "profile"
    args = ["--smoke", "--out", str(out), "--calls", "2", "--lengths", "48"]
    assert gpu_profile.main([*args, "--algorithms", "chunked_blocks,chunked"]) == 0
    rows = list(csv.DictReader(open(out / "profile.csv", encoding="utf-8")))
    assert [(r["algorithm"], r["picked"], r["T"]) for r in rows] == [
        ("chunked_blocks", "chunked_blocks", "48"), ("chunked", "chunked_scan", "48"),
    ]  # fmt: skip
    for r in rows:
        assert r["status"].startswith("ok"), r["status"]
        assert float(r["wall_ms"]) >= float(r["host_ms"]) > 0  # the CPU waits for nothing
        assert int(r["aten_ops"]) > 50  # forward and backward of a real call
        assert r["device_ms"] == r["graph_ms"] == ""  # no device on the CPU
    text = (out / "profile.md").read_text(encoding="utf-8")
    assert "### chunked_blocks (picked: chunked_blocks), T = 48" in text
    assert "By host time" in text and "aten::" in text
    assert "| chunked | chunked_scan | 48 |" in capsys.readouterr().out


def test_arguments_are_checked(tmp_path):
    for bad in (["--calls", "0"], ["--lengths", "1k"], ["--lengths", "0"]):
        with pytest.raises(SystemExit):
            gpu_profile.main(["--smoke", "--out", str(tmp_path / "p"), *bad])


def test_a_failing_row_is_recorded_and_the_run_goes_on(tmp_path):
    out = tmp_path / "profile"
    args = ["--smoke", "--out", str(out), "--calls", "1", "--lengths", "32"]
    assert gpu_profile.main([*args, "--algorithms", "no_such_backend,chunked_blocks"]) == 0
    rows = list(csv.DictReader(open(out / "profile.csv", encoding="utf-8")))
    failed = rows[0]["status"]
    assert failed.startswith("error (ValueError") and "no_such_backend" in failed
    assert rows[1]["status"].startswith("ok")
