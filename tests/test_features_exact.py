"""Exact polynomial maps: tensor_power (x^{⊗p}) and symmetric_power (deduplicated TSPOW)."""

import math
from functools import reduce
from itertools import combinations_with_replacement

import numpy as np
import pytest
import torch

from conftest import rel_err
from numerics import gamma
from polysketch.features import available, create
from polysketch.features.exact import (
    MAX_FEATURES,
    SymmetricPower,
    TensorPower,
    kron_features,
    multiset_table,
)

MAPS = [TensorPower, SymmetricPower]
DIMS = [1, 3, 8]
DEGREES = [1, 2, 3, 4]


def _pair(dim, tx=5, ty=4, lead=(2,), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, tx, dim, generator=g, dtype=dtype)
    y = torch.randn(*lead, ty, dim, generator=g, dtype=dtype)
    return x, y


def _naive_symmetric(x, degree, coef0=0.0):
    """Reference: a Python loop over multisets, sqrt(p!/∏m!) ∏ x_i (one feature each)."""
    if coef0 > 0:
        x = torch.cat([x, torch.full_like(x[..., :1], math.sqrt(coef0))], dim=-1)
    cols = []
    for combo in combinations_with_replacement(range(x.shape[-1]), degree):
        counts = np.bincount(combo)
        coef = math.factorial(degree) / math.prod(math.factorial(int(c)) for c in counts)
        cols.append(math.sqrt(coef) * reduce(lambda a, b: a * b, [x[..., i] for i in combo]))
    return torch.stack(cols, dim=-1)


def test_registered_and_defaults():
    assert {"tensor_power", "symmetric_power"} <= set(available())
    for name, cls in [("tensor_power", TensorPower), ("symmetric_power", SymmetricPower)]:
        m = create(name, 5)
        assert type(m) is cls and m.kind == "exact" and not m.is_random
        assert m.degree == 2 and m.coef0 == 0.0 and not m.square and m.nonnegative
    assert create("tensor_power", 5).feature_dim == 25
    assert create("symmetric_power", 5).feature_dim == 15


@pytest.mark.parametrize("cls", MAPS)
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("degree", DEGREES)
def test_kernel_is_exact_fp64(cls, dim, degree):
    m = cls(dim, degree=degree)
    x, y = _pair(dim)
    direct = (x @ y.transpose(-1, -2)) ** degree  # independent of the module
    assert rel_err(m.target_kernel(x, y), direct) < 1e-14
    assert rel_err(m.approx_kernel(x, y), direct) < 1e-12
    assert m.query(x).shape == (2, 5, m.feature_dim)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("degree", DEGREES)
def test_feature_dim_formulas(dim, degree):
    assert TensorPower(dim, degree=degree).feature_dim == dim**degree
    assert SymmetricPower(dim, degree=degree).feature_dim == math.comb(dim + degree - 1, degree)
    assert TensorPower(dim, degree=degree, coef0=1.0).feature_dim == (dim + 1) ** degree
    sym = SymmetricPower(dim, degree=degree, coef0=1.0)
    assert sym.feature_dim == math.comb(dim + degree, degree)
    x, _ = _pair(dim)
    assert sym.query(x).shape[-1] == sym.feature_dim


@pytest.mark.parametrize("cls", MAPS)
@pytest.mark.parametrize("degree", [1, 2, 3])
@pytest.mark.parametrize("coef0", [0.5, 2.0])
def test_inhomogeneous_kernel(cls, degree, coef0):
    m = cls(3, degree=degree, coef0=coef0)
    x, y = _pair(3)
    direct = (coef0 + x @ y.transpose(-1, -2)) ** degree
    assert rel_err(m.approx_kernel(x, y), direct) < 1e-12
    assert rel_err(m.target_kernel(x, y), direct) < 1e-14


