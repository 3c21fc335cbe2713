"""LLoPS (llops-learnable-polynomial-sketch.md, Def. 3.3, Eq. 6, 13–17, 20, Thm 3.1)."""

import math

import pytest
import torch

from conftest import rel_err
from numerics import gamma
from polysketch.features import create
from polysketch.features.baselines import ElementwisePower, TaylorFeatures
from polysketch.features.llops import LLoPS, based_factors, optimal_error, relative_loss


def _positive_lowrank(n, d, seed):
    """Unit vectors in the positive span of 3 random positive directions: q·k ∈ [0.8, 1]."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.rand(3, d, generator=g, dtype=torch.float64)
    x = (torch.rand(n, 3, generator=g, dtype=torch.float64) + 0.1) @ basis
    return x / x.norm(dim=-1, keepdim=True)


def _rmae(fmap, q, k):
    """LLoPS Eq. 21: mean |(target − approx) / target|."""
    with torch.no_grad():
        target = fmap.target_kernel(q, k)
        return float(((target - fmap.approx_kernel(q, k)) / target).abs().mean())


# ----- sketch initialisation is an unbiased estimator of (x·y)^p ------------------------------
@pytest.mark.parametrize("degree", [2, 3])
def test_sketch_init_is_unbiased(degree):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    y = torch.randn(3, 4, generator=g, dtype=torch.float64)
    target = (x @ y.T) ** degree
    with torch.no_grad():
        draws = torch.stack(
            [
                LLoPS(4, degree=degree, num_features=8, rank=2, seed=s).double().approx_kernel(x, y)
                for s in range(400)
            ]
        )
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(draws.shape[0])
    assert bool(((mean - target).abs() <= 4 * se).all()), (mean, target, se)
    # the test has power: the standard error is small against the kernel's scale
    assert float(se.max()) < 0.25 * float(target.abs().max())


def test_random_init_is_not_the_sketch():
    """init="random" draws Θ^K independently of Θ^Q, so the kernel is centred at 0."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 4, generator=g, dtype=torch.float64)
    target = float((x @ x.T) ** 2)
    with torch.no_grad():
        draws = torch.stack(
            [
                LLoPS(4, num_features=8, init="random", seed=s).double().approx_kernel(x, x)
                for s in range(400)
            ]
        )
    m = LLoPS(4, init="random", seed=0)
    assert not torch.equal(m.theta_q, m.theta_k)
    assert abs(float(draws.mean())) < 0.2 * target
    m = LLoPS(4, init="sketch", seed=0)
    assert torch.equal(m.theta_q, m.theta_k)


# ----- fit minimises Eq. 6 and lowers the RMAE (Eq. 21) ----------------------------------------
@pytest.mark.parametrize("square", [False, True, "elementwise"])
def test_fit_lowers_rmae(square):
    q, k = _positive_lowrank(128, 12, seed=1), _positive_lowrank(128, 12, seed=2)
    options = {"elementwise_square": True} if square == "elementwise" else {"square": square}
    fmap = LLoPS(12, degree=2, num_features=12, seed=0, **options).double()
    before = _rmae(fmap, q, k)
    history = fmap.fit(q, k, steps=60, lr=2e-2, batch=64, init="current", seed=0, progress=False)
    after = _rmae(fmap, q, k)
    assert len(history) == 60
    assert after * 5 <= before, (before, after)
    assert history[-1] * 10 <= history[0]


def test_fit_respects_theorem_3_1_lower_bound():
    """On generic data no rank-F map beats the truncated SVD; LLoPS stays above the bound."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(40, 5, generator=g, dtype=torch.float64)
    k = torch.randn(40, 5, generator=g, dtype=torch.float64)
    fmap = LLoPS(5, degree=2, num_features=4, seed=0).double()
    history = fmap.fit(q, k, steps=60, lr=3e-2, batch=None, seed=0, progress=False)
    bound = optimal_error(q, k, degree=2, num_features=4)
    with torch.no_grad():
        final = float(relative_loss(fmap.approx_kernel(q, k), (q @ k.T) ** 2))
    assert 0.05 < bound < 1.0
    assert final >= bound - 1e-12
    assert final < history[0]


def test_optimal_error_rank_of_degree_2_kernel():
    """(QKᵀ)^{∘2} for D = 3 has rank dim Sym²(R³) = 6: the bound vanishes at F = 6 only."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(30, 3, generator=g, dtype=torch.float64)
    k = torch.randn(30, 3, generator=g, dtype=torch.float64)
    assert optimal_error(q, k, degree=2, num_features=6) < 1e-20
    assert optimal_error(q, k, degree=2, num_features=5) > 1e-4


