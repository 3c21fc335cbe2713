"""Tests of trigonometric and positive (FAVOR+) random features (HRF Eq. 2, 3, 7)."""

import math

import pytest
import torch

from polysketch.features import create
from polysketch.features.random_features import (
    PositiveRandomFeatures,
    TrigRandomFeatures,
    draw_directions,
    positive_features,
    trig_features,
)

F64 = torch.float64
PURE = {"trig": trig_features, "positive": positive_features}
ALL_MAPS = ["trig", "positive", "complex_exp", "hybrid_angular", "hybrid_gaussian"]


def batched_estimates(fn, x, y, omega):
    """Estimates for R independent draws: omega (R, m, D) -> (R, Tx, Ty)."""
    return fn(x, omega) @ fn(y, omega).transpose(-1, -2)


def draws(reps, m, dim, *, orthogonal=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        draw_directions(reps * m, dim, orthogonal=orthogonal, generator=g)
        .view(reps, m, dim)
        .to(F64)
    )


def inputs(tx, ty, dim, norm, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tx, dim, generator=g, dtype=F64)
    y = torch.randn(ty, dim, generator=g, dtype=F64)
    return norm * x / x.norm(dim=-1, keepdim=True), norm * y / y.norm(dim=-1, keepdim=True)


def lemma_2_2_mse(name, x, y, m):
    """HRF Lemma 2.2 (Eq. 7): closed-form MSE of the trig / positive estimators, (Tx, Ty)."""
    sm = torch.exp(x @ y.T)
    z2 = ((x[:, None] + y[None]) ** 2).sum(-1)
    d2 = ((x[:, None] - y[None]) ** 2).sum(-1)
    if name == "trig":
        return torch.exp(z2) / sm**2 * (1 - torch.exp(-d2)) ** 2 / (2 * m)
    return torch.exp(z2) * sm**2 * (1 - torch.exp(-z2)) ** 2 / (2 * m)


# ----- exact identities ---------------------------------------------------------------------
def test_pure_functions_match_formulas():
    x, y = inputs(3, 4, 5, 0.9)
    omega = draws(1, 6, 5)[0].to(F64)
    proj = x @ omega.T
    trig = trig_features(x, omega)
    ref = torch.exp(0.5 * (x * x).sum(-1, keepdim=True)) / math.sqrt(6)
    ref = torch.cat([torch.sin(proj), torch.cos(proj)], -1) * ref
    assert torch.allclose(trig, ref, rtol=1e-13, atol=0)
    pos = positive_features(x, omega)
    ref = torch.exp(torch.cat([proj, -proj], -1) - 0.5 * (x * x).sum(-1, keepdim=True))
    assert torch.allclose(pos, ref / math.sqrt(12), rtol=1e-13, atol=0)
    # estimator forms: trig = e^{(|x|²+|y|²)/2} mean cos ω·(x−y); positive = ... mean cosh ω·(x+y)
    nx, ny = (x * x).sum(-1)[:, None], (y * y).sum(-1)[None]
    dif = torch.einsum("md,xyd->xym", omega, x[:, None] - y[None])
    tot = torch.einsum("md,xyd->xym", omega, x[:, None] + y[None])
    est_t = torch.exp((nx + ny) / 2) * torch.cos(dif).mean(-1)
    est_p = torch.exp(-(nx + ny) / 2) * torch.cosh(tot).mean(-1)
    assert torch.allclose(trig @ trig_features(y, omega).T, est_t, rtol=1e-12, atol=0)
    assert torch.allclose(pos @ positive_features(y, omega).T, est_p, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["trig", "positive"])
def test_class_matches_pure_function_and_scale(name):
    x, y = inputs(3, 4, 6, 1.5)
    fmap = create(name, 6, num_features=10, seed=3, scale=0.25)
    omega = fmap.omega.to(F64)
    assert torch.allclose(fmap.query(x), PURE[name](0.5 * x, omega), rtol=1e-14, atol=0)
    assert torch.equal(fmap.query(x), fmap.key(x))
    assert fmap.query(x).shape == (3, fmap.feature_dim) and fmap.feature_dim == 20
    assert torch.allclose(fmap.target_kernel(x, y), torch.exp(0.25 * x @ y.T), rtol=1e-14)


