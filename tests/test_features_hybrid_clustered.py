"""Clustering-based hybrid random features (HRF Sec. 2.4, Eq. 21, App. H.2)."""

import io
import math

import pytest
import torch

from conftest import rel_err, seeded
from polysketch.features import create
from polysketch.features.complex_exp import complex_exp_features
from polysketch.features.hybrid_clustered import (
    A_FAMILIES,
    ClusteredHybrid,
    closed_form_A,
    kmeans,
    pair_loss,
    relative_mse_real,
)

F64 = torch.float64


def _blobs(centers, n, sigma, seed):
    g = seeded(seed)
    return torch.cat(
        [c + sigma * torch.randn(n, c.numel(), generator=g, dtype=F64) for c in centers]
    )


def _generic_data(dim=6, n=12, sigma=0.02, seed=0):
    """Two query blobs and three key blobs around random centers of norm ~1."""
    g = seeded(seed)
    cq = 0.4 * torch.randn(2, dim, generator=g, dtype=F64)
    ck = 0.4 * torch.randn(3, dim, generator=g, dtype=F64)
    return _blobs(cq, n, sigma, seed + 1), _blobs(ck, n, sigma, seed + 2)


def _paper_like_data(dim=8, n=20, sigma=0.02, seed=0):
    """App. H.3-style synthetic data: key centers with coordinate signs opposite to the query
    centers' (small Eq. 21 loss for real diagonal A), norms 0.5 (queries) and 1.5 (keys)."""
    g = seeded(seed)
    x = torch.randn(2, dim, generator=g, dtype=F64)
    y = -torch.randn(2, dim, generator=g, dtype=F64).abs() * torch.sign(x.sum(0))
    x = 0.5 * x / x.norm(dim=-1, keepdim=True)
    y = 1.5 * y / y.norm(dim=-1, keepdim=True)
    return _blobs(x, n, sigma, seed + 1), _blobs(y, n, sigma, seed + 2)


def _fitted(family="real_diagonal", clusters=(2, 3), data=None, num_features=4, **kw):
    q, k = _generic_data() if data is None else data
    fmap = ClusteredHybrid(q.shape[-1], num_features=num_features, A_family=family, seed=7, **kw)
    return fmap.to(F64).fit(q, k, clusters=clusters), q, k


def _naive_kernel(fmap, x, y):
    """Σ_ij 1[c(x)=i] 1[c(y)=j] Ψ_{A_ij}(x)ᵀΨ_{A_ij^-T}(y), each pair via complex_exp_features."""
    u, w = fmap.num_clusters
    root = math.sqrt(fmap.scale)
    omega = torch.cat([fmap.omega, -fmap.omega]) if fmap.antithetic else fmap.omega
    cx = torch.cdist(x, fmap.centers_q).argmin(-1)
    cy = torch.cdist(y, fmap.centers_k).argmin(-1)
    out = torch.zeros(x.shape[0], y.shape[0], dtype=x.dtype)
    for i in range(u):
        for j in range(w):
            a = fmap.A_real[i, j]
            if fmap.A_family == "complex_diagonal":
                mat = torch.diag(torch.complex(a, fmap.A_imag[i, j]))
            else:
                mat = torch.diag(a) if fmap.A_family == "real_diagonal" else a
            kij = (
                complex_exp_features(root * x, omega, mat, "query")
                @ complex_exp_features(root * y, omega, mat, "key").T
            )
            mask = (cx == i).to(x.dtype)[:, None] * (cy == j).to(x.dtype)[None, :]
            out = out + mask * kij
    return out


