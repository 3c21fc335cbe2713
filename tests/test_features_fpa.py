"""Factorized Polynomial Attention (FPA) and the TSPOW-as-FPA-heads construction."""

import math
from functools import reduce

import numpy as np
import pytest
import torch
from torch.func import functional_call

from conftest import rel_err
from numerics import gamma
from polysketch.features import available, create
from polysketch.features.exact import SymmetricPower, TensorPower
from polysketch.features.fpa import FactorizedPolynomial, tspow_maps, tspow_weights

F64 = torch.float64


def _pair(dim, tx=5, ty=4, lead=(2,), dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, tx, dim, generator=g, dtype=dtype)
    y = torch.randn(*lead, ty, dim, generator=g, dtype=dtype)
    return x, y


def _reference_kernel(ws, x, y):
    """∏_l (W_l x)·(W_l y) from dense W_l, independent of the module's branch code."""
    return reduce(
        torch.mul, [(x @ w.T.to(x.dtype)) @ (y @ w.T.to(y.dtype)).transpose(-1, -2) for w in ws]
    )


def test_registered_and_defaults():
    assert "fpa" in available()
    m = create("fpa", 6)
    assert type(m) is FactorizedPolynomial and m.kind == "exact"
    assert m.projection == "random" and m.is_random and m.degree == 2
    assert m.branch_dims == [6, 6] and m.feature_dim == 36 and not m.square


@pytest.mark.parametrize("dim", [1, 3, 8])
@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_random_kernel_exact_fp64(dim, degree):
    dims = [1 + (l * 2 + dim) % 4 for l in range(degree)]  # mixed widths, some != D
    m = FactorizedPolynomial(dim, degree=degree, branch_dims=dims, seed=degree)
    x, y = _pair(dim)
    ref = _reference_kernel(m.projections(), x, y)
    assert m.feature_dim == math.prod(dims)
    assert rel_err(m.target_kernel(x, y), ref) < 1e-13
    assert rel_err(m.approx_kernel(x, y), ref) < 1e-12


@pytest.mark.parametrize(
    "projection,dims",
    [
        ("identity", None),
        ("diagonal", None),
        ("block", [2, 3, 2]),
        ("block", None),
        ("coordinate", [4, 1, 3]),
        ("random", [2, 5, 3]),
    ],
)
def test_every_projection_exact(projection, dims):
    m = FactorizedPolynomial(5, degree=3, branch_dims=dims, projection=projection, seed=7)
    x, y = _pair(5)
    ref = _reference_kernel(m.projections(), x, y)
    assert rel_err(m.target_kernel(x, y), ref) < 1e-13
    assert rel_err(m.approx_kernel(x, y), ref) < 1e-12
    # features: numpy kron of the projected vectors, token by token
    phi = m.query(x[0])
    for t in range(x.shape[1]):
        parts = [(w.double() @ x[0, t]).numpy() for w in m.projections()]
        np.testing.assert_allclose(phi[t].numpy(), reduce(np.kron, parts), rtol=1e-13, atol=1e-15)


def test_block_and_coordinate_selections():
    block = FactorizedPolynomial(5, degree=3, branch_dims=[2, 2, 3], projection="block")
    assert [getattr(block, f"index_{l}").tolist() for l in range(3)] == [[0, 1], [2, 3], [4, 0, 1]]
    assert FactorizedPolynomial(7, degree=3, projection="block").branch_dims == [3, 2, 2]
    assert FactorizedPolynomial(2, degree=3, projection="block").branch_dims == [1, 1, 1]
    coord = FactorizedPolynomial(9, degree=2, branch_dims=[4, 6], projection="coordinate", seed=1)
    for l, d in enumerate([4, 6]):
        idx = getattr(coord, f"index_{l}")
        assert idx.dtype == torch.int64 and len(set(idx.tolist())) == d
        assert torch.equal(idx, idx.sort().values) and 0 <= idx.min() and idx.max() < 9
    # disjoint blocks (Table 1 "orthogonal blocks"): k = ∏_l x_{S_l}·y_{S_l}
    x, y = _pair(5)
    m = FactorizedPolynomial(5, degree=2, branch_dims=[2, 3], projection="block")
    direct = (x[..., :2] @ y[..., :2].transpose(-1, -2)) * (
        x[..., 2:] @ y[..., 2:].transpose(-1, -2)
    )
    assert rel_err(m.approx_kernel(x, y), direct) < 1e-13


