"""``make gpu-check``'s driver (benchmarks/gpu_check.py) as a CPU dry run (``--smoke``: tiny
shapes, Triton under its interpreter), so that the one command a GPU lease runs cannot rot:
every stage in its own process, the one folder of at most 8 files, the summary printed last,
the exit status, and graceful degradation (a stage past its budget is stopped and recorded,
and the stages after it still run)."""

import csv

import gpu_check
import pytest


def _rows(path):
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_smoke_run_writes_one_folder_and_prints_the_summary_last(tmp_path, capsys):
    out = tmp_path / "check"
    assert gpu_check.main(["--smoke", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    summary = (out / "summary.md").read_text()
    assert printed.rstrip().endswith(summary.rstrip())  # the summary is printed last
    assert sorted(p.name for p in out.iterdir()) == sorted(gpu_check.FILES)
    assert len(gpu_check.FILES) <= 8
    for stage in gpu_check.STAGES:
        assert f"| {stage} | ok |" in summary
    tests = _rows(out / "tests.csv")  # no CUDA here: every GPU test is skipped, none fails
    assert tests and all(r["outcome"] == "skipped" for r in tests)
    attention = {r["method"]: r for r in _rows(out / "attention.csv")}
    assert set(attention) == {"sdpa", "polysketch", "polysketch[chunked_blocks]",
                              "polysketch[triton]", "positive", "positive[triton]"}  # fmt: skip
    assert all(r["status"] == "ok" and float(r["median_ms"]) > 0 for r in attention.values())
    assert attention["polysketch"]["picked"] == "chunked_scan"  # the default dispatch on CPU
    model = _rows(out / "model.csv")
    assert [r["attention"] for r in model] == list(gpu_check.ATTENTIONS)
    assert all(r["status"] == "ok" and float(r["x_softmax"]) > 0 for r in model)
    assert {r["attention"]: r["chunk_size"] for r in model}[gpu_check.LONG_CONTEXT_PRESET] == "64"
    decode = _rows(out / "decode.csv")
    assert {(r["model"], r["attention"]) for r in decode} == {
        *(("TransformerLM", a) for a in gpu_check.ATTENTIONS),
        ("converted Llama", "softmax"), ("converted Llama", "psf_random"),
    }  # fmt: skip
    for table in ("## tests/gpu", "## Attention training", "## Model training", "## Decoding"):
        assert table in summary
    assert f"source {gpu_check.source_digest()}." in summary  # what ran, whatever git says
    assert "Triton faster than chunked_blocks at T =" in summary
    # the folder is refused when not empty, unless --overwrite
    assert gpu_check.main(["--smoke", "--out", str(out)]) == 2


def test_a_stage_past_its_budget_is_stopped_and_the_next_still_runs(tmp_path, monkeypatch):
    out = tmp_path / "check"
    monkeypatch.setattr(gpu_check, "STAGES", ("attention", "model"))  # no tests stage: exit 0
    monkeypatch.setattr(gpu_check, "SHARES", {"attention": 0.5, "model": 300.0})
    # the grace comes only out of time no later stage needs: none here (model's share is whole)
    monkeypatch.setattr(gpu_check, "GRACE", 20.0)
    assert gpu_check.main(["--smoke", "--out", str(out), "--budget", "300.5"]) == 0
    summary = (out / "summary.md").read_text()
    assert "| attention | stopped at 0 s (budget 0 s + grace) |" in summary
    assert "| model | ok |" in summary
    assert "0 passed, 0 failed, 0 error, 0 skipped (not run" in summary
    assert all(r["status"] == "ok" for r in _rows(out / "model.csv"))


def test_stages_runs_a_subset_with_the_budget_shared_among_them(tmp_path, monkeypatch):
    out = tmp_path / "check"
    assert gpu_check.main(["--smoke", "--out", str(out), "--stages", "decode"]) == 0
    summary = (out / "summary.md").read_text()
    for name in ("tests", "attention", "model"):
        assert f"| {name} | not selected (--stages) | 0 | 0 |" in summary
    assert "| decode | ok |" in summary
    # the whole budget goes to the stages run (decode's share alone would be 35 s of 330)
    assert "| decode | ok | " in summary and "| 330 |" in summary.split("## tests/gpu")[0]
    assert _rows(out / "decode.csv") and not (out / "model.csv").exists()
    for bad in ("decode,bogus", ","):
        with pytest.raises(SystemExit):
            gpu_check.main(["--smoke", "--out", str(tmp_path / "other"), "--stages", bad])


def test_compiled_rows_are_compared_with_compiled_softmax():
    """The model stage's compiled rows (``COMPILED``) get x_softmax against softmax compiled
    the same way, the eager rows against eager softmax."""
    import gpu_check_stages as stages

    label = stages.COMPILED_LABEL
    rows = [
        {"attention": "softmax", "T": 8, "status": "ok", "tokens_per_s": 100.0},
        {"attention": "psf_random", "T": 8, "status": "ok", "tokens_per_s": 50.0},
        {"attention": "softmax" + label, "T": 8, "status": "ok", "tokens_per_s": 200.0},
        {"attention": "psf_random" + label, "T": 8, "status": "ok", "tokens_per_s": 300.0},
    ]
    got = {r["attention"]: r["x_softmax"] for r in stages._with_ratios(rows)}
    assert got == {"softmax": 1.0, "psf_random": 0.5, "softmax" + label: 1.0,
                   "psf_random" + label: 1.5}  # fmt: skip


def test_model_bench_compile_mode_is_checked():
    import pytest

    from polysketch.eval.bench import ModelBenchConfig

    with pytest.raises(ValueError, match="compile_mode needs compile"):
        ModelBenchConfig(compile_mode="reduce-overhead").resolved()
    with pytest.raises(ValueError, match="compile_mode"):
        ModelBenchConfig(compile="inductor", compile_mode="fast").resolved()
    ok = ModelBenchConfig(compile="inductor", compile_mode="reduce-overhead").resolved()
    assert ok.compile_mode == "reduce-overhead"