@pytest.mark.parametrize("degree", DEGREES)
def test_tensor_and_symmetric_power_agree(degree):
    x, y = _pair(4)
    kt = TensorPower(4, degree=degree).approx_kernel(x, y)
    ks = SymmetricPower(4, degree=degree).approx_kernel(x, y)
    assert rel_err(ks, kt) < 1e-12
    # same feature norms: ||φ(x)||² = ||x||^{2p}
    nt = TensorPower(4, degree=degree).query(x).norm(dim=-1)
    ns = SymmetricPower(4, degree=degree).query(x).norm(dim=-1)
    assert rel_err(ns, nt) < 1e-13
    assert rel_err(nt, x.norm(dim=-1) ** degree) < 1e-13


@pytest.mark.parametrize("degree", [1, 2, 3])
def test_tensor_power_features_match_numpy_kron(degree):
    x, _ = _pair(3, lead=())
    phi = TensorPower(3, degree=degree).query(x)
    for t in range(x.shape[0]):
        ref = reduce(np.kron, [x[t].numpy()] * degree)
        np.testing.assert_allclose(phi[t].numpy(), ref, rtol=1e-15, atol=0)


def test_explicit_degree2_features():
    f64 = torch.float64
    x = torch.tensor([2.0, 3.0], dtype=f64)
    assert torch.equal(TensorPower(2).query(x), torch.tensor([4.0, 6.0, 6.0, 9.0], dtype=f64))
    sym = SymmetricPower(2).query(x)
    expected = torch.tensor([4.0, 6.0 * math.sqrt(2), 9.0], dtype=f64)
    assert torch.allclose(sym, expected, rtol=1e-15, atol=0)
    inh = SymmetricPower(1, degree=2, coef0=4.0).query(torch.tensor([3.0], dtype=f64))
    expected = torch.tensor([9.0, 6.0 * math.sqrt(2), 4.0], dtype=f64)
    assert torch.allclose(inh, expected, rtol=1e-15, atol=0)


@pytest.mark.parametrize("n,degree", [(1, 3), (3, 1), (4, 2), (5, 3), (3, 4)])
def test_multiset_table(n, degree):
    index, multinomial = multiset_table(n, degree)
    expected = list(combinations_with_replacement(range(n), degree))
    assert index.tolist() == [list(c) for c in expected]  # lexicographic, no duplicates
    for row, coef in zip(index, multinomial, strict=True):
        counts = np.bincount(row)
        assert coef == math.factorial(degree) // math.prod(math.factorial(int(c)) for c in counts)
    assert multinomial.sum() == n**degree  # Σ multinomials = number of ordered tuples


