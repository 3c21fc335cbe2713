"""Baseline maps: elu + 1, BASED's Taylor map, element-wise power (baselines.py)."""

import math

import pytest
import torch

from conftest import rel_err
from numerics import gamma
from polysketch.features import create
from polysketch.features.baselines import ElementwisePower, EluFeatures, TaylorFeatures

CASES = [
    ("elu", {}),
    ("taylor", {}),
    ("taylor", {"scale": 0.7}),
    ("elementwise_power", {"degree": 2, "num_features": 9, "seed": 0}),
    ("elementwise_power", {"degree": 3, "num_features": 4, "seed": 1, "trainable": False}),
]


@pytest.mark.parametrize("name, kwargs", CASES)
def test_features_equal_closed_form_kernel_fp64(name, kwargs):
    fmap = create(name, 5, **kwargs)
    assert fmap.kind == "approximate"
    g = torch.Generator().manual_seed(0)
    x = 1.5 * torch.randn(2, 3, 7, 5, generator=g, dtype=torch.float64)
    y = 1.5 * torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64)
    with torch.no_grad():
        approx, target = fmap.approx_kernel(x, y), fmap.target_kernel(x, y)
    assert approx.shape == target.shape == (2, 3, 7, 4)
    assert rel_err(approx, target) < 1e-12
    assert fmap.query(x).shape == (2, 3, 7, fmap.feature_dim)
    assert torch.equal(fmap.query(x), fmap.key(x))


def test_elu_features_and_nonnegativity():
    fmap = EluFeatures(4)
    assert fmap.feature_dim == 4 and fmap.nonnegative
    x = torch.tensor([[-30.0, -1.0, 0.0, 2.5]], dtype=torch.float64)
    expected = torch.tensor([[math.exp(-30.0), math.exp(-1.0), 1.0, 3.5]], dtype=torch.float64)
    assert rel_err(fmap.query(x), expected) < 1e-15
    z = 20 * torch.randn(64, 4, dtype=torch.float64)
    assert bool((fmap.query(z) > 0).all())
    assert bool((fmap.approx_kernel(z, z) >= 0).all())


def test_taylor_kernel_is_second_order_expansion_of_exp():
    d = 6
    fmap = TaylorFeatures(d)
    assert fmap.feature_dim == 1 + d + d * d and fmap.nonnegative
    assert fmap.scale == pytest.approx(1 / math.sqrt(d))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, d, generator=g, dtype=torch.float64)
    y = torch.randn(9, d, generator=g, dtype=torch.float64)
    s = x @ y.T / math.sqrt(d)
    assert rel_err(fmap.target_kernel(x, y), 1 + s + s * s / 2) < 1e-15
    # small logits: |k − e^s| ≤ e^|s| |s|³ / 6 (Lagrange remainder)
    xs, ys = 0.2 * x, 0.2 * y
    s = xs @ ys.T / math.sqrt(d)
    err = (fmap.approx_kernel(xs, ys) - torch.exp(s)).abs()
    assert bool((err <= torch.exp(s.abs()) * s.abs() ** 3 / 6 + 1e-15).all())
    assert float(err.max()) > 0  # it is an approximation, not exp itself
    big = 10 * torch.randn(16, d, dtype=torch.float64)
    assert bool((fmap.approx_kernel(big, -big) >= 0.5 - 1e-9).all())


def test_elementwise_power_options():
    even = ElementwisePower(5, degree=2, num_features=6, seed=0)
    odd = ElementwisePower(5, degree=3, num_features=6, seed=0)
    assert even.nonnegative and not odd.nonnegative
    x = torch.randn(8, 5, dtype=torch.float64)
    assert bool((even.approx_kernel(x, -x) >= 0).all())
    assert bool((odd.approx_kernel(x, -x) < 0).any())
    assert isinstance(even.theta, torch.nn.Parameter)
    fixed = ElementwisePower(5, num_features=6, seed=0, trainable=False)
    assert "theta" in dict(fixed.named_buffers()) and not list(fixed.parameters())
    assert torch.equal(fixed.theta, even.theta)
    assert "theta" in fixed.state_dict() and "theta" in even.state_dict()
    # seeds and redraw
    assert not torch.equal(ElementwisePower(5, seed=1).theta, ElementwisePower(5, seed=2).theta)
    before = fixed.theta.clone()
    fixed.redraw_(torch.Generator().manual_seed(3))
    assert not torch.equal(before, fixed.theta)
    again = ElementwisePower(5, num_features=6, trainable=False, seed=0)
    again.redraw_(torch.Generator().manual_seed(3))
    assert torch.equal(again.theta, fixed.theta)
    assert create("elementwise_power", 7).feature_dim == 7


def test_elementwise_power_gradients():
    fmap = ElementwisePower(3, degree=3, num_features=4, seed=0).double()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fmap.approx_kernel, (x, y))
    fmap.approx_kernel(x.detach(), y.detach()).sum().backward()
    assert float(fmap.theta.grad.norm()) > 0
    theta = fmap.theta.detach().clone().requires_grad_(True)

    def kernel(t):
        return (((x.detach() @ t.T) ** 3) @ ((y.detach() @ t.T) ** 3).T).sum()

    (expected,) = torch.autograd.grad(kernel(theta), theta)
    assert rel_err(fmap.theta.grad, expected) < 1e-12


@pytest.mark.parametrize("name", ["elu", "taylor", "elementwise_power"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_output_dtype_follows_input(name, dtype):
    fmap = create(name, 4).requires_grad_(False)
    x = torch.randn(2, 3, 4).to(dtype)
    out = fmap.query(x)
    assert out.dtype == dtype
    # a few roundings per feature (taylor's x_i x_j / 2, elu, a power of degree <= 4), fp32
    # internals: gamma(8) ~ 4.8e-7 in fp32; bf16 adds the output's rounding (u = 3.9e-3)
    tol = 2e-2 if dtype == torch.bfloat16 else gamma(8, dtype)
    assert rel_err(out.double(), fmap.query(x.double())) <= tol
    assert fmap.to(torch.float64).query(x.double()).dtype == torch.float64


@pytest.mark.parametrize(
    "name, kwargs, arg",
    [
        ("elementwise_power", {"degree": 0}, "degree"),
        ("elementwise_power", {"num_features": 0}, "num_features"),
        ("taylor", {"scale": 0.0}, "scale"),
        ("taylor", {"scale": -1.0}, "scale"),
        ("elu", {"dim": 0}, "dim"),
    ],
)
def test_bad_constructor_arguments(name, kwargs, arg):
    dim = kwargs.pop("dim", 4)
    with pytest.raises(ValueError, match=arg):
        create(name, dim, **kwargs)


@pytest.mark.parametrize("name", ["elu", "taylor", "elementwise_power"])
def test_bad_input_names_argument(name):
    fmap = create(name, 4)
    with pytest.raises(ValueError, match="x"):
        fmap.query(torch.randn(3, 5))
    with pytest.raises(ValueError, match="y"):
        fmap.target_kernel(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(TypeError, match="x"):
        fmap.query(torch.ones(3, 4, dtype=torch.int64))
