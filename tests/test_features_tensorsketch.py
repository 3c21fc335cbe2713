"""Count Sketch and TensorSketch: definitions, unbiasedness, variance bound, contract."""

import itertools
import math

import numpy as np
import pytest
import torch

from conftest import rel_err
from polysketch.features import create
from polysketch.features.tensorsketch import CountSketch, TensorSketch, count_sketch
from polysketch.random import make_generator
from sketch_stats import correlated_pairs as _pairs
from sketch_stats import seeded_estimates as _estimates

F64 = torch.float64


def _dense_count_sketch(hashes, signs, num_features):
    """Naive sketch matrix M (D, F) with M[i, h(i)] = s(i), built element by element."""
    m = torch.zeros(len(hashes), num_features, dtype=F64)
    for i, (h, s) in enumerate(zip(hashes.tolist(), signs.tolist(), strict=True)):
        m[i, h] = s
    return m


def _naive_tensorsketch(ts: TensorSketch, x):
    """Count Sketch of the explicit tensor power x̃^{⊗p} under H = Σ_l h_l(i_l) mod F,
    S = ∏_l s_l(i_l) (tensorsketch.md, composite hash); no FFT. x: (N, D) -> (N, F)."""
    if ts.coef0 > 0:
        x = torch.cat([x, torch.full((x.shape[0], 1), math.sqrt(ts.coef0), dtype=x.dtype)], -1)
    d, p, f = x.shape[-1], ts.degree, ts.num_features
    h, s = ts.hashes[:, :d].tolist(), ts.signs[:, :d].tolist()
    m = torch.zeros(d**p, f, dtype=F64)
    for flat, idx in enumerate(itertools.product(range(d), repeat=p)):
        bucket = sum(h[lv][i] for lv, i in enumerate(idx)) % f
        m[flat, bucket] += math.prod(s[lv][i] for lv, i in enumerate(idx))
    power = x
    for _ in range(p - 1):
        power = (power.unsqueeze(-1) * x.unsqueeze(-2)).reshape(x.shape[0], -1)
    return power @ m


# ----- Count Sketch ---------------------------------------------------------------------------
def test_count_sketch_equals_dense_definition_outputs_and_gradients():
    cs = CountSketch(10, 7, seed=3)
    x = torch.randn(4, 5, 10, dtype=F64, requires_grad=True)
    m = _dense_count_sketch(cs.hashes, cs.signs, 7)
    fast, naive = cs(x), x @ m
    assert rel_err(fast, naive) < 1e-14
    g = torch.randn_like(fast)
    (gf,) = torch.autograd.grad(fast, x, g)
    (gn,) = torch.autograd.grad(naive, x, g)
    assert rel_err(gf, gn) < 1e-14


def test_count_sketch_stacked_equals_separate_sketches():
    g = make_generator(1)
    hashes = torch.randint(0, 9, (3, 6), generator=g)
    signs = (2 * torch.randint(0, 2, (3, 6), generator=g) - 1).double()
    x = torch.randn(2, 4, 6, dtype=F64)
    out = count_sketch(x, hashes, signs, 9)
    assert out.shape == (2, 4, 3, 9)
    for k in range(3):
        assert rel_err(out[..., k, :], x @ _dense_count_sketch(hashes[k], signs[k], 9)) < 1e-14


def test_count_sketch_unbiased_and_variance_bound():
    x, y = _pairs(8)
    est = torch.stack(
        [
            (CountSketch(8, 16, seed=s)(x) * CountSketch(8, 16, seed=s)(y)).sum(-1)
            for s in range(1500)
        ]
    )
    target = (x * y).sum(-1)
    se = est.std(0) / math.sqrt(len(est))
    assert ((est.mean(0) - target).abs() <= 4 * se).all()
    assert (est.var(0) <= 2 / 16 * (x.norm(dim=-1) * y.norm(dim=-1)) ** 2).all()


def test_count_sketch_module_contract():
    cs = CountSketch(5, 4, seed=0)
    assert cs.hashes.dtype == torch.int64 and cs.signs.dtype == torch.float32
    assert set(cs.signs.tolist()) <= {-1.0, 1.0} and int(cs.hashes.max()) < 4
    x = torch.randn(3, 5)
    before = cs(x)
    cs.redraw_(make_generator(9))
    assert not torch.equal(before, cs(x))
    assert torch.equal(cs(x), CountSketch(5, 4, seed=9)(x))
    other = CountSketch(5, 4, seed=1)
    other.load_state_dict(cs.state_dict())
    assert torch.equal(other(x), cs(x))
    assert cs(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="num_features"):
        CountSketch(5, 0)
    with pytest.raises(ValueError, match="x"):
        cs(torch.randn(3, 6))


# ----- TensorSketch: definition and statistics -----------------------------------------------
@pytest.mark.parametrize("degree,coef0", [(1, 0.0), (2, 0.0), (3, 0.0), (2, 0.7), (3, 0.5)])
def test_tensorsketch_equals_naive_definition_outputs_and_gradients(degree, coef0):
    ts = TensorSketch(4, degree=degree, num_features=11, coef0=coef0, seed=2)
    x = torch.randn(5, 4, dtype=F64, requires_grad=True)
    fast, naive = ts.query(x), _naive_tensorsketch(ts, x)
    assert rel_err(fast, naive) < 1e-12
    g = torch.randn_like(fast)
    (gf,) = torch.autograd.grad(fast, x, g)
    (gn,) = torch.autograd.grad(naive, x, g)
    assert rel_err(gf, gn) < 1e-12


