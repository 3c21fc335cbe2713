"""The held-out reading of a copy-probe grid (issue 70 item 2): means of three evaluations."""

import csv

import long_context
import pytest
from experiments.long_context.heldout import heldout_summary, mean_at


def _curve(points):
    return [{"step": s, "gain": g, "ablated_gain": a, "second": sec} for s, g, a, sec in points]


def test_a_read_is_the_mean_of_the_evaluation_and_the_two_before():
    c = _curve([(0, 0.0, 0.0, 3.3), (25, 0.5, 0.0, 3.0), (50, 1.0, 0.0, 2.0),
                (75, 3.0, 0.01, 1.0), (100, 1.0, 0.02, 1.0)])  # fmt: skip
    assert mean_at(c, 100, "gain") == (100, pytest.approx((3.0 + 1.0 + 1.0) / 3))
    assert mean_at(c, 99, "gain") == (75, pytest.approx((0.5 + 1.0 + 3.0) / 3))  # at the earlier
    assert mean_at(c, 40, "gain") is None  # fewer than three evaluations
    assert mean_at(c, 100, "ablated_gain")[1] == pytest.approx(0.01)
    with pytest.raises(ValueError, match="n must"):
        mean_at(c, 100, "gain", n=0)


def test_the_summary_reads_softmax_onset_and_the_three_targets():
    ref = _curve([(s, 3.2 * min(1, s / 100), "", 3.3 - 3.2 * min(1, s / 100))
                  for s in range(0, 201, 25)])  # fmt: skip
    onset = 75  # the first evaluation with second < ln 26 / 2
    cand = _curve([(s, 2.0 if s >= 100 else 0.0, 0.01, 1.0 if s >= 100 else 3.2)
                   for s in range(0, 201, 25)])  # fmt: skip
    s = heldout_summary(ref, cand, 200)
    assert s["ref_onset"] == onset and s["softmax_copies"]
    assert s["at_step"] == 100 and s["gain_at"] == pytest.approx(2.0 / 3)  # 50, 75, 100
    assert s["ref_gain"] == pytest.approx(3.2)
    assert s["early"] == pytest.approx(2.0 / 3 / 3.2) and s["end"] == pytest.approx(2.0 / 3.2)
    assert s["meets"] is False  # 0.21 < 0.5
    good = _curve([(p["step"], 3.0, 0.0, 0.2) for p in cand])
    assert heldout_summary(ref, good, 200)["meets"] is True
    leaky = _curve([(p["step"], 3.0, 0.2, 0.2) for p in cand])  # the window copies: not the branch
    assert heldout_summary(ref, leaky, 200)["meets"] is False
    flat = _curve([(p["step"], 0.0, "", 3.3) for p in ref])  # softmax does not copy
    none = heldout_summary(flat, good, 200)
    assert not none["softmax_copies"] and none["meets"] is None
    with pytest.raises(ValueError, match="budget"):
        heldout_summary(ref, cand[:-1], 200)


def test_heldout_cli_on_a_smoke_grid(tmp_path):
    out = tmp_path / "grid"
    attention = "soft_hash_far_local_balanced:num_features=16"
    base = ["grid", "--smoke", "--no-progress", "--out", str(out), "--schedules", "cli",
            "--seeds", "4", "--attentions", "softmax", attention]  # fmt: skip
    assert long_context.main([*base, "--stop-fraction", "1"]) == 0
    assert long_context.main(["heldout", "--grid", str(out), "--attention", attention]) == 0
    with open(out / "heldout.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["seed"] for r in rows] == ["4"]
    md = (out / "heldout.md").read_text()
    assert "Target met in" in md and "mean of the evaluation" in md
    assert (out / "heldout.png").stat().st_size > 0
    early = tmp_path / "early"  # a grid with an early stop is not a held-out one
    assert long_context.main([*base[:4], str(early), *base[5:]]) == 0
    assert long_context.main(["heldout", "--grid", str(early), "--attention", attention]) == 2