@pytest.mark.parametrize("name", ["trig", "positive"])
def test_features_gradcheck(name):
    fmap = create(name, 3, num_features=4, seed=1).to(F64)
    x = (0.5 * torch.randn(2, 3, dtype=F64)).requires_grad_()
    assert torch.autograd.gradcheck(fmap.query, (x,))


# ----- statistics ---------------------------------------------------------------------------
@pytest.mark.parametrize("orthogonal", [False, True])
@pytest.mark.parametrize("name", ["trig", "positive"])
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_unbiased(name, orthogonal, scale):
    reps, m, dim = (1500 if orthogonal else 4000), 4, 4  # orthogonal draws: one QR per block
    x, y = inputs(3, 4, dim, 1.0, seed=1)
    s = math.sqrt(scale)
    est = batched_estimates(PURE[name], s * x, s * y, draws(reps, m, dim, orthogonal=orthogonal))
    target = torch.exp(scale * x @ y.T)
    z = (est.mean(0) - target) / (est.std(0) / math.sqrt(reps))
    assert z.abs().max() < 4, z


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("name", ["trig", "positive"])
def test_mse_matches_lemma_2_2(name, m):
    reps, dim = 20000, 3
    x, y = inputs(2, 3, dim, 0.6, seed=2)
    est = batched_estimates(PURE[name], x, y, draws(reps, m, dim, seed=4).to(F64))
    sq_err = (est - torch.exp(x @ y.T)) ** 2
    mse_theory = lemma_2_2_mse(name, x, y, m)
    se = sq_err.std(0) / math.sqrt(reps)
    assert ((sq_err.mean(0) - mse_theory).abs() / se).max() < 4
    assert (sq_err.mean(0) / mse_theory - 1).abs().max() < 0.15


@pytest.mark.parametrize("name", ["trig", "positive"])
def test_orthogonal_variance_not_larger(name):
    reps, dim = 1000, 8
    x, y = inputs(3, 3, dim, 0.6, seed=5)
    var = {}
    for orth in (False, True):
        est = batched_estimates(PURE[name], x, y, draws(reps, dim, dim, orthogonal=orth, seed=6))
        var[orth] = ((est - torch.exp(x @ y.T)) ** 2).mean(0)
    assert (var[True] <= 1.1 * var[False]).all(), var[True] / var[False]
    assert var[True].sum() < var[False].sum()


def test_error_falls_with_num_features():
    x, y = inputs(4, 4, 8, 1.0, seed=7)
    target = torch.exp(x @ y.T)
    errs = []
    for m in (8, 512):
        fmap = create("positive", 8, num_features=m, seed=11)
        errs.append(((fmap.approx_kernel(x, y) - target) ** 2).mean().item())
    assert errs[1] < errs[0] / 10


# ----- numerical range ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_positive_features_finite_nonnegative_in_documented_range(dtype):
    dim, m = 64, 256
    fmap = PositiveRandomFeatures(dim, num_features=m, seed=0)
    g = torch.Generator().manual_seed(1)
    directions = torch.randn(64, dim, generator=g)
    directions = torch.cat([directions, fmap.omega, -fmap.omega])  # worst case: u ∥ ±ω_i
    directions = directions / directions.norm(dim=-1, keepdim=True)
    norms = torch.linspace(0, 12, 13)
    x = (norms[:, None, None] * directions[None]).to(dtype)
    phi = fmap.query(x)
    assert phi.dtype == dtype
    assert torch.isfinite(phi).all() and (phi >= 0).all()
    assert (phi.float().amax(-1) > 0).all()  # no row underflows to all zeros


