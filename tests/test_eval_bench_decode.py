"""``polysketch bench --decode``: whole-model decoding ms/token vs position (the rows, the
ratio to softmax, the CSV, the command line)."""

import csv

import pytest
import torch

from polysketch.cli import main
from polysketch.eval.bench.decode import (
    DECODE_FIELDS,
    DecodeBenchConfig,
    format_decode_report,
    run_decode_benchmark,
    time_decode,
    write_decode_csv,
)


def test_time_decode_takes_turns_and_times_every_round():
    order = []

    def case(name):
        return (lambda: order.append(("prefill", name)) or 0,
                lambda s: order.append(("step", name)) or s + 1)  # fmt: skip

    runs = time_decode({"a": case("a"), "b": case("b")}, tokens=2, warmup=1, repeats=2)
    assert set(runs) == {"a", "b"} and all(len(v) == 2 and min(v) >= 0 for v in runs.values())
    prefills = [name for kind, name in order if kind == "prefill"]
    assert prefills == ["a", "b", "a", "b"]  # rounds, the cases in turn
    assert len(order) == 2 * 2 * (1 + 1 + 2)


def test_run_decode_benchmark_rows_ratios_and_csv(tmp_path):
    config = DecodeBenchConfig(attentions=("softmax", "psf_random", "psf_mixed"),
                               positions=(9, 20), n_layer=1, n_head=2, n_embd=16, chunk_size=4,
                               vocab_size=11, tokens=2, warmup=1, repeats=1)  # fmt: skip
    rows = run_decode_benchmark(config)
    assert [(r["attention"], r["position"]) for r in rows] == [
        (a, p) for a in config.attentions for p in (9, 20)
    ]
    for r in rows:
        assert r["ms_per_token"] > 0 and len(r["runs_ms"]) == 1
        base = next(
            x for x in rows if x["attention"] == "softmax" and x["position"] == r["position"]
        )
        assert r["x_softmax"] == pytest.approx(base["ms_per_token"] / r["ms_per_token"])
    text = format_decode_report(rows)
    assert "psf_mixed" in text and "P=20" in text and "x sm" in text
    path = write_decode_csv(rows, tmp_path / "d.csv")
    with open(path) as fh:
        read = list(csv.DictReader(fh))
    assert list(read[0]) == list(DECODE_FIELDS) and len(read) == len(rows)
    with pytest.raises(ValueError, match="tokens"):
        run_decode_benchmark(DecodeBenchConfig(tokens=0))


def test_cli_bench_decode(tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "b"
    rc = main(["bench", "--decode", "--quick", "--decode-positions", "16,32", "--threads", "1",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "decode ms/token" in printed and "hedgehog" in printed and "P=32" in printed
    assert (out / "decode_results.csv").stat().st_size > 0


def test_decode_step_benchmark_prints_every_case_against_sdpa(capsys):
    """``benchmarks/decode_step.py`` (on ``sys.path`` for tests): a tiny run prints one row per
    case with its ratio to SDPA; bad counts are refused."""
    import decode_step

    argv = ["--attentions", "psf_random", "psf_mixed", "--position", "16", "--rounds", "1",
            "--calls", "2"]  # fmt: skip
    assert decode_step.main(argv) == 0
    out = capsys.readouterr().out
    for name in ("sdpa", "psf_random", "psf_mixed"):
        assert f"\n{name} " in out
    assert out.count("x sdpa") == 3
    with pytest.raises(SystemExit):
        decode_step.main(["--rounds", "0"])
