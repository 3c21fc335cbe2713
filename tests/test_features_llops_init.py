"""The closed-form data-driven LLoPS start (``polysketch.features.llops_init``)."""

import math

import pytest
import torch

from conftest import seeded
from polysketch.eval.fidelity import evaluate_map, rmae
from polysketch.features.llops import LLoPS
from polysketch.features.llops_init import (
    largest_rank,
    low_rank_bilinear,
    monomial_factors,
    principal_directions,
)

F64 = torch.float64


def _subspace_samples(n, dim, rank, seed, basis=None):
    """n vectors of R^dim in a rank-dimensional subspace (the same one for a given basis)."""
    g = seeded(seed)
    if basis is None:
        basis = torch.randn(dim, rank, generator=seeded(99), dtype=F64)
    return torch.randn(n, rank, generator=g, dtype=F64) @ basis.T


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_monomial_factors_give_the_projected_polynomial_kernel(degree):
    d, s = 7, 4
    a = torch.randn(d, s, generator=seeded(1), dtype=F64)
    b = torch.randn(d, s, generator=seeded(2), dtype=F64)
    x = torch.randn(20, d, generator=seeded(3), dtype=F64)
    y = torch.randn(30, d, generator=seeded(4), dtype=F64)
    tq, tk = monomial_factors(a, degree), monomial_factors(b, degree)
    n = math.comb(s + degree - 1, degree)
    assert tq.shape == (degree, d, n)
    fm = LLoPS(d, degree=degree, num_features=n).double().set_factors_(tq, tk)
    expected = ((x @ a) @ (y @ b).T) ** degree
    atol = 1e-12 * float(expected.abs().max())  # cancellation near zero entries
    torch.testing.assert_close(fm.approx_kernel(x, y), expected, rtol=1e-9, atol=atol)


def test_low_rank_bilinear_reaches_the_eckart_young_optimum():
    q = torch.randn(60, 10, generator=seeded(5), dtype=F64)
    k = torch.randn(50, 10, generator=seeded(6), dtype=F64) @ torch.diag(
        torch.linspace(3, 0.1, 10, dtype=F64)
    )
    s = 4
    a, b = low_rank_bilinear(q, k, s)
    assert a.shape == b.shape == (10, s)
    err = torch.linalg.norm(q @ k.T - (q @ a) @ (k @ b).T)
    sigma = torch.linalg.svdvals(q @ k.T)
    torch.testing.assert_close(err, sigma[s:].square().sum().sqrt(), rtol=1e-9, atol=1e-9)


def test_low_rank_bilinear_caps_the_rank_at_the_data_and_rejects_orthogonal_samples():
    q = _subspace_samples(40, 8, 3, seed=1)
    k = _subspace_samples(40, 8, 3, seed=2)
    a, b = low_rank_bilinear(q, k, 6)
    assert a.shape[1] == b.shape[1] == 3
    torch.testing.assert_close((q @ a) @ (k @ b).T, q @ k.T, rtol=1e-9, atol=1e-9)
    e = torch.eye(4, dtype=F64)
    with pytest.raises(ValueError, match="common directions"):
        low_rank_bilinear(e[:2], e[2:], 2)
    with pytest.raises(ValueError, match="k"):
        low_rank_bilinear(q, torch.randn(5, 7, dtype=F64), 2)
    with pytest.raises(ValueError, match="q"):
        low_rank_bilinear(torch.full((3, 8), float("nan")), k, 2)


