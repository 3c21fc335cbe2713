"""Tests of polysketch.eval.fidelity, data_sources and plots."""

import math

import numpy as np
import pytest
import torch

from conftest import rel_err
from polysketch.eval import fidelity as fid
from polysketch.eval.fidelity.data_sources import load_qk
from polysketch.eval.plots import plot_fidelity_sweep
from polysketch.features import FeatureMap
from polysketch.random import gaussian, make_generator


class GaussianDegree2(FeatureMap):
    """Test map: φ(x) = (G1 x) ⊙ (G2 x) / √m, unbiased for (x·y)², F = m."""

    kind = "unbiased"
    is_random = True

    def __init__(self, dim, *, num_features=8, seed=None):
        super().__init__(dim)
        self.m = num_features
        self._draw(make_generator(seed))

    @property
    def feature_dim(self):
        return self.m

    def _draw(self, generator):
        self._set_buffer("g1", gaussian(self.m, self.dim, generator=generator))
        self._set_buffer("g2", gaussian(self.m, self.dim, generator=generator))

    def _features(self, x):
        g1, g2 = self.g1.to(x.dtype), self.g2.to(x.dtype)
        return (x @ g1.T) * (x @ g2.T) / math.sqrt(self.m)

    def target_kernel(self, x, y):
        return (x @ y.transpose(-1, -2)) ** 2


class ExactLinear(FeatureMap):
    """Test map: φ(x) = x, exact for x·y."""

    kind = "exact"

    @property
    def feature_dim(self):
        return self.dim

    def _features(self, x):
        return x

    def target_kernel(self, x, y):
        return x @ y.transpose(-1, -2)


@pytest.fixture
def qk():
    return load_qk("gaussian", dim=6, num=40, seed=3)


# ----- metrics on hand-computed examples ---------------------------------------------------
def test_metrics_hand_computed():
    approx = torch.tensor([[1.0, 3.0], [2.0, 8.0]], dtype=torch.float64)
    exact = torch.tensor([[2.0, 2.0], [2.0, 4.0]], dtype=torch.float64)
    # entries |A-E|/|E|: 0.5, 0.5, 0, 1
    assert fid.rmae(approx, exact) == pytest.approx(0.5, rel=1e-15)
    assert fid.rmae(approx, exact, rel_floor=0.0) == pytest.approx(0.5, rel=1e-15)
    assert fid.max_relative_error(approx, exact) == pytest.approx(1.0, rel=1e-15)
    # ||A-E||_F = sqrt(1 + 1 + 0 + 16), ||E||_F = sqrt(4 + 4 + 4 + 16)
    expected = math.sqrt(18) / math.sqrt(28)
    assert fid.relative_frobenius_error(approx, exact) == pytest.approx(expected, rel=1e-15)
    assert fid.relative_frobenius_error(approx, exact) == pytest.approx(rel_err(approx, exact))


def test_denominator_guard():
    exact = torch.tensor([[0.001, 1.0]], dtype=torch.float64)
    approx = torch.tensor([[0.002, 1.0]], dtype=torch.float64)
    # verbatim Eq. 21: relative error 1 on the tiny entry, 0 on the other
    assert fid.rmae(approx, exact, rel_floor=0.0) == pytest.approx(0.5)
    assert fid.max_relative_error(approx, exact, rel_floor=0.0) == pytest.approx(1.0)
    # floor 0.01 * max|E| = 0.01: 0.001 / 0.01 = 0.1
    assert fid.max_relative_error(approx, exact, rel_floor=0.01) == pytest.approx(0.1)
    assert fid.rmae(approx, exact, rel_floor=0.01) == pytest.approx(0.05)
    zero = torch.zeros(1, 2, dtype=torch.float64)
    assert fid.rmae(zero, zero, rel_floor=0.0) == 0.0
    assert fid.relative_frobenius_error(zero, zero) == 0.0
    assert fid.relative_frobenius_error(zero + 1, zero) == math.inf
    assert fid.max_relative_error(zero + 1, zero, rel_floor=0.0) == math.inf


def test_metric_bad_input():
    a = torch.ones(2, 3)
    with pytest.raises(ValueError, match="approx"):
        fid.rmae(a, torch.ones(3, 2))
    with pytest.raises(ValueError, match="rel_floor"):
        fid.rmae(a, a, rel_floor=-1.0)
    with pytest.raises(TypeError, match="exact"):
        fid.relative_frobenius_error(a, [[1.0]])