def test_table1_linear_case():
    x, y = _pair(4)
    lin = FactorizedPolynomial(4, degree=1, projection="identity")
    assert rel_err(lin.approx_kernel(x, y), x @ y.transpose(-1, -2)) < 1e-15
    assert torch.equal(lin.query(x), x)
    m = FactorizedPolynomial(4, degree=1, branch_dims=[3], seed=0)
    (w,) = m.projections()
    w = w.double()
    g = w.T @ w  # G = WᵀW: k = xᵀ G y
    assert rel_err(m.approx_kernel(x, y), x @ g @ y.transpose(-1, -2)) < 1e-13


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_table1_identity_is_tensor_power(degree):
    x, _ = _pair(3)
    tp = TensorPower(3, degree=degree)
    for projection in ("identity", "diagonal"):  # diagonal initializes W_l = I
        m = FactorizedPolynomial(3, degree=degree, projection=projection)
        assert torch.equal(m.query(x), tp.query(x))
        assert torch.equal(m.query(x.float()), tp.query(x.float()))
    assert FactorizedPolynomial(3, degree=2, projection="identity").nonnegative


def test_table1_diagonal_factors():
    m = FactorizedPolynomial(3, degree=2, projection="diagonal")
    g = torch.Generator().manual_seed(5)
    w = [torch.randn(3, generator=g) for _ in range(2)]
    m.diag_0.copy_(w[0])
    m.diag_1.copy_(w[1])
    x, y = _pair(3)
    # G_l = diag(w_l²): k = ∏_l Σ_i w_li² x_i y_i
    direct = reduce(torch.mul, [(x * wl.double() ** 2) @ y.transpose(-1, -2) for wl in w])
    assert rel_err(m.approx_kernel(x, y), direct) < 1e-13


def test_random_projection_is_isotropic_and_kernel_unbiased():
    """E[Wᵀ W] = I for W ~ N(0, 1/d), and E[k_FPA] = (x·y)^n over independent branches."""
    dim, d, n, draws = 3, 2, 2, 3000
    m = FactorizedPolynomial(dim, degree=n, branch_dims=[d] * n, seed=0).double()
    g = torch.Generator().manual_seed(11)
    x, y = _pair(dim, tx=3, ty=3, lead=())
    grams, kernels = [], []
    for _ in range(draws):
        m.redraw_(g)
        w = m.weight_0
        grams.append(w.T @ w)
        kernels.append(m.approx_kernel(x, y))
    grams, kernels = torch.stack(grams), torch.stack(kernels)
    se = grams.std(0) / math.sqrt(draws)
    assert ((grams.mean(0) - torch.eye(dim, dtype=F64)).abs() < 5 * se).all()
    target = (x @ y.T) ** n
    se = kernels.std(0) / math.sqrt(draws)
    assert ((kernels.mean(0) - target).abs() < 5 * se).all()


def test_trainable_parameters_and_gradients():
    m = FactorizedPolynomial(3, degree=2, branch_dims=[2, 3], trainable=True, seed=0).double()
    names = {n for n, _ in m.named_parameters()}
    assert names == {"weight_0", "weight_1"} and not m.is_random
    frozen = FactorizedPolynomial(3, degree=2, branch_dims=[2, 3], seed=0)
    assert not list(frozen.parameters()) and set(frozen.state_dict()) == names
    x = torch.randn(2, 3, dtype=F64, requires_grad=True)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in m.named_parameters()}

    def feats(x, w0, w1):
        return functional_call(m, {"weight_0": w0, "weight_1": w1}, (x,))

    assert torch.autograd.gradcheck(feats, (x, params["weight_0"], params["weight_1"]))
    d = FactorizedPolynomial(3, degree=3, projection="diagonal", trainable=True).double()
    d.diag_1.data.mul_(torch.tensor([0.5, -1.0, 2.0], dtype=F64))

    def dfeats(x, a, b, c):
        return functional_call(d, {"diag_0": a, "diag_1": b, "diag_2": c}, (x,))

    diags = [p.detach().clone().requires_grad_(True) for p in d.parameters()]
    assert torch.autograd.gradcheck(dfeats, (x, *diags))
    # a gradient step changes the kernel
    y = torch.randn(4, 3, dtype=F64)
    before = m.approx_kernel(x, y).detach()
    m.approx_kernel(x, y).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
    m.redraw_(torch.Generator().manual_seed(3))  # trainable: not redrawn
    assert torch.equal(m.approx_kernel(x, y).detach(), before)


