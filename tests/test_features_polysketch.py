"""PolySketch (Ahle et al. SRHT/TensorSRHT and Gaussian trees) and the Hadamard helpers."""

import math

import numpy as np
import pytest
import scipy.linalg
import torch

from conftest import rel_err
from polysketch.features import create
from polysketch.features._hadamard import (
    fwht,
    hadamard_columns,
    hadamard_matrix,
    next_power_of_two,
)
from polysketch.features.polysketch import PolySketch
from polysketch.random import make_generator
from sketch_stats import correlated_pairs as _pairs
from sketch_stats import seeded_estimates as _estimates

F64 = torch.float64


def _naive_polysketch(m: PolySketch, x):
    """Def. 2.3–2.4 / Fig. 3 node by node with explicit dense matrices (scipy's Hadamard,
    explicit zero padding, explicit column selection P). x: (N, D) -> (N, r)."""
    r, p = m.num_features, m.degree
    s = 1 / math.sqrt(r)

    def srht(u, signs, cols):  # √(1/r) · pad(u) D H P
        n = len(signs)
        u = torch.cat([u, u.new_zeros(u.shape[0], n - u.shape[1])], -1)
        h = torch.tensor(scipy.linalg.hadamard(n), dtype=F64)
        return s * (u * signs.double()) @ h[:, cols]

    if m.projection == "gaussian":
        leaf = lambda u, k: s * u @ m.leaf_gaussian[k].double()  # noqa: E731
        node = lambda u, k, c: u @ m.node_gaussian[k, c].double()  # noqa: E731
    else:
        leaf = lambda u, k: srht(u, m.leaf_signs[k], m.leaf_columns[k])  # noqa: E731
        node = lambda u, k, c: srht(u, m.node_signs[k, c], m.node_columns[k, c]) / s  # noqa: E731
    e1 = torch.zeros(1, m.dim, dtype=F64)
    e1[0, 0] = 1
    level = [leaf(x if k < p else e1, k).expand(x.shape[0], r) for k in range(m.num_leaves)]
    k = 0
    while len(level) > 1:
        nxt = []
        for j in range(len(level) // 2):
            nxt.append(s * node(level[2 * j], k, 0) * node(level[2 * j + 1], k, 1))
            k += 1
        level = nxt
    return level[0]


# ----- Hadamard helpers ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_fwht_and_hadamard_match_scipy(n):
    h = torch.tensor(scipy.linalg.hadamard(n), dtype=F64)
    x = torch.randn(3, 2, n, dtype=F64, requires_grad=True)
    assert rel_err(fwht(x), x @ h) < 1e-14
    g = torch.randn(3, 2, n, dtype=F64)
    (gf,) = torch.autograd.grad(fwht(x), x, g)
    assert rel_err(gf, g @ h.T) < 1e-14
    assert torch.equal(hadamard_matrix(n, dtype=F64), h)
    cols = torch.randint(0, n, (2, 5))
    assert torch.equal(hadamard_columns(n, cols, dtype=F64), h[:, cols].permute(1, 0, 2))


def test_hadamard_helpers_bad_input():
    assert [next_power_of_two(k) for k in (1, 2, 3, 6, 64, 65)] == [1, 2, 4, 8, 64, 128]
    with pytest.raises(ValueError, match="power of two"):
        fwht(torch.randn(2, 6))
    with pytest.raises(ValueError, match="n must be a power of two"):
        hadamard_matrix(12)


# ----- PolySketch: definition ---------------------------------------------------------------
@pytest.mark.parametrize("projection", ["gaussian", "srht"])
@pytest.mark.parametrize("dim,degree,r", [(6, 1, 8), (6, 2, 8), (12, 3, 12), (8, 4, 8), (5, 5, 6)])
def test_polysketch_equals_naive_definition_outputs_and_gradients(projection, dim, degree, r):
    m = PolySketch(dim, degree=degree, num_features=r, projection=projection, seed=4)
    x = torch.randn(7, dim, dtype=F64, requires_grad=True)
    fast, naive = m.query(x), _naive_polysketch(m, x)
    assert fast.shape == (7, r)
    assert rel_err(fast, naive) < 1e-12
    g = torch.randn_like(fast)
    (gf,) = torch.autograd.grad(fast, x, g)
    (gn,) = torch.autograd.grad(naive, x, g)
    assert rel_err(gf, gn) < 1e-12


def test_srht_leaf_equals_fwht_reference():
    """The sampled-column matmul equals the fast transform followed by sampling (Def. 2.3)."""
    m = PolySketch(12, degree=1, num_features=10, projection="srht", seed=3)
    x = torch.randn(4, 12, dtype=F64)
    padded = torch.cat([x, x.new_zeros(4, 4)], -1) * m.leaf_signs[0].double()
    ref = fwht(padded)[:, m.leaf_columns[0]] / math.sqrt(10)
    assert rel_err(m.query(x), ref) < 1e-14


# ----- PolySketch: statistics ---------------------------------------------------------------
@pytest.mark.parametrize("projection", ["gaussian", "srht"])
@pytest.mark.parametrize("dim,degree", [(6, 1), (6, 2), (6, 3), (6, 4), (12, 2), (12, 3)])
def test_polysketch_unbiased(projection, dim, degree):
    """Mean of φ(x)·φ(y) over 1000 draws within 4 SE of (x·y)^p, non-power-of-two D."""
    x, y = _pairs(dim, mix=0.95)
    r, draws = (16 if degree <= 2 else 32), 1000
    est = _estimates(
        lambda s: PolySketch(dim, degree=degree, num_features=r, projection=projection, seed=s),
        x,
        y,
        draws,
    )
    target = PolySketch(dim, degree=degree, seed=0).target_kernel(x, y)
    assert torch.allclose(target, (x @ y.T) ** degree, rtol=1e-14, atol=0)
    se = est.std(0) / math.sqrt(draws)
    assert ((est.mean(0) - target).abs() <= 4 * se).all(), (est.mean(0) - target) / se
    # resolving power: a bias of 25% on the correlated pairs would be detected
    assert (4 * se.diagonal() < 0.25 * target.diagonal().abs()).all()


@pytest.mark.parametrize("projection", ["gaussian", "srht"])
def test_polysketch_error_falls_as_one_over_r(projection):
    """MSE of the degree-2 estimate ∝ 1/r: fitted slope of log MSE vs log r in [-1.3, -0.7]."""
    x, y = _pairs(16, n=4)
    target = (x @ y.T) ** 2
    rs = [16, 32, 64, 128]
    mse = []
    for r in rs:
        est = _estimates(
            lambda s, r=r: PolySketch(16, num_features=r, projection=projection, seed=s), x, y, 300
        )
        mse.append(float(((est - target) ** 2).mean()))
    slope = np.polyfit(np.log(rs), np.log(mse), 1)[0]
    assert -1.3 <= slope <= -0.7, (slope, mse)


def test_nonnegative_self_tensoring_is_nonnegative_and_biased_upward():
    """§2.1 / Thm 2.5: (φx·φy)² >= 0 estimates (x·y)^{2p}, biased upward by Var[φx·φy]."""
    x, y = _pairs(6)
    x = torch.cat([x, -y[:1]])  # include a negative dot product
    draws, r = 1000, 16
    plain = _estimates(lambda s: PolySketch(6, num_features=r, seed=s), x, y, draws)
    squared = _estimates(
        lambda s: PolySketch(6, num_features=r, nonnegative=True, seed=s), x, y, draws
    )
    assert torch.equal(squared, plain**2)  # same draws; the square is the self-tensoring
    assert (squared >= 0).all() and (plain < 0).any()
    m = PolySketch(6, num_features=r, nonnegative=True, seed=0)
    assert m.square and m.nonnegative and m.kind == "approximate"
    assert m.state_dim == r * (r // 2 + 1)  # the pair layout of ops.pairs
    target = m.target_kernel(x, y)
    assert torch.allclose(target, (x @ y.T) ** 4, rtol=1e-14, atol=0)
    bias = squared.mean(0) - target
    se = squared.std(0) / math.sqrt(draws)
    # E[(φx·φy)²] = (x·y)^4 + Var: NOT exactly (x·y)^4, the excess is the variance
    assert (bias > 4 * se).all()
    assert rel_err(bias, plain.var(0)) < 0.2
    # ... and the bias shrinks with r (≈ 1/r)
    big = _estimates(
        lambda s: PolySketch(6, num_features=8 * r, nonnegative=True, seed=s), x, y, 300
    )
    assert ((big.mean(0) - target).abs().max() < 0.4 * bias.max()).item()


# ----- PolySketch: contract -----------------------------------------------------------------
def test_polysketch_registry_defaults_and_tree():
    m = create("polysketch", 6)
    assert isinstance(m, PolySketch)
    assert (m.degree, m.num_features, m.projection, m.kind) == (2, 32, "gaussian", "unbiased")
    assert m.is_random and not m.square and not m.nonnegative
    x = torch.randn(2, 3, 5, 6)
    assert m.query(x).shape == (2, 3, 5, 32) and m.state_dim == 32
    assert torch.equal(m.query(x), m.key(x))
    s = PolySketch(12, degree=3, num_features=24, projection="srht", seed=0)
    assert [tuple(lv) for lv in s.sketch_tree] == [
        ("leaf", 4, 12, 16, 24),
        ("node", 2, 24, 32, 24),
        ("node", 1, 24, 32, 24),
    ]
    assert "leaf×4: 12(pad 16)->24" in repr(s) and "node×1" in repr(s)
    assert s.leaf_signs.shape == (4, 16) and s.node_columns.shape == (3, 2, 24)
    assert PolySketch(6, degree=1, seed=0).sketch_tree[0].nodes == 1


@pytest.mark.parametrize("projection", ["gaussian", "srht"])
def test_polysketch_seed_state_dict_redraw_and_dtypes(projection):
    kw = dict(degree=3, num_features=12, projection=projection)
    x = torch.randn(4, 6)
    a = PolySketch(6, seed=5, **kw)
    assert torch.equal(a.query(x), PolySketch(6, seed=5, **kw).query(x))
    b = PolySketch(6, seed=6, **kw)
    assert not torch.equal(a.query(x), b.query(x))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.query(x), b.query(x))
    before = a.query(x)
    a.redraw_(make_generator(11))
    first = a.query(x)
    assert not torch.equal(before, first)
    a.redraw_(make_generator(11))
    assert torch.equal(first, a.query(x))
    assert torch.equal(first, PolySketch(6, generator=make_generator(11), **kw).query(x))
    # dtype follows the input; .to(float64) casts the float buffers only
    ref = a.query(x.double())
    assert ref.dtype == F64
    out = a.query(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert rel_err(out.double(), a.query(x.bfloat16().double())) < 2e-2
    a64 = PolySketch(6, seed=5, **kw).to(F64)
    a64.redraw_(make_generator(11))
    assert (
        all(t.dtype in (F64, torch.int64) for t in a64.buffers())
        and rel_err(a64.query(x.double()), ref) < 1e-15
    )


@pytest.mark.parametrize("projection", ["gaussian", "srht"])
def test_polysketch_gradcheck(projection):
    m = PolySketch(3, degree=3, num_features=4, projection=projection, seed=1)
    x = torch.randn(2, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(m.query, (x,))


def test_polysketch_bad_input():
    with pytest.raises(ValueError, match="degree"):
        PolySketch(4, degree=0)
    with pytest.raises(ValueError, match="num_features"):
        PolySketch(4, num_features=0)
    with pytest.raises(ValueError, match="projection"):
        PolySketch(4, projection="fourier")
    with pytest.raises(TypeError, match="nonnegative"):
        PolySketch(4, nonnegative=1)
    with pytest.raises(ValueError, match="x"):
        PolySketch(4, seed=0).query(torch.randn(2, 5))
    with pytest.raises(ValueError, match="y"):
        PolySketch(4, seed=0).target_kernel(torch.randn(2, 4), torch.randn(2, 3))
    with pytest.raises(ValueError, match="seed"):
        PolySketch(4, seed=-1)