def test_fit_is_reproducible_and_progress_flag(capsys):
    q, k = _positive_lowrank(64, 6, seed=1), _positive_lowrank(64, 6, seed=2)
    histories = []
    for _ in range(2):
        fmap = LLoPS(6, num_features=6, seed=0).double()
        histories.append(fmap.fit(q, k, steps=5, batch=16, seed=7, progress=False))
    assert histories[0] == histories[1]
    assert capsys.readouterr().err == ""
    LLoPS(6, seed=0).fit(q.float(), k.float(), steps=2, progress=True)
    assert "fit" in capsys.readouterr().err


def test_fit_accepts_leading_dims_and_explicit_degree():
    q, k = _positive_lowrank(48, 6, seed=1), _positive_lowrank(48, 6, seed=2)
    fmap = LLoPS(6, degree=2, num_features=12, seed=0).double()
    history = fmap.fit(q.reshape(2, 24, 6), k.reshape(4, 12, 6), degree=2, steps=3)
    assert len(history) == 3 and all(math.isfinite(h) for h in history)


# ----- gradients ------------------------------------------------------------------------------
def test_gradcheck_inputs_and_factors():
    fmap = LLoPS(3, degree=3, num_features=4, rank=2, square=True, seed=0).double()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fmap.approx_kernel, (x, y))
    tq = fmap.theta_q.detach().clone().requires_grad_(True)
    tk = fmap.theta_k.detach().clone().requires_grad_(True)

    def kernel(tq, tk):
        return fmap._sketch(x.detach(), tq) @ fmap._sketch(y.detach(), tk).T

    assert torch.autograd.gradcheck(kernel, (tq, tk))
    # the module's own parameters receive the same gradients
    fmap.approx_kernel(x.detach(), y.detach()).sum().backward()
    expected = torch.autograd.grad((kernel(tq, tk) ** 2).sum(), (tq, tk))
    assert rel_err(fmap.theta_q.grad, expected[0]) < 1e-12
    assert rel_err(fmap.theta_k.grad, expected[1]) < 1e-12


# ----- special cases (§3.3) -------------------------------------------------------------------
def test_based_special_case_eq20():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(3, 5, generator=g, dtype=torch.float64)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    y = torch.randn(6, 5, generator=g, dtype=torch.float64)
    fmap = LLoPS(5, degree=2, num_features=9).double().set_factors_(based_factors(w))
    fmap.requires_grad_(False)
    wx = x @ w.T
    psi2 = (wx.unsqueeze(-1) * wx.unsqueeze(-2)).flatten(-2)
    assert rel_err(fmap.query(x), psi2) < 1e-14
    assert rel_err(fmap.approx_kernel(x, y), ((x @ w.T) @ (y @ w.T).T) ** 2) < 1e-13


def test_based_taylor_map_recovered_exactly():
    """Degree-2 LLoPS on [x, 1] with hand-built Θ equals BASED's 1 + s + s²/2 (Eq. 20 + fn. 2)."""
    d = 4
    taylor = TaylorFeatures(d)
    c = math.sqrt(taylor.scale)
    f = 1 + d + d * d
    t1 = torch.zeros(d + 1, f, dtype=torch.float64)
    t2 = torch.zeros(d + 1, f, dtype=torch.float64)
    t1[d, 0] = t2[d, 0] = 1.0  # constant: 1 · 1
    for i in range(d):  # linear: c x_i · 1
        t1[i, 1 + i], t2[d, 1 + i] = c, 1.0
    for a in range(d):  # quadratic: (c x_a)(c x_b)/√2
        for b in range(d):
            col = 1 + d + a * d + b
            t1[a, col], t2[b, col] = c, c / math.sqrt(2.0)
    fmap = LLoPS(d + 1, degree=2, num_features=f).double().set_factors_(torch.stack([t1, t2]))
    fmap.requires_grad_(False)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, d, generator=g, dtype=torch.float64)
    y = torch.randn(2, 3, d, generator=g, dtype=torch.float64)

    def aug(z):
        return torch.cat([z, torch.ones_like(z[..., :1])], dim=-1)

    assert rel_err(fmap.query(aug(x)), taylor.query(x)) < 1e-14
    assert rel_err(fmap.approx_kernel(aug(x), aug(y)), taylor.target_kernel(x, y)) < 1e-13