# ----- closed-form A (Eq. 21, App. H.2) -------------------------------------------------------
def test_closed_form_losses_match_theory():
    g = seeded(1)
    cq, ck = torch.randn(3, 7, generator=g, dtype=F64), torch.randn(4, 7, generator=g, dtype=F64)
    prod = cq[:, None, :] * ck[None, :, :]
    loss = pair_loss(*closed_form_A(cq, ck, "real_diagonal"), cq, ck, "real_diagonal")
    assert rel_err(loss, (2 * (prod + prod.abs())).sum(-1)) < 1e-12
    loss = pair_loss(*closed_form_A(cq, ck, "complex_diagonal"), cq, ck, "complex_diagonal")
    assert loss.abs().max() < 1e-20  # Eq. 85-87 zero the loss for nonzero centers
    loss = pair_loss(*closed_form_A(cq, ck, "real"), cq, ck, "real")
    dots = cq @ ck.T
    ok = dots.abs() > 0.1 * cq.norm(dim=-1)[:, None] * ck.norm(dim=-1)  # A's spectrum unclamped
    assert ok.sum() >= 8
    assert (loss - 4 * dots.clamp_min(0))[ok].abs().max() < 1e-9  # global minimum over real A
    assert (loss <= ((cq[:, None] + ck[None]) ** 2).sum(-1)).all()  # never worse than A = I
    assert (cq @ ck.T > 0).any() and (cq @ ck.T < 0).any()  # both regimes exercised


@pytest.mark.parametrize("family", ["real_diagonal", "real"])
def test_closed_form_is_optimal_in_its_family(family):
    g = seeded(2)
    cq, ck = torch.randn(2, 5, generator=g, dtype=F64), torch.randn(2, 5, generator=g, dtype=F64)
    a, _ = closed_form_A(cq, ck, family)
    best = pair_loss(a, None, cq, ck, family)
    assert (best > 0.1).any()  # a nonzero minimum: optimality is not trivial
    for eps in (1e-3, 1e-2, 1e-1):
        for _ in range(20):
            if family == "real_diagonal":
                pert = a * torch.exp(eps * torch.randn(a.shape, generator=g, dtype=F64))
            else:
                pert = a + eps * torch.randn(a.shape, generator=g, dtype=F64)
            assert (pair_loss(pert, None, cq, ck, family) >= best - 1e-12).all()
    ident = (
        torch.ones_like(a) if family == "real_diagonal" else torch.eye(5, dtype=F64).expand_as(a)
    )
    assert (pair_loss(ident, None, cq, ck, family) >= best).all()  # A = I is positive RFs


def test_closed_form_complex_perturbation_increases_loss():
    g = seeded(3)
    cq, ck = torch.randn(2, 5, generator=g, dtype=F64), torch.randn(2, 5, generator=g, dtype=F64)
    re, im = closed_form_A(cq, ck, "complex_diagonal")
    pr = re + 0.01 * torch.randn(re.shape, generator=g, dtype=F64)
    pi = im + 0.01 * torch.randn(im.shape, generator=g, dtype=F64)
    assert (pair_loss(pr, pi, cq, ck, "complex_diagonal") > 1e-8).all()


def test_closed_form_handles_zero_coordinates():
    cq = torch.tensor([[1.0, 0.0, 0.0, 2.0]], dtype=F64)
    ck = torch.tensor([[0.0, 1.0, 0.0, -3.0]], dtype=F64)
    for family in A_FAMILIES:
        a, b = closed_form_A(cq, ck, family)
        assert torch.isfinite(a).all() and (b is None or torch.isfinite(b).all())
        assert torch.isfinite(pair_loss(a, b, cq, ck, family)).all()


# ----- k-means ---------------------------------------------------------------------------------
def test_kmeans_deterministic_and_recovers_blobs():
    truth = torch.tensor([[3.0, 0.0], [0.0, 3.0], [-3.0, -3.0]], dtype=F64)
    x = _blobs(truth, 30, 0.1, 4)
    c1, l1 = kmeans(x, 3, generator=seeded(5))
    c2, l2 = kmeans(x, 3, generator=seeded(5))
    assert torch.equal(c1, c2) and torch.equal(l1, l2)
    dist = torch.cdist(truth, c1).min(-1).values
    assert dist.max() < 0.1  # every true center found
    assert all(len(set(l1[30 * i : 30 * (i + 1)].tolist())) == 1 for i in range(3))


def test_fit_deterministic_under_seed():
    q, k = _generic_data()
    maps = [ClusteredHybrid(6, seed=11).to(F64).fit(q, k, clusters=(2, 3)) for _ in range(2)]
    for name in ("centers_q", "centers_k", "A_real", "omega"):
        assert torch.equal(getattr(maps[0], name), getattr(maps[1], name))
    m3 = ClusteredHybrid(6, seed=0).to(F64).fit(q, k, clusters=(2, 3), seed=3)
    m4 = ClusteredHybrid(6, seed=1).to(F64).fit(q, k, clusters=(2, 3), seed=3)
    assert torch.equal(m3.centers_q, m4.centers_q) and torch.equal(m3.A_real, m4.A_real)