@pytest.mark.parametrize("coef0", [0.0, 0.5])
@pytest.mark.parametrize("degree", [1, 2, 3])
def test_tensorsketch_unbiased_and_within_variance_bound(degree, coef0):
    """Mean over 1000 draws within 4 SE of (c + x·y)^p; variance <= (3^p − 1)/F ‖x̃‖^{2p}‖ỹ‖^{2p}."""
    x, y = _pairs(6)
    f, draws = 32, 1000
    est = _estimates(
        lambda s: TensorSketch(6, degree=degree, num_features=f, coef0=coef0, seed=s), x, y, draws
    )
    target = TensorSketch(6, degree=degree, coef0=coef0, seed=0).target_kernel(x, y)
    assert torch.allclose(target, (coef0 + x @ y.T) ** degree, rtol=1e-14, atol=0)
    se = est.std(0) / math.sqrt(draws)
    assert ((est.mean(0) - target).abs() <= 4 * se).all()
    # the test resolves a bias of 10% on the correlated pairs
    assert (4 * se.diagonal() < 0.1 * target.diagonal().abs()).all()
    nx2 = (x * x).sum(-1) + coef0
    ny2 = (y * y).sum(-1) + coef0
    bound = (3**degree - 1) / f * (nx2[:, None] * ny2[None, :]) ** degree
    assert (est.var(0) <= bound).all()


def test_tensorsketch_error_falls_as_one_over_f():
    """MSE ∝ 1/F: fitted slope of log MSE vs log F in [-1.3, -0.7]."""
    x, y = _pairs(8, n=4)
    target = (x @ y.T) ** 2
    fs = [16, 32, 64, 128, 256]
    mse = []
    for f in fs:
        est = _estimates(lambda s, f=f: TensorSketch(8, num_features=f, seed=s), x, y, 300)
        mse.append(float(((est - target) ** 2).mean()))
    slope = np.polyfit(np.log(fs), np.log(mse), 1)[0]
    assert -1.3 <= slope <= -0.7, (slope, mse)


# ----- TensorSketch: contract ----------------------------------------------------------------
def test_tensorsketch_registry_defaults_and_shapes():
    ts = create("tensorsketch", 6)
    assert isinstance(ts, TensorSketch)
    assert (ts.degree, ts.num_features, ts.coef0, ts.kind) == (2, 256, 0.0, "unbiased")
    assert ts.is_random and not ts.square and not ts.nonnegative
    assert ts.hashes.shape == (2, 7) and ts.hashes.dtype == torch.int64
    x = torch.randn(2, 3, 5, 6)
    assert ts.query(x).shape == (2, 3, 5, 256) and ts.feature_dim == 256 == ts.state_dim
    assert torch.equal(ts.query(x), ts.key(x))
    assert "degree=2" in repr(ts)


def test_tensorsketch_seed_state_dict_and_redraw():
    x = torch.randn(4, 6)
    a = TensorSketch(6, degree=3, num_features=16, seed=5)
    assert torch.equal(a.query(x), TensorSketch(6, degree=3, num_features=16, seed=5).query(x))
    b = TensorSketch(6, degree=3, num_features=16, seed=6)
    assert not torch.equal(a.query(x), b.query(x))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.query(x), b.query(x))
    before = a.query(x)
    a.redraw_(make_generator(11))
    first = a.query(x)
    assert not torch.equal(before, first)
    a.redraw_(make_generator(11))
    assert torch.equal(first, a.query(x))
    fresh = TensorSketch(6, degree=3, num_features=16, generator=make_generator(11))
    assert torch.equal(first, fresh.query(x))


def test_tensorsketch_dtypes():
    ts = TensorSketch(6, degree=2, num_features=16, coef0=1.0, seed=0)
    x = torch.randn(3, 6)
    ref = ts.query(x.double())
    assert ref.dtype == F64
    out = ts.query(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert rel_err(out.double(), ts.query(x.bfloat16().double())) < 2e-2
    ts64 = TensorSketch(6, degree=2, num_features=16, coef0=1.0, seed=0).to(F64)
    assert ts64.signs.dtype == F64 and ts64.hashes.dtype == torch.int64
    assert rel_err(ts64.query(x.double()), ref) < 1e-15


def test_tensorsketch_gradcheck():
    ts = TensorSketch(3, degree=3, num_features=8, coef0=0.5, seed=1)
    x = torch.randn(2, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(ts.query, (x,))


def test_tensorsketch_bad_input():
    with pytest.raises(ValueError, match="degree"):
        TensorSketch(4, degree=0)
    with pytest.raises(ValueError, match="num_features"):
        TensorSketch(4, num_features=0)
    with pytest.raises(ValueError, match="coef0"):
        TensorSketch(4, coef0=-1.0)
    with pytest.raises(TypeError, match="degree"):
        TensorSketch(4, degree=2.5)
    with pytest.raises(ValueError, match="x"):
        TensorSketch(4, seed=0).query(torch.randn(2, 5))
    with pytest.raises(ValueError, match="y"):
        TensorSketch(4, seed=0).target_kernel(torch.randn(2, 4), torch.randn(2, 3))
