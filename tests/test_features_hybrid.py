"""Tests of hybrid random features (HRF Eq. 8–12, 19, 20, 22–24; Lemma 2.2, 3.2, Thm 3.1)."""

import math

import pytest
import torch

from polysketch.features import create
from polysketch.features.hybrid import (
    AngularHybrid,
    GaussianHybrid,
    _gaussian_lambda_features,
    angular_hybrid_features,
    gaussian_hybrid_features,
)
from polysketch.features.random_features import (
    draw_directions,
    positive_features,
    trig_features,
)

F64 = torch.float64


def draws(*shape, orthogonal=False, seed=0):
    """Directions of shape (..., rows, D), blocks of D rows orthogonal when asked."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape[:-1])
    return draw_directions(n, shape[-1], orthogonal=orthogonal, generator=g).to(F64).view(shape)


def unit(v):
    return v / v.norm(dim=-1, keepdim=True)


def inputs(tx, ty, dim, norm_x, norm_y=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = unit(torch.randn(tx, dim, generator=g, dtype=F64)) * norm_x
    y = unit(torch.randn(ty, dim, generator=g, dtype=F64)) * (norm_x if norm_y is None else norm_y)
    return x, y


def angle(x, y):
    return torch.arccos((unit(x) @ unit(y).T).clamp(-1, 1))


def estimates(fn, x, y, *args, **kw):
    return fn(x, *args, role="query", **kw) @ fn(y, *args, role="key", **kw).transpose(-1, -2)


def lemma_2_2_mse(x, y, m):
    """(MSE of SM^++, MSE of SM^trig) by Eq. 7, each (Tx, Ty)."""
    sm = torch.exp(x @ y.T)
    z2 = ((x[:, None] + y[None]) ** 2).sum(-1)
    d2 = ((x[:, None] - y[None]) ** 2).sum(-1)
    pos = torch.exp(z2) * sm**2 * (1 - torch.exp(-z2)) ** 2 / (2 * m)
    trig = torch.exp(z2) / sm**2 * (1 - torch.exp(-d2)) ** 2 / (2 * m)
    return pos, trig


def lemma_3_2(theta, n):
    """(E[λ̂], E[λ̂²]) of the angular coefficient (Eq. 24)."""
    t = theta / math.pi
    return t, t * (t - t / n + 1 / n)


def theorem_3_1_mse(x, y, m, n, shared):
    """MSE of the angular hybrid: Eq. 22 (independent ω's) or Eq. 23 (shared ω's)."""
    mse_pos, mse_trig = lemma_2_2_mse(x, y, m)
    e1, e2 = lemma_3_2(angle(x, y), n)
    mse = e2 * mse_pos + (1 - 2 * e1 + e2) * mse_trig
    if shared:
        dn = (x * x).sum(-1)[:, None] - (y * y).sum(-1)[None]
        mse = mse - 2 / m * torch.exp(2 * x @ y.T) * (1 - torch.cos(dn)) * (e1 - e2)
    return mse


def angular_draws(reps, m, n, dim, shared, orthogonal=False, seed=0):
    omega_pos = draws(reps, m, dim, orthogonal=orthogonal, seed=seed)
    omega_trig = omega_pos if shared else draws(reps, m, dim, orthogonal=orthogonal, seed=seed + 1)
    return omega_pos, omega_trig, draws(reps, n, dim, orthogonal=orthogonal, seed=seed + 2)


# ----- exact identities ---------------------------------------------------------------------
def test_angular_linearization_lemma_2_3():
    """query·key == λ̂ SM̂++ + (1 − λ̂) SM̂trig with λ̂ = 1/2 − (2n)^{-1} Σ sgn sgn (Eq. 12, 19)."""
    dim, m, n = 5, 3, 4
    x, y = inputs(3, 4, dim, 0.8, 1.3)
    wp, wt, tau = (d[0] for d in angular_draws(1, m, n, dim, shared=False))
    lam = 0.5 - torch.sign(x @ tau.T) @ torch.sign(y @ tau.T).T / (2 * n)
    pos = positive_features(x, wp) @ positive_features(y, wp).T
    trig = trig_features(x, wt) @ trig_features(y, wt).T
    got = estimates(angular_hybrid_features, x, y, wp, wt, tau)
    assert torch.allclose(got, lam * pos + (1 - lam) * trig, rtol=1e-12, atol=0)
    assert angular_hybrid_features(x, wp, wt, tau, "query").shape[-1] == 4 * m * (n + 1)


def test_gaussian_linearization_eq_8_20():
    dim, m, n, p = 4, 3, 2, 2
    x, y = inputs(3, 2, dim, 0.7, 0.9, seed=1)
    base, lam_w = draws(p + 1, m, dim, seed=2), draws(p, n, dim, seed=3)
    M = torch.randn(p, dim, dim, dtype=F64, generator=torch.Generator().manual_seed(4))
    widths = torch.tensor([0.8, 1.5], dtype=F64)
    names = ("trig", "positive", "positive")
    got = estimates(gaussian_hybrid_features, x, y, base, lam_w, M, widths, estimators=names)
    fns = {"trig": trig_features, "positive": positive_features}
    sm = [fns[e](x, w) @ fns[e](y, w).T for e, w in zip(names, base, strict=True)]
    lams = []
    for k in range(p):
        r1 = _gaussian_lambda_features(x / widths[k], lam_w[k], "positive")
        r2 = _gaussian_lambda_features(-(y @ M[k].T) / widths[k], lam_w[k], "positive")
        lams.append(r1 @ r2.T)
    ref = sum(lk * sk for lk, sk in zip(lams, sm, strict=False)) + (1 - sum(lams)) * sm[p]
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-14)
    assert got.shape == (3, 2)
    q = gaussian_hybrid_features(x, base, lam_w, M, widths, "query", estimators=names)
    assert q.shape[-1] == 2 * m * (1 + 4 * p * n)


@pytest.mark.parametrize("cls", [AngularHybrid, GaussianHybrid])
def test_class_matches_pure_function(cls):
    dim = 4
    fmap = cls(dim, num_features=3, lambda_features=2, seed=5, scale=0.5).to(F64)
    x, _ = inputs(3, 1, dim, 1.0)
    u = math.sqrt(0.5) * x
    for role, f in (("query", fmap.query), ("key", fmap.key)):
        if cls is AngularHybrid:
            ref = angular_hybrid_features(u, fmap.omega_pos, fmap.omega_trig, fmap.tau, role)
        else:
            ref = gaussian_hybrid_features(
                u,
                fmap.base_omega,
                fmap.lambda_omega,
                fmap.M,
                fmap.widths,
                role,
                estimators=("positive", "trig"),
            )
        assert torch.allclose(f(x), ref, rtol=1e-14, atol=0)
        assert f(x).shape[-1] == fmap.feature_dim
    assert not fmap.nonnegative and fmap.kind == "unbiased"


def test_shared_directions_uses_one_set():
    fmap = AngularHybrid(4, num_features=3, lambda_features=2, shared_directions=True, seed=0)
    assert "omega_trig" not in fmap.state_dict()
    x, _ = inputs(2, 1, 4, 0.5)
    x = x.float()
    ref = angular_hybrid_features(x, fmap.omega_pos, fmap.omega_pos, fmap.tau, "key")
    assert torch.equal(fmap.key(x), ref)


# ----- statistics: angular hybrid -----------------------------------------------------------
def test_lemma_3_2_moments_of_lambda():
    reps, n, dim = 20000, 3, 4
    x, y = inputs(3, 3, dim, 1.0, seed=6)
    tau = draws(reps, n, dim, seed=7)
    lam = 0.5 - torch.sign(x @ tau.mT) @ torch.sign(y @ tau.mT).mT / (2 * n)
    e1, e2 = lemma_3_2(angle(x, y), n)
    for sample, expect in ((lam, e1), (lam**2, e2)):
        se = sample.std(0) / math.sqrt(reps) + 1e-12
        assert ((sample.mean(0) - expect).abs() / se).max() < 4


@pytest.mark.parametrize("orthogonal", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_angular_unbiased(shared, orthogonal):
    reps, m, n, dim = (1000 if orthogonal else 4000), 4, 2, 4
    x, y = inputs(3, 4, dim, 0.9, 0.6, seed=8)
    args = angular_draws(reps, m, n, dim, shared, orthogonal=orthogonal, seed=9)
    est = estimates(angular_hybrid_features, x, y, *args)
    z = (est.mean(0) - torch.exp(x @ y.T)) / (est.std(0) / math.sqrt(reps))
    assert z.abs().max() < 4, z


@pytest.mark.parametrize("shared", [False, True])
def test_angular_mse_theorem_3_1(shared):
    reps, m, n, dim = 20000, 2, 2, 3
    x, y = inputs(3, 3, dim, 0.5, 1.0, seed=10)  # ‖x‖ ≠ ‖y‖: Eq. 23's extra term is active
    est = estimates(angular_hybrid_features, x, y, *angular_draws(reps, m, n, dim, shared, seed=11))
    sq_err = (est - torch.exp(x @ y.T)) ** 2
    theory = theorem_3_1_mse(x, y, m, n, shared)
    se = sq_err.std(0) / math.sqrt(reps)
    assert ((sq_err.mean(0) - theory).abs() / se).max() < 4
    assert (sq_err.mean(0) / theory - 1).abs().max() < 0.15
    if shared:  # and Eq. 23 is strictly below Eq. 22 here
        assert (theory < theorem_3_1_mse(x, y, m, n, False) * 0.97).all()


def test_sphere_error_vanishes_at_both_poles():
    """On S(r): hybrid exact at θ = 0, π; trig not at θ = π, positive not at θ = 0."""
    reps, m, n, dim, r = 4000, 4, 2, 3, 1.0
    x = torch.tensor([[r, 0.0, 0.0]], dtype=F64)
    thetas = torch.tensor(
        [0.0, 1e-3, 1e-1, math.pi / 2, math.pi - 1e-1, math.pi - 1e-3, math.pi], dtype=F64
    )
    y = r * torch.stack([torch.cos(thetas), torch.sin(thetas), torch.zeros_like(thetas)], -1)
    target = torch.exp(x @ y.T)[0]
    wp, wt, tau = angular_draws(reps, m, n, dim, shared=False, seed=12)
    rel = {
        "hybrid": estimates(angular_hybrid_features, x, y, wp, wt, tau)[:, 0],
        "positive": (positive_features(x, wp) @ positive_features(y, wp).mT)[:, 0],
        "trig": (trig_features(x, wt) @ trig_features(y, wt).mT)[:, 0],
    }
    rel = {k: ((v - target) ** 2).mean(0).sqrt() / target for k, v in rel.items()}
    h = rel["hybrid"]
    assert h[0] < 1e-12 and h[-1] < 1e-12  # every draw exact at the poles
    assert h[1] < 0.2 and h[-2] < 0.2 and h[1] < h[2] < h[3] and h[3] > h[4] > h[5]
    assert rel["trig"][-1] > 1.0 and rel["positive"][0] > 1.0  # ≈ 2.6 by Lemma 2.2
    theory = theorem_3_1_mse(x, y, m, n, shared=False)[0].sqrt() / target
    assert theory[0] == 0 and theory[-1] < 1e-7 and (theory[1:3] < theory[3]).all()
    assert theory[1] < theory[2] and theory[5] < theory[4]


# ----- statistics: Gaussian hybrid ----------------------------------------------------------
@pytest.mark.parametrize("name", ["positive", "trig"])
def test_gaussian_lambda_is_unbiased(name):
    reps, n, dim, c = 4000, 2, 3, 1.3
    x, y = inputs(3, 3, dim, 0.8, seed=13)
    M = torch.eye(dim, dtype=F64) + 0.3 * torch.randn(dim, dim, dtype=F64)
    omega = draws(reps, n, dim, seed=14)
    r1 = _gaussian_lambda_features(x / c, omega, name)
    r2 = _gaussian_lambda_features(-(y @ M.T) / c, omega, name)
    lam = r1 @ r2.mT
    target = torch.exp(-((x[:, None] + (y @ M.T)[None]) ** 2).sum(-1) / (2 * c**2))
    z = (lam.mean(0) - target) / (lam.std(0) / math.sqrt(reps))
    assert z.abs().max() < 4
    if name == "positive":
        assert (lam >= 0).all()


@pytest.mark.parametrize("config", ["default", "p2_trig_lambda"])
def test_gaussian_hybrid_unbiased(config):
    reps, m, n, dim = 4000, 3, 2, 4
    x, y = inputs(3, 4, dim, 0.8, 0.6, seed=15)
    if config == "default":
        p, M, widths, names, lam_name = 1, torch.eye(dim, dtype=F64)[None], [1.0], None, "positive"
    else:
        p, lam_name = 2, "trig"
        M = torch.randn(p, dim, dim, dtype=F64, generator=torch.Generator().manual_seed(16))
        widths, names = [0.7, 2.0], ("trig", "positive", "positive")
    names = names or ("positive", "trig")
    base, lam_w = draws(reps, p + 1, m, dim, seed=17), draws(reps, p, n, dim, seed=18)
    est = estimates(
        gaussian_hybrid_features,
        x,
        y,
        base,
        lam_w,
        M,
        torch.tensor(widths, dtype=F64),
        estimators=names,
        lambda_estimator=lam_name,
    )
    z = (est.mean(0) - torch.exp(x @ y.T)) / (est.std(0) / math.sqrt(reps))
    assert z.abs().max() < 4, z


@pytest.mark.parametrize("name", ["hybrid_angular", "hybrid_gaussian"])
def test_map_estimates_target_with_scale(name):
    """Full maps (many features) approach exp(scale · x·y); error falls with num_features."""
    x, y = inputs(4, 4, 6, 2.0, seed=19)
    target = torch.exp(0.25 * x @ y.T)
    errs = []
    for m in (4, 256):
        fmap = create(name, 6, num_features=m, lambda_features=8, scale=0.25, seed=20)
        assert torch.allclose(fmap.target_kernel(x, y), target, rtol=1e-14)
        errs.append(((fmap.approx_kernel(x, y) - target) ** 2).mean().item())
    assert errs[1] < errs[0] / 8 and errs[1] < 1e-2


# ----- errors ---------------------------------------------------------------------------------
def test_bad_input_names_argument():
    with pytest.raises(ValueError, match="lambda_features"):
        AngularHybrid(3, lambda_features=0)
    with pytest.raises(TypeError, match="shared_directions"):
        AngularHybrid(3, shared_directions=1)
    with pytest.raises(ValueError, match="num_features"):
        GaussianHybrid(3, num_features=0)
    with pytest.raises(ValueError, match="M"):
        GaussianHybrid(3, M=torch.eye(4))
    with pytest.raises(ValueError, match="M"):
        GaussianHybrid(3, M=torch.full((3, 3), float("inf")))
    with pytest.raises(ValueError, match="widths"):
        GaussianHybrid(3, widths=-1.0)
    with pytest.raises(ValueError, match="widths"):
        GaussianHybrid(3, M=torch.eye(3).expand(2, 3, 3), widths=[1.0])
    with pytest.raises(ValueError, match="estimators"):
        GaussianHybrid(3, estimators=("positive", "exact"))
    with pytest.raises(ValueError, match="estimators"):
        GaussianHybrid(3, estimators=("positive",))
    with pytest.raises(ValueError, match="lambda_estimator"):
        GaussianHybrid(3, lambda_estimator="sgn")
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    with pytest.raises(ValueError, match="role"):
        angular_hybrid_features(x, w, w, w, "both")
    with pytest.raises(ValueError, match="omega"):
        angular_hybrid_features(x, w, w, torch.randn(4, 2), "query")
    with pytest.raises(ValueError, match="x"):
        AngularHybrid(3).query(torch.randn(2, 4))