# ----- the Eckart–Young optimum --------------------------------------------------------------
@pytest.mark.parametrize("degree,rank", [(2, 5), (3, 12), (2, 1)])
def test_optimal_rank_error_is_truncated_svd_error(qk, degree, rank):
    q, k = qk
    exact = fid.polynomial_target(q, k, degree)
    best = fid.optimal_rank_approximation(exact, rank)
    assert int(torch.linalg.matrix_rank(best)) == rank
    opt = fid.optimal_rank_error(q, k, degree, rank)
    assert float((best - exact).norm()) == pytest.approx(opt.absolute, rel=1e-10)
    assert opt.relative == pytest.approx(opt.absolute / float(exact.norm()), rel=1e-12)
    s = np.linalg.svd(exact.numpy(), compute_uv=False)  # independent reference
    assert opt.absolute == pytest.approx(float(np.sqrt((s[rank:] ** 2).sum())), rel=1e-10)


def test_optimum_beats_every_rank_m_map_tried(qk):
    q, k = qk
    m = 8
    opt = fid.optimal_rank_error(q, k, 2, m)
    assert opt.relative > 0.05  # rank 8 < rank of (QKᵀ)², which is C(7, 2) = 21
    errors = []
    for seed in range(10):
        approx, exact = fid.kernel_matrices(GaussianDegree2(6, num_features=m, seed=seed), q, k)
        errors.append(fid.relative_frobenius_error(approx, exact))
    # random rank-m factorizations of the exact matrix itself: (E P)(Pᵀ P)^-1 Pᵀ
    exact = fid.polynomial_target(q, k, 2)
    gen = make_generator(0)
    for _ in range(10):
        p = torch.randn(exact.shape[1], m, generator=gen, dtype=torch.float64)
        proj = p @ torch.linalg.pinv(p)
        errors.append(fid.relative_frobenius_error(exact @ proj, exact))
    assert min(errors) >= opt.relative * (1 - 1e-12)


def test_optimum_zero_at_full_rank_and_batched(qk):
    q, k = qk
    assert fid.optimal_rank_error(q, k, 2, 21).relative < 1e-12  # dim of Sym²(R^6)
    assert fid.optimal_rank_error(q, k, 1, 6).relative < 1e-12
    qb, kb = torch.stack([q, 2 * q]), torch.stack([k, k])  # (2, N, D): errors add in squares
    one = fid.optimal_rank_error(q, k, 2, 4).absolute
    both = fid.optimal_rank_error(qb, kb, 2, 4).absolute
    assert both == pytest.approx(math.sqrt(one**2 + (4 * one) ** 2), rel=1e-10)


def test_optimal_curve_matches_pointwise(qk):
    q, k = qk
    rows = fid.optimal_curve(q, k, degrees=[2, 3], ranks=[3, 10])
    assert len(rows) == 4
    for row in rows:
        ref = fid.optimal_rank_error(q, k, row["degree"], row["rank"])
        assert row["relative"] == pytest.approx(ref.relative, rel=1e-12)


# ----- the fitted (out-of-sample) optimum ----------------------------------------------------
def _lift(x: torch.Tensor, degree: int) -> torch.Tensor:
    """vec(x^{⊗p}) by explicit Kronecker products: (N, D) -> (N, D^p)."""
    out = x
    for _ in range(degree - 1):
        out = torch.einsum("na,nb->nab", out, x).reshape(x.shape[0], -1)
    return out


@pytest.mark.parametrize("degree,rank", [(2, 5), (3, 12)])
def test_fitted_optimum_in_sample_is_truncated_svd(qk, degree, rank):
    q, k = qk
    approx = fid.fitted_optimum(q, k, q, k, degree=degree, rank=rank)
    best = fid.optimal_rank_approximation(fid.polynomial_target(q, k, degree), rank)
    assert rel_err(approx, best) < 1e-8