def test_dtypes_follow_input():
    m = FactorizedPolynomial(4, degree=3, branch_dims=[2, 3, 4], seed=0)
    x, y = _pair(4)
    for dtype in (torch.float32, torch.float64):
        assert m.query(x.to(dtype)).dtype == dtype
        assert m.target_kernel(x.to(dtype), y.to(dtype)).dtype == dtype
    xb = x.to(torch.bfloat16)
    out = m.query(xb)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, m.query(xb.float()).to(torch.bfloat16))  # fp32 internals
    # 3 branches, each a D = 4 dot product (gamma_4), multiplied together: gamma(3 * 4 + 2)
    assert rel_err(m.query(x.float()).double(), m.query(x)) <= gamma(14, torch.float32)


def test_seed_reproducibility_and_state_dict():
    x, y = _pair(4)
    for projection in ("random", "coordinate"):
        kw = dict(degree=2, branch_dims=[3, 2], projection=projection)
        a = FactorizedPolynomial(4, seed=1, **kw)
        b = FactorizedPolynomial(4, seed=1, **kw)
        c = FactorizedPolynomial(4, seed=2, **kw)
        gen = FactorizedPolynomial(4, generator=torch.Generator().manual_seed(1), **kw)
        assert torch.equal(a.query(x), b.query(x)) and torch.equal(a.query(x), gen.query(x))
        assert not torch.equal(a.query(x), c.query(x))
        c.load_state_dict(a.state_dict())
        assert torch.equal(a.query(x), c.query(x))
        # redraw_ is reproducible from a generator and keeps dtype
        a.double().redraw_(torch.Generator().manual_seed(9))
        b.redraw_(torch.Generator().manual_seed(9))
        assert all(t.dtype in (F64, torch.int64) for t in a.buffers())
        # a float64 map against a float32 one: branches of D = 4 dot products, degree 2
        assert rel_err(a.query(x), b.query(x)) <= gamma(2 * 4 + 2, torch.float32)
        assert not torch.equal(b.query(x), c.query(x))
    torch.manual_seed(123)
    u = FactorizedPolynomial(4)
    torch.manual_seed(123)
    assert torch.equal(u.weight_0, FactorizedPolynomial(4).weight_0)  # global RNG seeds it


def test_module_to_float64():
    m = FactorizedPolynomial(4, degree=2, branch_dims=[3, 2], seed=0).to(F64)
    assert m.weight_0.dtype == F64
    x, y = _pair(4)
    assert m.query(x).dtype == F64
    assert rel_err(m.approx_kernel(x, y), _reference_kernel(m.projections(), x, y)) < 1e-13


def test_user_weights():
    g = torch.Generator().manual_seed(4)
    ws = [torch.randn(2, 3, generator=g, dtype=F64), torch.randn(4, 3, generator=g, dtype=F64)]
    m = FactorizedPolynomial(3, weights=ws)
    assert m.degree == 2 and m.branch_dims == [2, 4] and m.projection == "weights"
    assert m.weight_1.dtype == F64 and not m.is_random
    ws[0].zero_()  # copied, not aliased
    assert m.weight_0.abs().sum() > 0
    x, y = _pair(3)
    assert rel_err(m.approx_kernel(x, y), _reference_kernel(m.projections(), x, y)) < 1e-13
    t = FactorizedPolynomial(3, weights=m.projections(), trainable=True, degree=2)
    assert isinstance(t.weight_0, torch.nn.Parameter)


