"""Seeded randomness (polysketch.random) and argument checks (polysketch._checks)."""

import pytest
import torch

from polysketch import _checks, random


def test_make_generator_is_reproducible_and_validates():
    a = torch.randn(5, generator=random.make_generator(3))
    b = torch.randn(5, generator=random.make_generator(3))
    assert torch.equal(a, b)
    g = torch.Generator().manual_seed(1)
    assert random.make_generator(None, g) is g
    with pytest.raises(ValueError, match="seed or generator"):
        random.make_generator(1, g)
    with pytest.raises(ValueError, match="seed"):
        random.make_generator(-1)
    with pytest.raises(TypeError, match="generator"):
        random.make_generator(None, 5)
    torch.manual_seed(11)
    c = torch.randn(3, generator=random.make_generator())
    torch.manual_seed(11)
    d = torch.randn(3, generator=random.make_generator())
    assert torch.equal(c, d), "seedless generators follow torch.manual_seed"


def test_orthogonal_gaussian_blocks_are_orthogonal_with_gaussian_norms():
    g = random.make_generator(0)
    w = random.orthogonal_gaussian(10, 4, generator=g).double()
    assert w.shape == (10, 4)
    for start in (0, 4):
        block = w[start : start + 4]
        gram = block @ block.T
        off = gram - torch.diag(torch.diagonal(gram))
        assert off.abs().max() < 1e-5
    # rows are marginally N(0, I): E||w||^2 = dim, second moment of entries = 1
    many = random.orthogonal_gaussian(4000, 8, generator=g).double()
    second = (many**2).mean(0)
    assert torch.allclose(second, torch.ones(8, dtype=torch.float64), atol=0.1)
    assert abs(many.mean().item()) < 0.05


def test_rademacher_and_randint():
    g = random.make_generator(0)
    r = random.rademacher(1000, generator=g)
    assert set(r.unique().tolist()) == {-1.0, 1.0}
    i = random.randint(7, 1000, generator=g)
    assert i.dtype == torch.int64 and i.min() >= 0 and i.max() < 7


def test_checks_name_the_argument():
    with pytest.raises(TypeError, match="degree"):
        _checks.check_positive_int(2.0, "degree")
    with pytest.raises(ValueError, match="degree"):
        _checks.check_positive_int(0, "degree")
    with pytest.raises(TypeError, match="flag"):
        _checks.check_int(True, "flag")
    with pytest.raises(ValueError, match="eps"):
        _checks.check_float(float("nan"), "eps")
    with pytest.raises(ValueError, match="scale"):
        _checks.check_float(0.0, "scale", minimum=0.0, strict_minimum=True)
    with pytest.raises(ValueError, match="projection"):
        _checks.check_choice("x", "projection", ["srht", "gaussian"])
    with pytest.raises(ValueError, match="q"):
        _checks.check_tensor(torch.zeros(3), "q", min_dim=2)
    with pytest.raises(ValueError, match="k"):
        _checks.check_finite(torch.tensor([float("nan")]), "k")
    assert _checks.compute_dtype(torch.bfloat16) == torch.float32
    assert _checks.compute_dtype(torch.float64) == torch.float64


@pytest.mark.parametrize("seed", [2**64, 2**70, -1, -(2**70)])
def test_seed_out_of_64_bit_range_names_seed(seed):
    # Before: seeds >= 2**64 reached Generator.manual_seed and raised an OverflowError-like
    # "Overflow when unpacking long long" from deep inside torch.
    with pytest.raises(ValueError, match=r"^seed must be"):
        random.make_generator(seed)
    from polysketch.features import create

    with pytest.raises(ValueError, match=r"^seed must be"):
        create("positive", 4, seed=seed)


def test_seed_bool_and_float_are_type_errors_naming_seed():
    for seed in (True, 1.5, "7"):
        with pytest.raises(TypeError, match=r"^seed must be an int"):
            random.make_generator(seed)


def test_largest_64_bit_seed_is_accepted():
    g = random.make_generator(2**64 - 1)
    assert g.initial_seed() == 2**64 - 1
    assert random.check_seed(0) == 0


def test_as_dtype_returns_the_tensor_itself_or_a_converted_copy():
    x = torch.randn(3, requires_grad=True)
    assert _checks.as_dtype(x, torch.float32) is x
    y = _checks.as_dtype(x, torch.float64)
    assert y.dtype == torch.float64 and y.grad_fn is not None
    torch.testing.assert_close(y, x.double())