# ----- features ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", A_FAMILIES)
@pytest.mark.parametrize("antithetic", [True, False])
def test_matches_naive_per_pair_reference_values_and_grads(family, antithetic):
    fmap, q, k = _fitted(family, antithetic=antithetic, scale=0.7)
    x, y = q[::3].clone().requires_grad_(), k[::2].clone().requires_grad_()
    fast, naive = fmap.approx_kernel(x, y), _naive_kernel(fmap, x, y)
    assert rel_err(fast.detach(), naive.detach()) < 1e-12
    weights = torch.randn(fast.shape, generator=seeded(9), dtype=F64)
    g_fast = torch.autograd.grad((fast * weights).sum(), (x, y))
    g_naive = torch.autograd.grad((naive * weights).sum(), (x, y))
    for a, b in zip(g_fast, g_naive, strict=True):
        assert rel_err(a, b) < 1e-10


def test_feature_layout_and_sizes():
    fmap, q, k = _fitted("complex_diagonal", clusters=(2, 3), num_features=5)
    assert fmap.feature_dim == 2 * 3 * (2 * 5) * 2
    phi_q, phi_k = fmap.query(q), fmap.key(k)
    assert phi_q.shape == (q.shape[0], fmap.feature_dim) == (q.shape[0], phi_k.shape[-1])
    blocks = phi_q.reshape(-1, 2, 3, 20).abs().sum(-1)  # (N, u, w): one query cluster active
    assert ((blocks > 0).sum((-1, -2)) == 3).all() and ((blocks > 0).sum(-1) > 0).sum(-1).eq(
        1
    ).all()
    real, _, _ = _fitted("real_diagonal")
    assert real.nonnegative and not fmap.nonnegative
    assert (real.query(q) >= 0).all()


@pytest.mark.parametrize("family", A_FAMILIES)
def test_unbiased_for_softmax_kernel(family):
    fmap, q, k = _fitted(family, scale=0.8)
    x, y = q[::4], k[::4]
    exact = fmap.target_kernel(x, y)
    assert rel_err(exact, torch.exp(0.8 * x @ y.T)) < 1e-15
    draws = []
    for t in range(200):
        fmap.redraw_(seeded(100 + t))
        draws.append(fmap.approx_kernel(x, y))
    draws = torch.stack(draws)
    z = (draws.mean(0) - exact) / (draws.std(0) / math.sqrt(draws.shape[0]))
    assert z.abs().max() < 4.5, z.abs().max()


