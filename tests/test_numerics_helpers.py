"""The suite's rounding tools (numerics.py, blas_noise.py): what they measure, and that a
comparison built on them fails where it should (issue 69)."""

import pytest
import torch

from blas_noise import BlasNoise
from numerics import (
    assert_as_accurate,
    per_token_in_other_shapes,
    relative_error,
    rounding_sigma,
    unit_roundoff,
)

U32 = unit_roundoff(torch.float32)


def _ab(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(40, 64, generator=g, dtype=torch.float64), torch.randn(
        64, 8, generator=g, dtype=torch.float64
    )


def test_each_seed_is_another_blas_and_unit_of_scales_the_noise():
    a, b = _ab()
    exact = a @ b
    with BlasNoise(1, unit_of=torch.float32):
        one = a @ b
    with BlasNoise(2, unit_of=torch.float32):
        two = a @ b
    with BlasNoise(1, unit_of=torch.float32):
        again = a @ b
    assert torch.equal(one, again) and not torch.equal(one, two)
    bound = (63**0.5) * U32 * (a.abs() @ b.abs())  # |xi| <= 1
    assert ((one - exact).abs() <= bound * (1 + 1e-9)).all()
    assert (one - exact).abs().max() > 0.1 * bound.max()  # fp32-sized, not fp64-sized
    with BlasNoise(1):  # fp64 operands, fp64's unit: the bound scaled by u64 / u32
        small = bound * (unit_roundoff(torch.float64) / U32)
        assert ((a @ b - exact).abs() <= small + 64 * unit_roundoff(torch.float64) * (
            a.abs() @ b.abs())).all()
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="seed"):
            BlasNoise(bad)
    with pytest.raises(TypeError, match="unit_of"):
        BlasNoise(1, unit_of=torch.int32)


def test_rounding_sigma_follows_each_rows_condition():
    """Rows of A B with a cancelling row (sum of large terms, small result) have a larger
    sigma relative to their size: the scale a comparison divides out."""
    a, b = _ab()
    a[3] = 1e3 * a[3]
    b64 = b.clone()
    b64[:, 0] = 0  # column 0 is exact zero: its rows' errors come from the other columns

    def f():
        out = a @ b64
        out[5] = out[5] - (a[5] @ b64).detach() + 1e-6  # a row that cancels to ~1e-6
        return out

    sigma = rounding_sigma(f, draws=6)
    assert sigma.shape == (40,)
    rows = f().norm(dim=-1)
    assert (sigma >= U32 * rows * (1 - 1e-12)).all()  # never below one rounding of the row
    assert sigma[3] > 100 * sigma[0]  # scaled row
    with pytest.raises(ValueError, match="draws"):
        rounding_sigma(f, draws=2)


def test_several_references_the_largest_is_the_yardstick():
    exact = torch.randn(30, 16, dtype=torch.float64)
    e = exact.abs().max()
    small = (exact + 1e-7 * e).float()
    large = (exact + 4e-7 * e).float()
    got = (exact + 6e-7 * e).float()
    with pytest.raises(AssertionError, match="largest of 2"):
        assert_as_accurate(got, [small, small], exact)
    assert_as_accurate(got, [small, large], exact)
    with pytest.raises(ValueError, match="differ"):
        assert_as_accurate(got, [small[:5]], exact)


def test_the_sigma_fallback_divides_out_one_ill_conditioned_row_but_not_a_leak():
    """One row with a large sigma carries the Frobenius norm: there, got's error being
    3x the reference's is one draw against another, and in sigma units the rows weigh alike;
    an error of 100 sigmas in every row (a leak) fails in both."""
    g = torch.Generator().manual_seed(1)
    exact = torch.randn(50, 16, generator=g, dtype=torch.float64)
    sigma = torch.full((50,), 1e-7, dtype=torch.float64)
    sigma[0] = 1e-4  # the ill-conditioned row
    noise = torch.randn(50, 16, generator=g, dtype=torch.float64) / 4  # about one sigma/row
    ref = exact + noise * sigma[:, None]
    ref[0] = exact[0] + 0.3 * noise[0] * sigma[0]  # the reference's draw was small there
    got = exact + noise.flip(0) * sigma[:, None]
    got[0] = exact[0] + noise[0] * sigma[0]
    assert relative_error(got, exact, "fro") > 2.5 * relative_error(ref, exact, "fro")
    with pytest.raises(AssertionError):
        assert_as_accurate(got, ref, exact, norm="fro")
    assert_as_accurate(got, ref, exact, norm="fro", sigma=lambda: sigma)
    leak = exact + 100 * noise * sigma[:, None]
    with pytest.raises(AssertionError, match="sigma norm"):
        assert_as_accurate(leak, ref, exact, norm="fro", sigma=sigma)
    with pytest.raises(ValueError, match="needs sigma"):
        assert_as_accurate(got, ref, exact, norm="sigma")


def test_per_token_in_other_shapes_keeps_the_values():
    w = torch.randn(8, 5, dtype=torch.float64)
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    outs = per_token_in_other_shapes(lambda t: t @ w, x)
    assert len(outs) == 3
    for o in outs:
        torch.testing.assert_close(o, x @ w, rtol=1e-14, atol=0)