def test_elementwise_power_special_case():
    """Θ_1 = ... = Θ_p and shared factors give the element-wise power map (§3.3)."""
    ew = ElementwisePower(5, degree=3, num_features=7, seed=0).double().requires_grad_(False)
    fmap = LLoPS(5, degree=3, num_features=7, shared=True).double().requires_grad_(False)
    fmap.set_factors_(ew.theta.detach().T.expand(3, 5, 7))
    x = torch.randn(4, 5, dtype=torch.float64)
    y = torch.randn(6, 5, dtype=torch.float64)
    assert rel_err(fmap.approx_kernel(x, y), ew.target_kernel(x, y)) < 1e-12


# ----- options --------------------------------------------------------------------------------
def test_shared_and_square_options():
    shared = LLoPS(6, num_features=5, shared=True, seed=0)
    assert shared.theta_k is None
    assert sum(p.numel() for p in shared.parameters()) == 2 * 6 * 5
    assert sum(p.numel() for p in LLoPS(6, num_features=5, seed=0).parameters()) == 2 * 2 * 6 * 5
    x = torch.randn(3, 6)
    assert torch.equal(shared.query(x), shared.key(x))

    plain = LLoPS(6, degree=2, num_features=5, seed=0, init="random").double().requires_grad_(False)
    square = LLoPS(6, degree=2, num_features=5, seed=0, init="random", square=True)
    square = square.double().requires_grad_(False)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    assert square.nonnegative and not plain.nonnegative
    assert square.state_dim == 15 and plain.state_dim == 5  # pair layout 5 * (5 // 2 + 1)
    assert square.target_degree == 4
    assert rel_err(square.target_kernel(x, y), (x @ y.T) ** 4) < 1e-15
    assert rel_err(square.approx_kernel(x, y), plain.approx_kernel(x, y) ** 2) < 1e-14
    assert bool((square.approx_kernel(x, y) >= 0).all())
    assert bool((plain.approx_kernel(x, y) < 0).any())


def test_elementwise_square_option():
    """§3.2's non-negative form (∏_j xΘ_j)^{*2}: each feature squared, F state features."""
    plain = LLoPS(6, degree=2, num_features=5, seed=0, init="random").double().requires_grad_(False)
    ew = LLoPS(6, degree=2, num_features=5, seed=0, init="random", elementwise_square=True)
    ew = ew.double().requires_grad_(False)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    assert torch.equal(ew.theta_q, plain.theta_q)
    assert rel_err(ew.query(x), plain.query(x) ** 2) < 1e-15
    assert rel_err(ew.key(y), plain.key(y) ** 2) < 1e-15
    assert ew.nonnegative and not ew.square and ew.state_dim == 5 and ew.target_degree == 4
    assert rel_err(ew.target_kernel(x, y), (x @ y.T) ** 4) < 1e-15
    assert bool((ew.approx_kernel(x, y) >= 0).all())
    assert "elementwise_square=True" in repr(ew)
    with pytest.raises(ValueError, match="square and elementwise_square"):
        LLoPS(6, square=True, elementwise_square=True)
    with pytest.raises(TypeError, match="elementwise_square"):
        LLoPS(6, elementwise_square=1)
    with pytest.raises(ValueError, match="monomial"):
        LLoPS(6, elementwise_square=True, init="monomial")
    with pytest.raises(ValueError, match="elementwise_square"):
        ew.init_from_data_(x, y)
    with pytest.raises(ValueError, match="elementwise_square"):
        ew.fit(x, y, steps=1)  # init="data" is the closed-form start