@pytest.mark.parametrize("square", [False, True])
def test_square(square):
    m = FactorizedPolynomial(3, degree=2, branch_dims=[2, 2], square=square, seed=0)
    x, y = _pair(3)
    k = _reference_kernel(m.projections(), x, y)
    k = k * k if square else k
    assert rel_err(m.target_kernel(x, y), k) < 1e-13
    assert rel_err(m.approx_kernel(x, y), k) < 1e-12
    assert m.nonnegative == square


def test_bad_input():
    m = FactorizedPolynomial(3, seed=0)
    cases = [
        (ValueError, "x", lambda: m.query(torch.randn(2, 4))),
        (ValueError, "y", lambda: m.target_kernel(torch.randn(2, 3), torch.randn(3))),
        (ValueError, "degree", lambda: FactorizedPolynomial(3, degree=0)),
        (TypeError, "degree", lambda: FactorizedPolynomial(3, degree="2")),
        (ValueError, "branch_dims", lambda: FactorizedPolynomial(3, degree=2, branch_dims=[2])),
        (ValueError, "branch_dims", lambda: FactorizedPolynomial(3, branch_dims=[2, 0])),
        (ValueError, "branch_dims", lambda: FactorizedPolynomial(3, branch_dims=-1)),
        (TypeError, "branch_dims", lambda: FactorizedPolynomial(3, branch_dims=[2, 2.5])),
        (TypeError, "branch_dims", lambda: FactorizedPolynomial(3, branch_dims="22")),
        (
            ValueError,
            "branch_dims",
            lambda: FactorizedPolynomial(3, projection="identity", branch_dims=[2, 3]),
        ),
        (
            ValueError,
            "branch_dims",
            lambda: FactorizedPolynomial(3, projection="block", branch_dims=[4, 1]),
        ),
        (ValueError, "branch_dims", lambda: FactorizedPolynomial(512, degree=3)),
        (ValueError, "projection", lambda: FactorizedPolynomial(3, projection="gaussian")),
        (TypeError, "projection", lambda: FactorizedPolynomial(3, projection=1)),
        (ValueError, "weights", lambda: FactorizedPolynomial(3, weights=[torch.randn(2, 4)])),
        (ValueError, "weights", lambda: FactorizedPolynomial(3, weights=[torch.randn(3)])),
        (ValueError, "weights", lambda: FactorizedPolynomial(3, weights=[torch.randn(2, 2, 3)])),
        (ValueError, "weights", lambda: FactorizedPolynomial(3, weights=[])),
        (TypeError, "weights", lambda: FactorizedPolynomial(3, weights=torch.randn(2, 3))),
        (TypeError, "weights", lambda: FactorizedPolynomial(3, weights=[[1.0, 2.0, 3.0]])),
        (
            ValueError,
            "weights",
            lambda: FactorizedPolynomial(3, weights=[torch.randn(2, 3)], projection="random"),
        ),
        (
            ValueError,
            "degree",
            lambda: FactorizedPolynomial(3, weights=[torch.randn(2, 3)], degree=2),
        ),
        (
            ValueError,
            "branch_dims",
            lambda: FactorizedPolynomial(3, weights=[torch.randn(2, 3)], branch_dims=[3]),
        ),
        (TypeError, "trainable", lambda: FactorizedPolynomial(3, trainable=1)),
        (
            ValueError,
            "trainable",
            lambda: FactorizedPolynomial(3, projection="block", trainable=True),
        ),
        (ValueError, "seed", lambda: FactorizedPolynomial(3, seed=-1)),
        (ValueError, "seed", lambda: FactorizedPolynomial(3, seed=1, generator=torch.Generator())),
        (TypeError, "square", lambda: FactorizedPolynomial(3, square=None)),
    ]
    for exc, name, fn in cases:
        with pytest.raises(exc, match=name):
            fn()


