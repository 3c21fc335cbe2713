"""Tests of complex exponential random features (HRF Eq. 14–18)."""

import math

import pytest
import torch

from polysketch.features import create
from polysketch.features.complex_exp import (
    ComplexExpRandomFeatures,
    complex_exp_features,
    key_matrix,
)
from polysketch.features.random_features import draw_directions

F64 = torch.float64


def inputs(tx, ty, dim, norm, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tx, dim, generator=g, dtype=F64)
    y = torch.randn(ty, dim, generator=g, dtype=F64)
    return norm * x / x.norm(dim=-1, keepdim=True), norm * y / y.norm(dim=-1, keepdim=True)


def random_A(dim, *, complex_, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.eye(dim, dtype=F64) + 0.4 * torch.randn(dim, dim, generator=g, dtype=F64) / dim**0.5
    if complex_:
        A = A + 0.4j * torch.randn(dim, dim, generator=g, dtype=F64) / dim**0.5
    return A


def complex_reference(x, y, omega, A):
    """Eq. 15–16 with complex arithmetic: Re(Ψ_A(x)ᵀ Ψ_{(Aᵀ)^{-1}}(y)), (Tx, Ty)."""
    A = A.to(torch.complex128)
    B = torch.linalg.inv(A.T)

    def psi(u, M):
        v = u.to(torch.complex128) @ M.T
        return torch.exp(v @ omega.to(torch.complex128).T - (v * v).sum(-1, keepdim=True) / 2)

    return (psi(x, A) @ psi(y, B).T).real / omega.shape[0]


# ----- exact identities ---------------------------------------------------------------------
@pytest.mark.parametrize("complex_", [False, True])
def test_matches_complex_arithmetic(complex_):
    dim = 5
    x, y = inputs(3, 4, dim, 0.9)
    A = random_A(dim, complex_=complex_, seed=1)
    omega = draw_directions(7, dim, generator=torch.Generator().manual_seed(2)).to(F64)
    q = complex_exp_features(x, omega, A, "query")
    k = complex_exp_features(y, omega, A, "key")
    assert q.shape[-1] == k.shape[-1] == (14 if complex_ else 7)
    assert torch.allclose(q @ k.T, complex_reference(x, y, omega, A), rtol=1e-12, atol=0)


@pytest.mark.parametrize("complex_", [False, True])
def test_key_matrix_is_inverse_transpose(complex_):
    A = random_A(6, complex_=complex_, seed=3)
    re, im = key_matrix(A.real, A.imag if complex_ else None)
    ref = torch.linalg.inv(A.T)
    got = re if im is None else torch.complex(re, im)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("antithetic", [True, False])
def test_identity_reproduces_positive_and_i_identity_reproduces_trig(antithetic):
    dim, m = 4, 6
    x, y = inputs(3, 5, dim, 1.1, seed=4)
    kw = dict(num_features=m, seed=5, scale=0.7)
    ce_pos = create("complex_exp", dim, antithetic=antithetic, **kw)
    ce_trig = create("complex_exp", dim, A=1j * torch.eye(dim), antithetic=antithetic, **kw)
    trig = create("trig", dim, **kw).approx_kernel(x, y)
    assert torch.allclose(ce_trig.approx_kernel(x, y), trig, rtol=1e-12, atol=0)
    if antithetic:  # exactly FAVOR+ on the same ω
        pos = create("positive", dim, **kw).approx_kernel(x, y)
        assert torch.allclose(ce_pos.approx_kernel(x, y), pos, rtol=1e-12, atol=0)
    else:  # single-sided: (1/m) Σ e^{ω·(x+y)} e^{−(|x|²+|y|²)/2} on u = sqrt(scale)·x
        u, w = math.sqrt(0.7) * x, math.sqrt(0.7) * y
        omega = ce_pos.omega.to(F64)
        ref = torch.exp(u @ omega.T)[:, None] * torch.exp(w @ omega.T)[None]
        ref = ref.mean(-1) * torch.exp(-(u * u).sum(-1)[:, None] / 2 - (w * w).sum(-1) / 2)
        assert torch.allclose(ce_pos.approx_kernel(x, y), ref, rtol=1e-12, atol=0)


def test_class_matches_pure_function():
    dim = 4
    A = random_A(dim, complex_=True, seed=6)
    fmap = ComplexExpRandomFeatures(dim, A=A, num_features=5, seed=1, scale=0.5).to(F64)
    x, _ = inputs(3, 1, dim, 1.0)
    omega = fmap.omega
    rows = torch.cat([omega, -omega])
    A32 = torch.complex(A.real.float(), A.imag.float()).to(torch.complex128)  # buffers are fp32
    for role, f in (("query", fmap.query), ("key", fmap.key)):
        ref = complex_exp_features(math.sqrt(0.5) * x, rows, A32, role)
        assert torch.allclose(f(x), ref, rtol=1e-12, atol=1e-15)
    assert fmap.feature_dim == 20 == fmap.query(x).shape[-1] and not fmap.nonnegative


def test_zero_variance_condition_eq_17():
    """x = −A^{-1}(Aᵀ)^{-1} y  =>  the estimate is exact for every draw (Eq. 17)."""
    dim = 4
    A = random_A(dim, complex_=False, seed=7)
    _, y = inputs(1, 3, dim, 0.7, seed=8)
    x = -(torch.linalg.inv(A) @ torch.linalg.inv(A.T) @ y.T).T
    for seed in range(3):
        omega = draw_directions(5, dim, generator=torch.Generator().manual_seed(seed)).to(F64)
        q = complex_exp_features(x, omega, A, "query")
        k = complex_exp_features(y, omega, A, "key")
        target = torch.exp((x * y).sum(-1))
        assert torch.allclose((q * k).sum(-1), target, rtol=1e-12, atol=0)


# ----- statistics ---------------------------------------------------------------------------
@pytest.mark.parametrize("complex_", [False, True])
@pytest.mark.parametrize("orthogonal", [False, True])
def test_unbiased_with_random_A(complex_, orthogonal):
    reps, m, dim = (1500 if orthogonal else 4000), 4, 4
    x, y = inputs(3, 4, dim, 0.7, seed=9)
    A = random_A(dim, complex_=complex_, seed=10)
    g = torch.Generator().manual_seed(11)
    omega = draw_directions(reps * m, dim, orthogonal=orthogonal, generator=g)
    omega = omega.to(F64).view(reps, m, dim)
    est = complex_exp_features(x, omega, A, "query") @ complex_exp_features(
        y, omega, A, "key"
    ).transpose(-1, -2)
    target = torch.exp(x @ y.T)
    z = (est.mean(0) - target) / (est.std(0) / math.sqrt(reps))
    assert z.abs().max() < 4, z
    assert (est.mean(0) / target - 1).abs().max() < 0.05


# ----- module behaviour and errors ------------------------------------------------------------
def test_feature_dim_and_sign():
    x = torch.randn(4, 3)
    for A, anti, f_dim, nonneg in [
        (None, True, 16, True),
        (None, False, 8, True),
        (torch.eye(3) * 1j, True, 32, False),
        (torch.eye(3) * 1j, False, 16, False),
    ]:
        fmap = ComplexExpRandomFeatures(3, A=A, num_features=8, antithetic=anti, seed=0)
        assert fmap.feature_dim == f_dim == fmap.query(x).shape[-1] == fmap.key(x).shape[-1]
        assert fmap.nonnegative == nonneg
        if nonneg:
            assert (fmap.query(x) >= 0).all() and (fmap.key(x) >= 0).all()
    assert create("complex_exp", 3).feature_dim == 2 * 4 * 3


def test_bad_input_names_argument():
    with pytest.raises(ValueError, match="A"):
        ComplexExpRandomFeatures(3, A=torch.eye(4))
    with pytest.raises(ValueError, match="A"):
        ComplexExpRandomFeatures(3, A=torch.zeros(3, 3))
    with pytest.raises(TypeError, match="A"):
        ComplexExpRandomFeatures(3, A=torch.eye(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="A"):
        ComplexExpRandomFeatures(3, A=torch.full((3, 3), float("nan")))
    with pytest.raises(TypeError, match="antithetic"):
        ComplexExpRandomFeatures(3, antithetic="no")
    with pytest.raises(ValueError, match="num_features"):
        ComplexExpRandomFeatures(3, num_features=-1)
    u, omega = torch.randn(2, 3), torch.randn(4, 3)
    with pytest.raises(ValueError, match="role"):
        complex_exp_features(u, omega, None, "value")
    with pytest.raises(ValueError, match="A"):
        complex_exp_features(u, omega, torch.eye(2), "query")
    with pytest.raises(ValueError, match="omega"):
        complex_exp_features(u, torch.randn(4, 2), None, "key")


@pytest.mark.parametrize(
    ("dim", "error"), [(0, ValueError), (-2, ValueError), (2.5, TypeError), ("3", TypeError)]
)
def test_bad_dim_is_refused_at_construction_naming_dim(dim, error):
    # Before: torch.eye(dim) ran first and raised its own error (or built an empty A).
    with pytest.raises(error, match=r"^dim must"):
        ComplexExpRandomFeatures(dim)
    with pytest.raises(error, match=r"^dim must"):
        create("complex_exp", dim, seed=0)