def test_fitted_optimum_out_of_sample_matches_explicit_lift(qk):
    """Against Eq. 7–8 computed literally: ψ_2 formed explicitly, W_Q, W_K by the rank-m
    Eckart–Young of the lifted fitting samples (``low_rank_bilinear``), applied to new q/k."""
    from polysketch.features.llops_init import low_rank_bilinear

    q_fit, k_fit = qk
    q, k = load_qk("gaussian", dim=6, num=30, seed=11)
    approx = fid.fitted_optimum(q_fit, k_fit, q, k, degree=2, rank=7)
    w_q, w_k = low_rank_bilinear(_lift(q_fit, 2), _lift(k_fit, 2), 7)
    literal = (_lift(q, 2) @ w_q) @ (_lift(k, 2) @ w_k).T
    assert rel_err(approx, literal) < 1e-8
    # full rank (dim Sym²(R^6) = 21) fitted on 40 > 21 samples: exact on unseen vectors
    full = fid.fitted_optimum(q_fit, k_fit, q, k, degree=2, rank=21)
    assert rel_err(full, fid.polynomial_target(q, k, 2)) < 1e-8
    # rank 7 of 21 is not exact out of sample, and not better than the in-sample optimum
    exact = fid.polynomial_target(q, k, 2)
    in_sample = fid.optimal_rank_error(q, k, 2, 7).relative
    assert fid.relative_frobenius_error(approx, exact) >= in_sample


def test_fitted_optima_share_one_fit_across_ranks(qk):
    from polysketch.features.optimal_rank import fitted_optima

    q_fit, k_fit = qk
    q, k = load_qk("gaussian", dim=6, num=30, seed=11)
    many = fitted_optima(q_fit, k_fit, q, k, degree=2, ranks=[3, 7, 50])
    for rank, approx in zip([3, 7, 50], many, strict=True):
        one = fid.fitted_optimum(q_fit, k_fit, q, k, degree=2, rank=rank)
        assert rel_err(approx, one) < 1e-12


def test_fitted_optimum_bad_input(qk):
    q, k = qk
    with pytest.raises(ValueError, match="k_fit"):
        fid.fitted_optimum(q, k[:, :5], q, k, degree=2, rank=3)
    with pytest.raises(ValueError, match="rank"):
        fid.fitted_optimum(q, k, q, k, degree=2, rank=0)


# ----- evaluate_map ------------------------------------------------------------------------
def test_exact_map_zero_error_and_nan_ratio(qk):
    q, k = qk
    row = fid.evaluate_map(ExactLinear(6), q, k, degree=1, trials=4)
    assert row["trials"] == 1  # deterministic: evaluated once
    assert row["rel_frobenius_mean"] < 1e-14 and row["rmae_mean"] < 1e-12
    assert math.isnan(row["ratio_to_optimal"]) and "optimum ~0" in row["ratio_note"]
    assert row["target"] == "(q·k)^1"
    row = fid.evaluate_map("tensor_power", q, k, degree=3)
    assert row["feature_dim"] == 216 and row["rel_frobenius_mean"] < 1e-12
    assert row["target"] == "(q·k)^3" and math.isnan(row["ratio_to_optimal"])


def test_random_map_rows_and_ratio(qk):
    q, k = qk
    row = fid.evaluate_map(GaussianDegree2(6, num_features=8, seed=0), q, k, trials=6, seed=1)
    assert row["trials"] == 6 and row["state_dim"] == 8 and row["rel_frobenius_std"] > 0
    opt = fid.optimal_rank_error(q, k, 2, 8)
    assert row["optimal_rel"] == pytest.approx(opt.relative, rel=1e-12)
    assert row["ratio_to_optimal"] == pytest.approx(row["rel_frobenius_mean"] / opt.relative)
    assert row["ratio_to_optimal"] > 1
    for key in ("rel_frobenius", "rmae", "max_rel"):
        assert math.isfinite(row[f"{key}_mean"]) and math.isfinite(row[f"{key}_std"])


def test_evaluate_map_reproducible_under_seed(qk):
    q, k = qk
    a = fid.evaluate_map("tensorsketch", q, k, degree=2, num_features=16, trials=3, seed=5)
    b = fid.evaluate_map("tensorsketch", q, k, degree=2, num_features=16, trials=3, seed=5)
    c = fid.evaluate_map("tensorsketch", q, k, degree=2, num_features=16, trials=3, seed=6)
    a.pop("seconds"), b.pop("seconds")
    assert a == b
    assert c["rel_frobenius_mean"] != a["rel_frobenius_mean"]
    template = GaussianDegree2(6, num_features=8, seed=0)
    before = template.g1.clone()
    x = fid.evaluate_map(template, q, k, trials=3, seed=2)
    y = fid.evaluate_map(template, q, k, trials=3, seed=2)
    assert x["rel_frobenius_mean"] == y["rel_frobenius_mean"]
    assert torch.equal(template.g1, before)  # the caller's map is not redrawn