def test_principal_directions_span_the_samples():
    x = _subspace_samples(50, 9, 3, seed=3)
    u = principal_directions(x, 5)
    assert u.shape == (9, 3)
    torch.testing.assert_close(u.T @ u, torch.eye(3, dtype=F64), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(x @ u @ u.T, x, rtol=1e-9, atol=1e-9)


def test_largest_rank_counts_monomials():
    assert largest_rank(256, 2, 64) == 22  # C(23, 2) = 253 <= 256 < C(24, 2) = 276
    assert largest_rank(256, 3, 64) == 10  # C(12, 3) = 220 <= 256 < 286
    assert largest_rank(256, 4, 64) == 7  # C(10, 4) = 210 <= 256 < 330
    assert largest_rank(64, 2, 64) == 10
    assert largest_rank(1, 3, 64) == 1
    assert largest_rank(10**6, 2, 5) == 5  # capped at the input dimension
    with pytest.raises(ValueError, match="num_features"):
        largest_rank(0, 2, 4)


@pytest.mark.parametrize(
    "degree, num_features, shared, square, rank",
    [
        (2, 64, False, False, 1),
        (3, 64, True, False, 1),
        (2, 40, False, True, 2),
        (4, 256, False, False, 1),
    ],
)
def test_init_from_data_is_exact_on_low_dimensional_samples(
    degree, num_features, shared, square, rank
):
    s = largest_rank(num_features, degree, 12)
    q = _subspace_samples(200, 12, s, seed=7)
    k = _subspace_samples(150, 12, s, seed=8)
    fm = LLoPS(12, degree=degree, num_features=num_features, shared=shared, square=square,
               rank=rank, seed=0).double()  # fmt: skip
    fm.init_from_data_(q, k, spare_scale=0.0)
    exact = fm.target_kernel(q, k)
    rel = torch.linalg.norm(fm.approx_kernel(q, k) - exact) / torch.linalg.norm(exact)
    assert rel < 1e-10


def test_data_start_beats_the_random_start_and_fit_never_ends_worse():
    # anisotropic samples, like trained queries and keys: most energy in a few directions
    scales = torch.logspace(0, -2, 16, dtype=F64)
    q = torch.randn(400, 16, generator=seeded(1), dtype=F64) * scales
    k = torch.randn(400, 16, generator=seeded(2), dtype=F64) * scales
    q_test = torch.randn(200, 16, generator=seeded(3), dtype=F64) * scales
    k_test = torch.randn(200, 16, generator=seeded(4), dtype=F64) * scales
    exact = (q_test @ k_test.T) ** 2

    def test_rmae(fm):
        return rmae(fm.approx_kernel(q_test, k_test).detach(), exact)

    data = LLoPS(16, degree=2, num_features=21, seed=0).double()
    assert data.fit(q, k, steps=0, seed=0) == []
    randomly = LLoPS(16, degree=2, num_features=21, seed=0).double()
    randomly.fit(q, k, steps=200, init="current", seed=0, progress=False)
    assert test_rmae(data) * 5 < test_rmae(randomly)

    check = LLoPS(16, degree=2, num_features=21, seed=0).double()
    check.fit(q, k, steps=0, seed=0)
    before = check._fit_loss(q, k, None)
    history = check.fit(q, k, steps=30, lr=0.5, init="current", seed=0, progress=False)
    assert len(history) == 30
    assert check._fit_loss(q, k, None) <= before  # a too-large lr cannot make it worse


def test_fidelity_measures_the_data_start_alone():
    scales = torch.logspace(0, -2, 8, dtype=F64)
    q = torch.randn(64, 8, generator=seeded(1), dtype=F64) * scales
    k = torch.randn(64, 8, generator=seeded(2), dtype=F64) * scales
    fit = (torch.randn(256, 8, generator=seeded(3), dtype=F64) * scales,
           torch.randn(256, 8, generator=seeded(4), dtype=F64) * scales)  # fmt: skip
    kw = {"degree": 2, "num_features": 15, "trials": 1, "fit_data": fit}
    start = evaluate_map("llops", q, k, fit_init="data", **kw)
    built = evaluate_map("llops", q, k, **kw)
    assert (start["fitted"], start["fit_init"]) == (0, "data")
    assert (built["fitted"], built["fit_init"]) == (0, "")
    assert start["rmae_mean"] * 5 < built["rmae_mean"]
    with pytest.raises(TypeError, match="fit_init"):
        evaluate_map("llops", q, k, fit_init=3, **kw)
    with pytest.raises(ValueError, match="fit_lr"):
        evaluate_map("llops", q, k, fit_steps=1, fit_lr=-1.0, **kw)


def _quadratic_form(fm, d, degree):
    """M with K(x, x) = (xᵀMx)^p for a kernel (xᵀMy)^p with M PSD, by polarization:
    M_ii = K(e_i, e_i)^{1/p}, M_ij = (K(e_i + e_j, e_i + e_j)^{1/p} − M_ii − M_jj) / 2."""
    eye = torch.eye(d, dtype=F64)

    def form(x):
        with torch.no_grad():
            return (fm.query(x) * fm.key(x)).sum(-1).clamp_min(0) ** (1.0 / degree)

    diag = form(eye)
    pairs = form((eye[:, None] + eye[None]).reshape(-1, d)).reshape(d, d)
    m = (pairs - diag[:, None] - diag[None]) / 2
    m.diagonal().copy_(diag)
    return m


@pytest.mark.parametrize("degree, num_features", [(2, 36), (3, 56), (4, 256)])
def test_monomial_init_is_the_polynomial_kernel_of_a_random_projection(degree, num_features):
    """init="monomial": φQ(x)·φK(y) = (xᵀ A Aᵀ y)^p with A (D, s) of rank s = largest_rank,
    up to the spare columns (× 1e-2 per factor); non-negative scores for even p."""
    d = 16
    s = largest_rank(num_features, degree, d)
    fm = LLoPS(d, degree=degree, num_features=num_features, init="monomial", seed=3).double()
    m = _quadratic_form(fm, d, degree)
    eig = torch.linalg.eigvalsh(m)
    assert (eig > -1e-3 * eig.max()).all()  # PSD
    assert int((eig > 1e-3 * eig.max()).sum()) == s  # rank s
    x = torch.randn(40, d, generator=seeded(5), dtype=F64)
    y = torch.randn(50, d, generator=seeded(6), dtype=F64)
    with torch.no_grad():
        got = fm.query(x) @ fm.key(y).T
    expected = (x @ m @ y.T) ** degree
    assert (got - expected).abs().max() <= 1e-3 * expected.abs().max()
    if degree % 2 == 0:
        assert got.min() >= -1e-6 * got.max()


def test_monomial_init_projection_is_unbiased_on_average():
    """A = Gᵀ/√s with G an orthogonal Gaussian draw, so E[AAᵀ] = I: over seeds the recovered
    M averages to the identity (trace D on average, off-diagonals near 0)."""
    d, degree, f = 8, 3, 56
    ms = []
    for seed in range(40):
        fm = LLoPS(d, degree=degree, num_features=f, init="monomial", seed=seed).double()
        e = torch.eye(d, dtype=F64)
        with torch.no_grad():
            k = fm.query(e) @ fm.key(e).T  # M_ij^3 (odd p keeps the sign)
        ms.append(torch.sign(k) * k.abs() ** (1 / 3))
    mean = torch.stack(ms).mean(0)
    assert (mean - torch.eye(d, dtype=F64)).abs().max() < 0.35


def test_monomial_init_gives_a_model_nonnegative_normalizers():
    """Inside KernelAttention (LayerNorm'd q/k, offset 1) the sketch draw at p = 4 leaves
    many normalizers negative; the monomial start none."""
    from polysketch.eval.fidelity.capture import capture_qkv
    from polysketch.nn import TransformerConfig, TransformerLM

    def normalizers(init):
        torch.manual_seed(0)
        maps = {"num_features": 70, "degree": 4, "init": init}
        cfg = TransformerConfig(vocab_size=32, block_size=32, n_layer=1, n_head=2, n_embd=32,
                                attention="llops", chunk_size=8, map_kwargs=maps)  # fmt: skip
        model = TransformerLM(cfg)
        ((q, k, _),) = capture_qkv(model, torch.randint(0, 32, (4, 32), generator=seeded(0)))
        fm = model.blocks[0].attn.feature_map
        with torch.no_grad():
            s = (fm.query(q) @ fm.key(k).transpose(-1, -2)).tril()
        return 1.0 + s.sum(-1)

    assert (normalizers("sketch") < 0).float().mean() > 0.1
    assert (normalizers("monomial") > 0).all()
