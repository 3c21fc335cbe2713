"""``polysketch bench``: CSV/PNG output of the quick run, FLOP formulas, length parsing."""

import csv
import math
import time

import pytest
import torch

from polysketch import cli
from polysketch.eval.bench import chunked_flops, parse_lengths, sdpa_flops, time_call


def test_quick_bench_writes_csv_and_png(tmp_path, capsys, monkeypatch):
    threads = torch.get_num_threads()
    # SDPA sizes are skipped only where SDPA would materialize T² scores (its math backend,
    # forced here): 0.002 GB: the 4·4·512² B = 4 MiB matrix of T = 512 is over, T <= 256 not.
    monkeypatch.setattr("polysketch.eval.bench.attention._sdpa_uses_math", lambda q: True)
    argv = ["bench", "--quick", "--out", str(tmp_path), "--no-progress", "--max-memory-gb", "0.002"]
    assert cli.main(argv) == 0
    assert torch.get_num_threads() == threads  # restored after the run
    printed = capsys.readouterr().out
    assert "crossover" in printed and "matmul peak" in printed

    with (tmp_path / "results.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    methods = {"sdpa", "polysketch", "positive"}
    seen = {(r["section"], r["method"], int(r["T"])) for r in rows}
    for section in ("forward", "decode"):
        for t in (128, 256, 512):
            assert {(section, m, t) for m in methods} <= seen
    for r in rows:
        if r["section"] == "forward" and r["method"] == "sdpa" and r["T"] == "512":
            assert r["status"] == "skipped (memory)" and r["median_ms"] == ""
            continue
        assert r["status"] == "ok", r
        ms = float(r["median_ms"])
        assert math.isfinite(ms) and ms > 0
        if r["method"] == "psf_mixed":  # timed, but no analytic FLOP/memory model for it
            assert r["section"] == "forward" and r["gflops_per_s"] == ""
            continue
        assert float(r["mem_mib"]) > 0
        if r["section"] == "forward":
            assert float(r["gflops_per_s"]) > 0
    psk = [r for r in rows if r["method"] == "polysketch"]
    assert all(int(r["feature_dim"]) == 32 and int(r["state_dim"]) == 544 for r in psk)  # 32 * 17
    pos = [r for r in rows if r["method"] == "positive"]
    assert all(int(r["feature_dim"]) == 256 for r in pos)

    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_parse_lengths():
    assert parse_lengths("1k, 2k,4096") == (1024, 2048, 4096)
    assert parse_lengths(["64k", "512"]) == (512, 65536)
    with pytest.raises(ValueError, match="lengths"):
        parse_lengths("1k,abc")
    with pytest.raises(ValueError, match="lengths"):
        parse_lengths("0")
    with pytest.raises(ValueError, match="lengths"):
        parse_lengths("")


def test_chunked_flops_formula():
    """Two blocks of b = T/2 rows equal the hand count; each further block adds the same work."""
    t, b, n, m = 8, 4, 2, 1  # n blocks; m = n - 1 write (no final state) and read a state
    f, e = 4, 2  # F > E: still the pair features, F(F//2 + 1) = 12 per token (ops.pairs)
    plain = (
        2 * n * b * b * f + 2 * n * b * b * e + n * b * b  # local blocks, row sums
        + 2 * m * b * f * e  # states
        + m * f * e  # running state
        + 2 * m * b * f * e  # reads
        + m * b * f + 2 * m * b * f  # key sums Σ B, reads A·z
        + t * e
    )  # fmt: skip
    assert chunked_flops(t, feature_dim=f, value_dim=e, chunk_size=b, square=False) == plain
    fp = 12
    square = (
        2 * n * b * b * f + 2 * n * b * b * e + n * b * b + n * b * b  # local, squares, row sums
        + 2 * n * b * fp  # pair features of q and k
        + 2 * m * b * fp * e  # states
        + m * fp * e  # running state
        + 2 * m * b * fp * e  # reads
        + m * b * fp + 2 * m * b * fp  # key sums Σ ψ(B), reads (ω ⊙ ψ(A))·z
        + t * e
    )  # fmt: skip
    assert chunked_flops(t, feature_dim=f, value_dim=e, chunk_size=b, square=True) == square
    # F <= E, any T: explicit symmetric pair features, F(F//2 + 1) = 12 per token
    t, b, f, e, fp = 128, 64, 4, 8, 12
    pairs = (
        2 * n * b * b * f + 2 * n * b * b * e + n * b * b + n * b * b  # local, squares, row sums
        + 2 * n * b * fp  # pair features of q and k
        + 2 * m * b * fp * e  # states
        + m * fp * e  # running state
        + 2 * m * b * fp * e  # reads
        + m * b * fp + 2 * m * b * fp  # key sums Σ ψ(B), reads (ω ⊙ ψ(A))·z
        + t * e
    )  # fmt: skip
    assert chunked_flops(t, feature_dim=f, value_dim=e, chunk_size=b, square=True) == pairs
    kw = dict(feature_dim=32, value_dim=64, chunk_size=256, square=True)
    step = chunked_flops(2 * 4096, **kw) - chunked_flops(4096, **kw)
    assert chunked_flops(3 * 4096, **kw) - chunked_flops(2 * 4096, **kw) == step
    assert sdpa_flops(2048, head_dim=64, value_dim=64) == 4 * sdpa_flops(
        1024, head_dim=64, value_dim=64
    )


def test_bench_rejects_bad_options(tmp_path, capsys):
    assert cli.main(["bench", "--quick", "--out", str(tmp_path), "--chunk-size", "0"]) == 2
    assert "polysketch bench: error: chunk_size" in capsys.readouterr().err
    assert cli.main(["bench", "--quick", "--out", str(tmp_path), "--lengths", "x"]) == 2
    assert "polysketch bench: error: lengths" in capsys.readouterr().err
    assert cli.main(["bench", "--quick", "--out", str(tmp_path), "--max-memory-gb", "-1"]) == 2
    assert "polysketch bench: error: max_memory_gb" in capsys.readouterr().err


def test_malloc_top_pad_is_set_on_glibc_and_reported(tmp_path, capsys):
    import platform

    from polysketch.eval.bench import set_malloc_top_pad

    assert set_malloc_top_pad(2**30) == (platform.libc_ver()[0] == "glibc")
    with pytest.raises(ValueError, match="malloc_top_pad"):
        set_malloc_top_pad(0)
    args = ["bench", "--quick", "--lengths", "128", "--no-progress", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    assert "mallopt(M_TOP_PAD, 1073741824)" in capsys.readouterr().out
    assert cli.main([*args, "--default-malloc", "--overwrite"]) == 0  # same --out again
    assert "as found (no mallopt)" in capsys.readouterr().out


def test_quick_bench_train_mode_bf16_times_forward_and_backward(tmp_path, capsys):
    argv = ["bench", "--quick", "--mode", "train", "--dtype", "bf16", "--lengths", "96,200",
            "--methods", "sdpa,polysketch,psf_mixed", "--out", str(tmp_path),
            "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "forward + backward" in printed and "bf16" in printed
    with (tmp_path / "results.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {(r["section"], r["method"], r["T"]) for r in rows} == {
        ("train", m, t) for m in ("sdpa", "polysketch", "psf_mixed") for t in ("96", "200")
    }  # no decode rows in train mode
    assert all(r["status"] == "ok" and float(r["median_ms"]) > 0 for r in rows)
    assert all(float(r["speedup_vs_sdpa"]) > 0 for r in rows if r["method"] != "sdpa")
    assert cli.main(["bench", "--quick", "--methods", "flash", "--out", str(tmp_path)]) == 2
    assert "polysketch bench: error: methods" in capsys.readouterr().err


def test_quick_model_bench_reports_tokens_per_second(tmp_path, capsys):
    argv = ["bench", "--model", "--quick", "--lengths", "64", "--out", str(tmp_path),
            "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "tokens/s" in capsys.readouterr().out
    with (tmp_path / "model_results.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["attention"] for r in rows] == ["softmax", "psf_random", "psf_mixed"]
    assert all(r["status"] == "ok" and float(r["tokens_per_s"]) > 0 for r in rows)
    assert float(rows[0]["x_softmax"]) == 1.0
    chosen = [*argv, "--threads", "1", "--attentions", "psf_random,soft_hash_1k", "--overwrite"]
    assert cli.main(chosen) == 0
    assert "(1 threads)" in capsys.readouterr().out  # the count measured with, not restored
    with (tmp_path / "model_results.csv").open() as fh:
        assert [r["attention"] for r in csv.DictReader(fh)] == ["psf_random", "soft_hash_1k"]
    assert cli.main([*chosen[:-3], "--attentions", "nope", "--overwrite"]) == 2
    assert "polysketch bench: error: attentions" in capsys.readouterr().err
    spec = "soft_hash_1k:num_features=16,local_window=8,temperature=8.0"
    assert cli.main([*chosen[:-3], "--attentions", f"psf_random,{spec}", "--overwrite"]) == 0
    assert spec in capsys.readouterr().out
    with (tmp_path / "model_results.csv").open() as fh:
        assert [r["attention"] for r in csv.DictReader(fh)] == ["psf_random", spec]
    assert cli.main([*chosen[:-3], "--attentions", "num_features=16,psf_random",
                     "--overwrite"]) == 2  # fmt: skip
    assert "keyword with no NAME" in capsys.readouterr().err
    assert cli.main(["bench", "--quick", "--attentions", "psf_random", "--out", str(tmp_path),
                     "--overwrite"]) == 2  # fmt: skip
    assert "with --model or --decode only" in capsys.readouterr().err
    for mode in (["--model", "--lengths", "32"], ["--decode", "--decode-positions", "8"]):
        fresh = tmp_path / f"bad_value{mode[0]}"  # a map keyword of the wrong type: refused
        bad = ["bench", *mode, "--attentions", "psf_random,soft_hash_1k:num_features=x",
               "--out", str(fresh)]  # fmt: skip
        assert cli.main(bad) == 2
        err = capsys.readouterr().err
        assert "error: attentions 'soft_hash_1k:num_features=x': num_features must be" in err
        assert not fresh.exists()  # before --out is made, before anything is timed
    png = (tmp_path / "model_bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_bench_rounds_interleave_the_attentions(tmp_path, capsys, monkeypatch):
    """--rounds N times every attention of a length once per round, in turn (not one after the
    other), and reports the median of the rounds and the per-round ratios to softmax."""
    from polysketch.eval.bench import model as model_bench

    order, real = [], model_bench.time_call

    def recording(fn, **kw):
        order.append(fn.args[0].config.attention)  # fn = partial(_step, model, ...)
        return real(fn, **kw)

    monkeypatch.setattr(model_bench, "time_call", recording)
    argv = ["bench", "--model", "--quick", "--lengths", "32,48", "--rounds", "3", "--attentions",
            "softmax,psf_random", "--out", str(tmp_path), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "3 interleaved rounds" in capsys.readouterr().out
    assert order == ["softmax", "psf_random"] * 6  # per length: 3 rounds of both, in turn
    with (tmp_path / "model_results.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["attention"], r["T"]) for r in rows] == [
        ("softmax", "32"),
        ("psf_random", "32"),
        ("softmax", "48"),
        ("psf_random", "48"),
    ]
    for t in ("32", "48"):
        soft, lin = ([float(x) for x in r["round_ms"].split(";")] for r in rows if r["T"] == t)
        assert len(soft) == len(lin) == 3
        row = next(r for r in rows if r["T"] == t and r["attention"] == "psf_random")
        # round_ms carries 6 significant digits: ratios of them agree to ~1e-5
        want = sorted(s / x for s, x in zip(soft, lin, strict=True))[1]
        assert float(row["x_softmax"]) == pytest.approx(want, rel=2e-5)
        assert float(row["step_ms"]) == pytest.approx(sorted(lin)[1], rel=2e-5)
    assert all(float(r["x_softmax"]) == 1.0 for r in rows if r["attention"] == "softmax")
    for bad, message in ((["--rounds", "0"], "rounds must be"),
                         (["--rounds", "2", "--overwrite"], None)):  # fmt: skip
        if message is None:  # --rounds without --model
            argv_bad = ["bench", "--quick", "--out", str(tmp_path), *bad]
            message = "rounds is taken with --model only"
        else:
            argv_bad = [*argv[:-1], "--overwrite", *bad]
        assert cli.main(argv_bad) == 2
        assert message in capsys.readouterr().err


def test_time_call_times_blocks_after_a_warm_up():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    timing = time_call(fn, min_time=0.0, min_repeats=1)
    assert timing.repeats == 1 and len(calls) == 2  # the block-size estimate warms up
    assert 0.002 <= timing.fastest <= timing.median < 1.0
    calls.clear()
    timing = time_call(fn, min_time=0.0, min_repeats=3)  # slower than min_time: timed again
    assert timing.repeats >= 3 and len(calls) > timing.repeats
    calls.clear()
    timing = time_call(fn, min_time=0.1, min_repeats=1)
    assert timing.repeats >= 5 and 0.002 <= timing.fastest <= timing.median < 0.05  # ~0.1 s
    with pytest.raises(ValueError, match="min_repeats"):
        time_call(fn, min_time=0.0, min_repeats=0)


def test_algorithms_side_by_side_and_refusals_reported(tmp_path, capsys, monkeypatch):
    """--algorithms times polysketch/positive once per backend (rows NAME[ALGORITHM]); a
    backend the dispatcher refuses for the call is a skipped row with its reason."""
    from polysketch.ops import dispatch

    argv = ["bench", "--quick", "--mode", "train", "--lengths", "64", "--methods",
            "sdpa,polysketch,psf_mixed", "--algorithms", "chunked,chunked_blocks,cumsum",
            "--out", str(tmp_path), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    with (tmp_path / "results.csv").open() as fh:
        rows = {r["method"]: r for r in csv.DictReader(fh)}
    assert list(rows) == ["sdpa", "polysketch", "polysketch[chunked_blocks]",
                          "polysketch[cumsum]", "psf_mixed"]  # fmt: skip
    assert all(r["status"] == "ok" for r in rows.values())
    monkeypatch.setattr(dispatch, "_BACKEND", [None])  # no Triton here
    argv[argv.index("chunked,chunked_blocks,cumsum")] = "triton"
    assert cli.main([*argv, "--overwrite"]) == 0
    with (tmp_path / "results.csv").open() as fh:
        rows = {r["method"]: r for r in csv.DictReader(fh)}
    assert rows["polysketch[triton]"]["status"].startswith('skipped (algorithm="triton" needs')
    capsys.readouterr()
    assert cli.main([*argv[:-5], "--algorithms", "flash", "--out", str(tmp_path / "x")]) == 2
    assert "polysketch bench: error: algorithms" in capsys.readouterr().err