def test_error_falls_with_feature_dim(qk):
    q, k = qk
    small = fid.evaluate_map("tensorsketch", q, k, degree=2, num_features=8, trials=8)
    large = fid.evaluate_map("tensorsketch", q, k, degree=2, num_features=512, trials=8)
    assert large["rel_frobenius_mean"] < 0.5 * small["rel_frobenius_mean"]


def test_polynomial_target_mode(qk):
    q, k = qk
    own = fid.evaluate_map("elu", q, k, degree=2)
    poly = fid.evaluate_map("elu", q, k, degree=2, target="polynomial")
    assert own["target"] == "own kernel" and own["rel_frobenius_mean"] < 1e-12
    assert poly["target"] == "(q·k)^2" and poly["rel_frobenius_mean"] > 0.1


def test_evaluate_map_fits_learnable_maps(qk):
    q, k = qk
    fit_data = load_qk("gaussian", dim=6, num=40, seed=4)
    kwargs = dict(degree=2, num_features=8, trials=3, seed=0)
    init = fid.evaluate_map("llops", q, k, **kwargs)
    fitted = fid.evaluate_map("llops", q, k, fit_steps=60, fit_data=fit_data, **kwargs)
    assert init["fitted"] == 0 and fitted["fitted"] == 60 and fitted["trials"] == 1
    assert fitted["rel_frobenius_mean"] < init["rel_frobenius_mean"]


def test_evaluate_map_bad_input(qk):
    q, k = qk
    with pytest.raises(ValueError, match="degree"):
        fid.evaluate_map("tensorsketch", q, k, degree=0)
    with pytest.raises(ValueError, match="trials"):
        fid.evaluate_map("tensorsketch", q, k, trials=0)
    with pytest.raises(ValueError, match="target"):
        fid.evaluate_map("tensorsketch", q, k, target="softmax")
    with pytest.raises(ValueError, match="k"):
        fid.evaluate_map("tensorsketch", q, k[:, :3])
    with pytest.raises(ValueError, match="unknown feature map"):
        fid.evaluate_map("no_such_map", q, k)
    with pytest.raises(TypeError, match="name"):
        fid.evaluate_map(3, q, k)


# ----- sweep ---------------------------------------------------------------------------------
def test_sweep_rows_and_skips(qk):
    q, k = qk
    rows = fid.sweep(
        ["tensor_power", "tensorsketch"],
        q,
        k,
        degrees=[2, 3],
        feature_dims=[8, 16],
        trials=2,
        progress=False,
        max_feature_dim=100,
    )
    by = {(r["map"], r["degree"], r["num_features"]): r for r in rows}
    assert len(rows) == 2 + 4  # exact map once per degree, tensorsketch per (p, F)
    assert by[("tensor_power", 2, None)]["skipped"] == ""
    assert "feature_dim 216 > 100" in by[("tensor_power", 3, None)]["skipped"]
    assert all(by[("tensorsketch", p, f)]["skipped"] == "" for p in (2, 3) for f in (8, 16))
    bad = fid.sweep(
        ["tensorsketch"],
        q,
        k,
        degrees=[2],
        feature_dims=[8],
        trials=1,
        progress=False,
        map_kwargs={"tensorsketch": {"coef0": -1.0}},
    )
    assert bad[0]["skipped"].startswith("ValueError") and "coef0" in bad[0]["skipped"]
    unknown = fid.sweep(["no_such_map"], q, k, degrees=[2], feature_dims=[8], progress=False)
    assert len(unknown) == 1 and "unknown feature map" in unknown[0]["skipped"]


# ----- data sources --------------------------------------------------------------------------
def test_load_qk_synthetic():
    q, k = load_qk("gaussian", dim=8, num=2000, seed=0)
    assert q.shape == k.shape == (2000, 8) and q.dtype == torch.float64
    assert float((q * k).sum(-1).var()) == pytest.approx(1.0, abs=0.15)  # Var(q·k) = 1
    q2, _ = load_qk("gaussian", dim=8, num=2000, seed=0)
    assert torch.equal(q, q2)
    s, t = load_qk("sphere", dim=5, num=10, seed=1)
    assert torch.allclose(s.norm(dim=-1), torch.ones(10, dtype=torch.float64))
    assert torch.allclose(t.norm(dim=-1), torch.ones(10, dtype=torch.float64))


