"""Softmax-estimator measurement of the package: the angle sweep (HRF Fig. 2) and its plot.

The HRF Table 1 on UCI data is research: ``tests/test_experiments_hrf_table1.py``."""

import math

import pytest

from polysketch.eval.fidelity.softmax import angle_sweep, plot_angle_sweep

ROW_KEYS = {"map", "theta", "radius", "num_features", "feature_dim", "mse", "rel_err"}


@pytest.fixture(scope="module")
def sweep_rows():
    return angle_sweep(
        ["trig", "positive", "hybrid_angular", "hybrid_clustered"],
        dim=8,
        num_angles=7,
        num_features=8,
        lambda_features=4,
        trials=120,
        seed=0,
        progress=False,
    )


def _by_map(rows, name):
    return sorted((r for r in rows if r["map"] == name), key=lambda r: r["theta"])


def test_angle_sweep_rows(sweep_rows):
    assert len(sweep_rows) == 4 * 7
    for row in sweep_rows:
        assert set(row) == ROW_KEYS
        assert math.isfinite(row["mse"]) and math.isfinite(row["rel_err"]) and row["mse"] >= 0
    thetas = [r["theta"] for r in _by_map(sweep_rows, "trig")]
    assert thetas[0] == 0.0 and abs(thetas[-1] - math.pi) < 1e-12
    assert _by_map(sweep_rows, "trig")[0]["feature_dim"] == 16


def test_angle_sweep_reproduces_fig2_properties(sweep_rows):
    hyb = [r["rel_err"] for r in _by_map(sweep_rows, "hybrid_angular")]
    assert max(hyb) > 0.05
    assert hyb[0] < 1e-6 * max(hyb) and hyb[-1] < 1e-6 * max(hyb)  # Theorem 3.5: ε → 0 at 0, π
    trig = [r["rel_err"] for r in _by_map(sweep_rows, "trig")]
    pos = [r["rel_err"] for r in _by_map(sweep_rows, "positive")]
    assert trig[0] < 1e-6 and pos[-1] < 1e-6  # exact at θ = 0 (trig) and θ = π (positive)
    assert all(a < b for a, b in zip(trig, trig[1:], strict=False))  # Lemma 3.4: increasing
    assert hyb[-2] < trig[-2] and hyb[1] < pos[1]


def test_angle_sweep_trig_matches_lemma_3_4(sweep_rows):
    """ε_{θ,r}(trig) = (2m)^{-1/2} e^{2r² s}(1 − e^{−4r² s}), s = sin²(θ/2) (Eq. 25), m = 8."""
    for row in _by_map(sweep_rows, "trig")[2:]:
        s = math.sin(row["theta"] / 2) ** 2
        theory = math.exp(2 * s) * (1 - math.exp(-4 * s)) / math.sqrt(2 * 8)
        assert abs(row["rel_err"] / theory - 1) < 0.25, (row, theory)


def test_angle_sweep_is_seeded():
    kw = dict(dim=4, num_angles=3, num_features=4, trials=5, progress=False)
    assert angle_sweep("positive", seed=3, **kw) == angle_sweep("positive", seed=3, **kw)
    assert angle_sweep("positive", seed=3, **kw) != angle_sweep("positive", seed=4, **kw)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="maps"):
        angle_sweep("no_such_map", progress=False)
    with pytest.raises(ValueError, match="maps"):
        angle_sweep([], progress=False)
    with pytest.raises(ValueError, match="maps"):
        angle_sweep("tensorsketch", dim=4, num_angles=2, trials=2, progress=False)
    with pytest.raises(ValueError, match="num_angles"):
        angle_sweep("positive", num_angles=1, progress=False)
    with pytest.raises(ValueError, match="radius"):
        angle_sweep("positive", radius=0.0, progress=False)
    with pytest.raises(ValueError, match="rows"):
        plot_angle_sweep([], "unused.png")


def _is_png(path):
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_plot_writes_png(tmp_path, sweep_rows):
    out = plot_angle_sweep(sweep_rows, tmp_path / "sweep" / "fig2.png")
    assert out == tmp_path / "sweep" / "fig2.png" and _is_png(out)