def test_mse_formula_and_lower_than_positive_on_clustered_data():
    """Paper-like clustered data (App. H.1/H.3): real diagonal A, equal feature_dim."""
    q, k = _paper_like_data()
    fmap = ClusteredHybrid(8, num_features=4, seed=1).to(F64).fit(q, k, clusters=2)
    pos = create("positive", 8, num_features=fmap.feature_dim // 2, seed=2).to(F64)
    assert pos.feature_dim == fmap.feature_dim == 32
    exact = fmap.target_kernel(q, k)

    def empirical(m, trials=200):
        est = []
        for t in range(trials):
            m.redraw_(seeded(1000 + t))
            est.append(m.approx_kernel(q, k))
        return ((torch.stack(est) - exact) ** 2).mean(0) / exact**2

    cx = torch.cdist(q, fmap.centers_q).argmin(-1)
    cy = torch.cdist(k, fmap.centers_k).argmin(-1)
    a = fmap.A_real[cx][:, cy]  # (Nq, Nk, D)
    loss = ((a * q[:, None] + k[None] / a) ** 2).sum(-1)  # Eq. 21 at each (x, y)
    theory_c = relative_mse_real(loss, 4).mean()
    theory_p = relative_mse_real(((q[:, None] + k[None]) ** 2).sum(-1), pos.num_features).mean()
    emp_c, emp_p = empirical(fmap).mean(), empirical(pos).mean()
    assert abs(emp_c / theory_c - 1) < 0.3 and abs(emp_p / theory_p - 1) < 0.3
    assert theory_c < theory_p / 5 and emp_c < emp_p / 5  # measured: ~12x lower


def test_complex_diagonal_beats_positive_on_generic_clusters():
    (fmap, q, k) = _fitted("complex_diagonal", clusters=(2, 3), num_features=4)
    pos = create("positive", 6, num_features=fmap.feature_dim // 2, seed=2).to(F64)
    exact = fmap.target_kernel(q, k)
    mse = []
    for m in (fmap, pos):
        est = []
        for t in range(100):
            m.redraw_(seeded(t))
            est.append(m.approx_kernel(q, k))
        mse.append(((torch.stack(est) - exact) ** 2).mean())
    assert mse[0] < mse[1] / 10


# ----- state, dtypes, errors -----------------------------------------------------------------
def test_state_dict_round_trip_after_fit():
    fmap, q, k = _fitted("complex_diagonal", clusters=(3, 2))
    buffer = io.BytesIO()
    torch.save(fmap.state_dict(), buffer)
    buffer.seek(0)
    fresh = ClusteredHybrid(6, num_features=4, A_family="complex_diagonal", seed=99).to(F64)
    fresh.load_state_dict(torch.load(buffer))
    assert fresh.num_clusters == (3, 2) and fresh.feature_dim == fmap.feature_dim
    assert torch.equal(fresh.query(q), fmap.query(q)) and torch.equal(fresh.key(k), fmap.key(k))
    assert {"centers_q", "centers_k", "A_real", "A_imag", "omega"} <= set(fmap.state_dict())


def test_dtypes_and_module_to():
    fmap, q, k = _fitted()
    f32 = ClusteredHybrid(6, num_features=4, seed=7).fit(q.float(), k.float(), clusters=(2, 3))
    assert f32.query(q.float()).dtype == torch.float32
    assert f32.key(k.to(torch.bfloat16)).dtype == torch.bfloat16
    assert (
        rel_err(f32.approx_kernel(q.float(), k.float()).double(), fmap.approx_kernel(q, k)) < 1e-4
    )
    assert fmap.A_real.dtype == F64 and fmap.query(q).dtype == F64


def test_errors_before_fit_and_on_bad_input():
    fmap = ClusteredHybrid(4, seed=0)
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"call fit\(q, k\) first"):
        fmap.query(x)
    with pytest.raises(RuntimeError, match=r"call fit\(q, k\) first"):
        fmap.key(x)
    with pytest.raises(ValueError, match="num_features"):
        ClusteredHybrid(4, num_features=0)
    with pytest.raises(ValueError, match="A_family"):
        ClusteredHybrid(4, A_family="complex")
    with pytest.raises(ValueError, match="clusters"):
        ClusteredHybrid(4, clusters=0)
    with pytest.raises(ValueError, match="clusters"):
        ClusteredHybrid(4, clusters=(1, 2, 3))
    with pytest.raises(ValueError, match="scale"):
        ClusteredHybrid(4, scale=0.0)
    with pytest.raises(ValueError, match="dim"):
        ClusteredHybrid(0)
    with pytest.raises(ValueError, match="q"):
        fmap.fit(torch.randn(5, 3), torch.randn(5, 4))
    with pytest.raises(ValueError, match="k"):
        fmap.fit(torch.randn(5, 4), torch.full((5, 4), float("nan")))
    with pytest.raises(ValueError, match="clusters"):
        fmap.fit(torch.randn(5, 4), torch.randn(5, 4), clusters=6)
    with pytest.raises(ValueError, match="steps"):
        fmap.fit(torch.randn(5, 4), torch.randn(5, 4), steps=0)
    fmap.fit(torch.randn(5, 4), torch.randn(5, 4))
    with pytest.raises(ValueError, match="x"):
        fmap.query(torch.randn(3, 5))


def test_registered_with_defaults_and_subsampled_fit():
    fmap = create("hybrid_clustered", 5)
    assert fmap.kind == "unbiased" and fmap.is_random and fmap.feature_dim == 2 * 2 * 32
    q, k = torch.randn(2, 50, 5), torch.randn(2, 40, 5)  # leading dims are flattened
    fmap.fit(q, k, max_samples=16)
    assert fmap.query(q).shape == (2, 50, fmap.feature_dim)
    assert "clusters=(2, 2)" in repr(fmap)