def test_load_qk_files(tmp_path):
    q = torch.randn(2, 3, 10, 4)  # (B, H, T, D) from a model: rows are flattened
    k = torch.randn(60, 4)
    torch.save({"q": q, "k": k}, tmp_path / "dict.pt")
    torch.save((q, k), tmp_path / "tuple.pt")
    np.savez(tmp_path / "arrays.npz", q=q.reshape(-1, 4).numpy(), k=k.numpy())
    np.save(tmp_path / "stacked.npy", np.stack([k.numpy(), k.numpy() * 2]))
    for name in ("dict.pt", "tuple.pt", "arrays.npz"):
        lq, lk = load_qk(tmp_path / name, dim=4, num=None)
        assert lq.dtype == torch.float64 and lq.shape == (60, 4) and lk.shape == (60, 4)
        assert torch.equal(lq, q.reshape(-1, 4).double())
        assert torch.equal(lk, k.double())
    sq, sk = load_qk(str(tmp_path / "stacked.npy"), dim=None, num=None)
    assert torch.equal(sk, 2 * sq)
    sub_q, sub_k = load_qk(tmp_path / "dict.pt", dim=4, num=7, seed=1)
    assert sub_q.shape == (7, 4) and sub_k.shape == (7, 4)
    rows = {tuple(r.tolist()) for r in q.reshape(-1, 4).double()}
    assert all(tuple(r.tolist()) in rows for r in sub_q)  # a subset of the file's rows


def test_load_qk_errors(tmp_path):
    with pytest.raises(ValueError, match="source"):
        load_qk(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="source"):
        load_qk("uniform")
    torch.save({"q": torch.randn(3, 4)}, tmp_path / "noq.pt")
    with pytest.raises(ValueError, match="source .*lacks key"):
        load_qk(tmp_path / "noq.pt", dim=4)
    torch.save({"q": torch.randn(3, 4), "k": torch.randn(3, 5)}, tmp_path / "dims.pt")
    with pytest.raises(ValueError, match="source .*last dim"):
        load_qk(tmp_path / "dims.pt", dim=None)
    torch.save({"q": torch.randn(3, 4), "k": torch.randn(3, 4)}, tmp_path / "ok.pt")
    with pytest.raises(ValueError, match="dim"):
        load_qk(tmp_path / "ok.pt", dim=8)
    torch.save({"q": torch.tensor([[float("nan"), 1.0]]), "k": torch.ones(1, 2)}, tmp_path / "n.pt")
    with pytest.raises(ValueError, match="source .*NaN"):
        load_qk(tmp_path / "n.pt", dim=2)
    np.save(tmp_path / "flat.npy", np.ones(5))
    with pytest.raises(ValueError, match="source .*shape"):
        load_qk(tmp_path / "flat.npy", dim=None)
    (tmp_path / "data.txt").write_text("1 2 3")
    with pytest.raises(ValueError, match="source .*unknown file type"):
        load_qk(tmp_path / "data.txt")
    (tmp_path / "junk.pt").write_text("not a torch file")
    with pytest.raises(ValueError, match="source .*cannot load"):
        load_qk(tmp_path / "junk.pt")
    with pytest.raises(ValueError, match="num"):
        load_qk("gaussian", dim=4, num=0)


# ----- plots ---------------------------------------------------------------------------------
def test_plot_fidelity_sweep(tmp_path, qk):
    q, k = qk
    rows = fid.sweep(
        ["tensorsketch", "tensor_power"],
        q,
        k,
        degrees=[2],
        feature_dims=[8, 16],
        trials=2,
        progress=False,
    )
    rows.append({"map": "x", "degree": 2, "num_features": 4, "skipped": "refused"})
    optimal = fid.optimal_curve(q, k, degrees=[2], ranks=[8, 16])
    path = plot_fidelity_sweep(rows, tmp_path / "sub" / "f.png", optimal=optimal)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    empty = plot_fidelity_sweep([rows[-1]], tmp_path / "empty.png")
    assert empty.stat().st_size > 0


def test_evaluate_map_builds_softmax_maps_that_forward_kwargs():
    # positive's constructor forwards **kwargs to its base: degree= must not be passed to it
    g = torch.Generator().manual_seed(0)
    q = torch.randn(48, 6, generator=g, dtype=torch.float64) * 0.3
    k = torch.randn(40, 6, generator=g, dtype=torch.float64) * 0.3
    row = fid.evaluate_map("positive", q, k, degree=4, num_features=8, trials=2, seed=0)
    assert row["feature_dim"] == 16 and row["target"] == "own kernel"
    assert 0 < row["rel_frobenius_mean"] < 5