def test_state_dict_roundtrip_and_seeds():
    a = LLoPS(5, rank=2, degree=3, seed=1)
    b = LLoPS(5, rank=2, degree=3, seed=2)
    x = torch.randn(2, 4, 5)
    assert not torch.equal(a.query(x), b.query(x))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.query(x), b.query(x)) and torch.equal(a.key(x), b.key(x))
    c = create("llops", 5, rank=2, degree=3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(c.theta_q, a.theta_q)
    assert torch.equal(LLoPS(5, seed=3).theta_q, LLoPS(5, seed=3).theta_q)
    assert create("llops", 7).feature_dim == 14 and create("llops", 7).kind == "learned"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_output_dtype_follows_input(dtype):
    fmap = LLoPS(6, num_features=5, seed=0).requires_grad_(False)
    x = torch.randn(2, 3, 6).to(dtype)
    assert fmap.query(x).dtype == dtype and fmap.key(x).dtype == dtype
    assert fmap.approx_kernel(x, x).shape == (2, 3, 3)
    ref = fmap.query(x.double())
    # F = 5 terms, each a product of p = 2 dot products of D = 6: gamma(2 * 6 + 5 + 1); the
    # normwise error stays there unless the terms cancel, as they do not for Gaussian inputs
    tol = 2e-2 if dtype == torch.bfloat16 else gamma(2 * 6 + 5 + 1, dtype)
    assert rel_err(fmap.query(x).double(), ref) <= tol
    assert fmap.double().query(x.double()).dtype == torch.float64


# ----- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"rank": 0}, "rank"),
        ({"degree": 0}, "degree"),
        ({"num_features": 0}, "num_features"),
        ({"init": "zeros"}, "init"),
    ],
)
def test_bad_constructor_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLoPS(4, **kwargs)


def test_bad_inputs_name_the_argument():
    fmap = LLoPS(4, seed=0)
    good = torch.randn(8, 4)
    bad = good.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="x"):
        fmap.query(torch.randn(3, 5))
    with pytest.raises(ValueError, match="q"):
        fmap.fit(bad, good, steps=1)
    with pytest.raises(ValueError, match="k"):
        fmap.fit(good, bad, steps=1)
    with pytest.raises(ValueError, match="q"):
        fmap.fit(torch.randn(8, 3), good, steps=1)
    with pytest.raises(ValueError, match="k"):
        fmap.fit(good, torch.randn(8, 5), steps=1)
    for kwargs, name in [
        ({"steps": -1}, "steps"),
        ({"lr": 0.0}, "lr"),
        ({"batch": 0}, "batch"),
        ({"init": "svd"}, "init"),
    ]:
        with pytest.raises(ValueError, match=name):
            fmap.fit(good, good, **kwargs)
    with pytest.raises(ValueError, match="theta_q"):
        fmap.set_factors_(torch.randn(3, 4, 8))
    with pytest.raises(ValueError, match="degree"):
        optimal_error(good, good, degree=0, num_features=2)


@pytest.mark.parametrize("rank, degree", [(1, 1), (1, 4), (3, 3)])
def test_sketch_matches_a_naive_product_in_outputs_and_gradients(rank, degree):
    """Eq. 15 computed factor by factor (einsum, then torch.prod over j, sum over r) against
    the map's one-matmul, unbind-and-multiply path, forward and backward."""
    fm = LLoPS(5, degree=degree, num_features=7, rank=rank, init="random", seed=3).double()
    x = torch.randn(2, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x_ref = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    theta_ref = fm.theta_k.detach().clone().requires_grad_(True)
    naive = torch.einsum("btd,rjdf->btrjf", x_ref, theta_ref).prod(dim=-2).sum(dim=-2)
    fast = fm.key(x)
    torch.testing.assert_close(fast, naive, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(naive)
    (naive * weights).sum().backward()
    (fast * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fm.theta_k.grad, theta_ref.grad, rtol=1e-10, atol=1e-12)