def test_trig_and_positive_low_precision_match_fp32():
    fmap = TrigRandomFeatures(8, num_features=16, seed=0)
    x = torch.randn(5, 8)
    ref = fmap.query(x)
    out = fmap.query(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    # internals are fp32: the only error is the input and output rounding of bf16
    assert (out.float() - ref).abs().max() < 0.05 * ref.abs().max()


# ----- module behaviour ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL_MAPS)
def test_seed_state_dict_redraw_and_dtype(name):
    dim = 5
    a, b = create(name, dim, seed=7), create(name, dim, seed=7)
    c = create(name, dim, seed=8)
    x = torch.randn(3, dim)
    assert torch.equal(a.query(x), b.query(x)) and torch.equal(a.key(x), b.key(x))
    assert not torch.equal(a.query(x), c.query(x))
    g = torch.Generator().manual_seed(7)
    assert torch.equal(create(name, dim, generator=g).query(x), a.query(x))
    c.load_state_dict(a.state_dict())
    assert torch.equal(a.query(x), c.query(x))
    before = {k: v.clone() for k, v in a.state_dict().items()}
    a.redraw_(torch.Generator().manual_seed(99))
    after = a.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(after[k].dtype == before[k].dtype for k in before)
    b.redraw_(torch.Generator().manual_seed(99))
    assert torch.equal(a.query(x), b.query(x))
    torch.manual_seed(123)
    d = create(name, dim)
    torch.manual_seed(123)
    assert torch.equal(d.query(x), create(name, dim).query(x))
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert a.query(x.to(dtype)).dtype == dtype and a.key(x.to(dtype)).dtype == dtype
    assert a.query(x).shape == (3, a.feature_dim) == a.key(x).shape
    a64 = a.to(F64)
    assert all(v.dtype in (F64, torch.int64) for v in a64.state_dict().values())
    x64 = x.to(F64)
    assert a64.query(x64).dtype == F64
    assert a64.approx_kernel(x64, x64).shape == (3, 3)


@pytest.mark.parametrize("name", ALL_MAPS)
def test_features_are_per_token(name):
    """Features of token t do not depend on other tokens (no cross-sequence stabilizer)."""
    fmap = create(name, 4, seed=0)
    x = torch.randn(2, 6, 4)
    y = x.clone()
    y[:, 3:] *= 1e3
    for role in ("query", "key"):  # unchecked: the scaled tokens' features may overflow
        assert torch.equal(fmap.unchecked(role, x)[:, :3], fmap.unchecked(role, y)[:, :3])


def test_bad_input_names_argument():
    with pytest.raises(ValueError, match="num_features"):
        TrigRandomFeatures(4, num_features=0)
    with pytest.raises(TypeError, match="num_features"):
        PositiveRandomFeatures(4, num_features=2.5)
    with pytest.raises(ValueError, match="scale"):
        PositiveRandomFeatures(4, scale=-1.0)
    with pytest.raises(ValueError, match="scale"):
        TrigRandomFeatures(4, scale=float("nan"))
    with pytest.raises(TypeError, match="orthogonal"):
        TrigRandomFeatures(4, orthogonal="yes")
    with pytest.raises(ValueError, match="dim"):
        TrigRandomFeatures(0)
    with pytest.raises(ValueError, match="seed"):
        TrigRandomFeatures(4, seed=-3)
    fmap = PositiveRandomFeatures(4, seed=0)
    with pytest.raises(ValueError, match="x"):
        fmap.query(torch.randn(3, 5))
    with pytest.raises(TypeError, match="x"):
        fmap.key(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="y"):
        fmap.target_kernel(torch.randn(3, 4), torch.randn(3, 2))
    with pytest.raises(ValueError, match="omega"):
        positive_features(torch.randn(3, 4), torch.randn(5, 3))
    with pytest.raises(ValueError, match="omega"):
        trig_features(torch.randn(3, 4), torch.randn(5, 4, dtype=F64))
    with pytest.raises(ValueError, match="num"):
        draw_directions(0, 4, generator=torch.Generator())
    with pytest.raises(TypeError, match="orthogonal"):
        draw_directions(2, 4, orthogonal=1, generator=torch.Generator())