@pytest.mark.parametrize("degree,coef0", [(1, 0.0), (2, 0.0), (3, 0.0), (3, 1.5)])
def test_symmetric_gather_matches_naive_outputs_and_grads(degree, coef0):
    x, _ = _pair(4, tx=3, lead=(2,))
    x1 = x.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    fast = SymmetricPower(4, degree=degree, coef0=coef0).query(x1)
    naive = _naive_symmetric(x2, degree, coef0)
    assert rel_err(fast.detach(), naive.detach()) < 1e-14
    w = torch.randn(fast.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (g1,) = torch.autograd.grad((fast * w).sum(), x1)
    (g2,) = torch.autograd.grad((naive * w).sum(), x2)
    assert rel_err(g1, g2) < 1e-13


@pytest.mark.parametrize("cls", MAPS)
def test_gradcheck(cls):
    m = cls(3, degree=3, coef0=0.7)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(m.query, (x,))
    y = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(m.target_kernel, (x, y))


@pytest.mark.parametrize("cls", MAPS)
@pytest.mark.parametrize("degree", [1, 2])
def test_square(cls, degree):
    m = cls(3, degree=degree, square=True)
    x, y = _pair(3)
    direct = (x @ y.transpose(-1, -2)) ** (2 * degree)
    assert rel_err(m.target_kernel(x, y), direct) < 1e-14
    assert rel_err(m.approx_kernel(x, y), direct) < 1e-12
    f = m.feature_dim  # pair layout: F(F//2 + 1) state features (ops.pairs)
    assert m.state_dim == f * (f // 2 + 1) and m.nonnegative
    assert not cls(3, degree=3).nonnegative


@pytest.mark.parametrize("cls", MAPS)
def test_dtypes_follow_input(cls):
    m = cls(3, degree=3)
    x, y = _pair(3)
    for dtype in (torch.float32, torch.float64):
        assert m.query(x.to(dtype)).dtype == dtype
        assert m.target_kernel(x.to(dtype), y.to(dtype)).dtype == dtype
    xb = x.to(torch.bfloat16)
    out = m.query(xb)
    assert out.dtype == torch.bfloat16
    # computed in fp32 internally, then rounded once
    assert torch.equal(out, m.query(xb.float()).to(torch.bfloat16))
    assert m.target_kernel(xb, y.to(torch.bfloat16)).dtype == torch.bfloat16
    # degree p products of inputs: p - 1 roundings per feature (+1 for a symmetric power's
    # sqrt(multinomial) weight); no sums
    assert rel_err(m.query(x.float()).double(), m.query(x)) <= gamma(m.degree + 1, torch.float32)


@pytest.mark.parametrize("cls", MAPS)
def test_module_to_float64_and_state_dict(cls):
    m = cls(3, degree=3, coef0=0.5).to(torch.float64)
    x, y = _pair(3)
    assert rel_err(m.approx_kernel(x, y), m.target_kernel(x, y)) < 1e-12
    m2 = cls(3, degree=3, coef0=0.5)
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2.query(x), m.query(x))
    assert m.redraw_() is m  # deterministic: no-op
    assert torch.equal(m2.query(x), m.query(x))


def test_symmetric_buffers_are_integer():
    m = SymmetricPower(4, degree=3).to(torch.float16)
    assert m.index.dtype == torch.int64 and m.multinomial.dtype == torch.int64
    x, y = _pair(4)
    assert rel_err(m.approx_kernel(x, y), (x @ y.transpose(-1, -2)) ** 3) < 1e-12


def test_kron_features_inner_product():
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(4, d, generator=g, dtype=torch.float64) for d in (2, 3, 1)]
    b = [torch.randn(4, d, generator=g, dtype=torch.float64) for d in (2, 3, 1)]
    lhs = (kron_features(a) * kron_features(b)).sum(-1)
    rhs = reduce(torch.mul, [(u * v).sum(-1) for u, v in zip(a, b, strict=True)])
    assert kron_features(a).shape == (4, 6)
    assert rel_err(lhs, rhs) < 1e-14


@pytest.mark.parametrize("cls", MAPS)
def test_bad_input(cls):
    m = cls(3)
    with pytest.raises(ValueError, match="x"):
        m.query(torch.randn(2, 4))
    with pytest.raises(TypeError, match="x"):
        m.query(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="x"):
        m.query([[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match="x"):
        m.target_kernel(torch.randn(3), torch.randn(2, 3))
    with pytest.raises(ValueError, match="y"):
        m.target_kernel(torch.randn(2, 3), torch.randn(2, 5))
    with pytest.raises(ValueError, match="degree"):
        cls(3, degree=0)
    with pytest.raises(TypeError, match="degree"):
        cls(3, degree=1.5)
    with pytest.raises(ValueError, match="coef0"):
        cls(3, coef0=-1.0)
    with pytest.raises(TypeError, match="coef0"):
        cls(3, coef0="1")
    with pytest.raises(TypeError, match="square"):
        cls(3, square="yes")
    with pytest.raises(ValueError, match="dim"):
        cls(0)
    with pytest.raises(TypeError):
        cls(3, 2)  # everything after dim is keyword-only


def test_huge_feature_dim_refused():
    with pytest.raises(ValueError, match="degree"):
        TensorPower(64, degree=5)
    with pytest.raises(ValueError, match="degree"):
        SymmetricPower(1000, degree=4)
    assert SymmetricPower(64, degree=4).feature_dim < MAX_FEATURES