# ----- TSPOW as a sum of FPA heads (FPA paper, Appendix) ------------------------------------
@pytest.mark.parametrize("dim", [1, 3, 8])
@pytest.mark.parametrize("block_size", [1, 2, 3])
@pytest.mark.parametrize("compact", [True, False])
def test_tspow_degree2_sums_to_symmetric_power(dim, block_size, compact):
    heads = tspow_maps(dim, block_size=block_size, compact=compact)
    assert len(heads) == math.ceil(dim / block_size)
    assert all(h.degree == 2 and h.kind == "exact" and not h.is_random for h in heads)
    x, y = _pair(dim)
    total = sum(h.approx_kernel(x, y) for h in heads)
    sym = SymmetricPower(dim, degree=2)
    assert rel_err(total, sym.approx_kernel(x, y)) < 1e-12
    assert rel_err(total, sym.target_kernel(x, y)) < 1e-12


def test_tspow_degree2_masks_follow_the_appendix():
    """D = 5, b = 2: head h selects S_h; W^(2)_h = diag(0 before S_h, 1 on S_h, √2 after)."""
    heads = tspow_weights(5, block_size=2, compact=False)
    r2 = math.sqrt(2)
    expected = [[1, 1, r2, r2, r2], [0, 0, 1, 1, r2], [0, 0, 0, 0, 1]]
    blocks = [[0, 1], [2, 3], [4]]
    for (w1, w2), diag, block in zip(heads, expected, blocks, strict=True):
        assert torch.equal(w1, torch.eye(5, dtype=F64)[block])
        assert torch.equal(w2, torch.diag(torch.tensor(diag, dtype=F64)))
    compact = tspow_weights(5, block_size=2)
    assert [w2.shape for _, w2 in compact] == [(5, 5), (3, 5), (1, 5)]


@pytest.mark.parametrize("degree", [3, 4])
@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_tspow_higher_degree(degree, block_size):
    heads = tspow_maps(5, degree=degree, block_size=block_size)
    assert len(heads) == math.comb(math.ceil(5 / block_size) + degree - 2, degree - 1)
    x, y = _pair(5)
    total = sum(h.approx_kernel(x, y) for h in heads)
    assert rel_err(total, SymmetricPower(5, degree=degree).target_kernel(x, y)) < 1e-12


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_tspow_block1_features_are_symmetric_power(degree):
    heads = tspow_maps(4, degree=degree, block_size=1)
    x, _ = _pair(4)
    concat = torch.cat([h.query(x) for h in heads], dim=-1)
    sym = SymmetricPower(4, degree=degree)
    assert sum(h.feature_dim for h in heads) == sym.feature_dim
    assert rel_err(concat, sym.query(x)) < 1e-15


def test_tspow_bad_input():
    with pytest.raises(ValueError, match="degree"):
        tspow_maps(4, degree=1)
    with pytest.raises(ValueError, match="block_size"):
        tspow_maps(4, block_size=0)
    with pytest.raises(ValueError, match="dim"):
        tspow_weights(0)
    with pytest.raises(TypeError, match="compact"):
        tspow_weights(4, compact=1)


# ----- degree inferred from branch_dims (issue #11) ------------------------------------------
@pytest.mark.parametrize("dims", [[4, 4, 4], (3, 5), [6]])
def test_degree_inferred_from_branch_dims(dims):
    fm = create("fpa", 8, branch_dims=dims, seed=0).double()
    assert fm.degree == len(dims) and fm.branch_dims == list(dims)
    assert fm.feature_dim == math.prod(dims)
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    exact = fm.target_kernel(x, y)
    torch.testing.assert_close(fm.approx_kernel(x, y), exact, rtol=1e-10, atol=1e-10)


def test_degree_default_two_for_int_branch_dims():
    fm = create("fpa", 8, branch_dims=4, seed=0)
    assert fm.degree == 2 and fm.branch_dims == [4, 4]


def test_degree_and_branch_dims_mismatch_names_both():
    with pytest.raises(ValueError, match="branch_dims.*degree=2"):
        create("fpa", 8, degree=2, branch_dims=[4, 4, 4], seed=0)
