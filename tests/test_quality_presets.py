"""psf_mixed uses the public code's sketch scale 1/√r (docs/quality_gap.md)."""

import math

import torch

from polysketch.nn import KernelAttention
from polysketch.nn.resolve import resolve_attention


def test_psf_mixed_scale_follows_r_and_can_be_overridden():
    assert resolve_attention("psf_mixed", 64, {}).map_kwargs["output_scale"] == 32**-0.5
    spec = resolve_attention("psf_mixed", 64, {"num_features": 16})
    assert math.isclose(spec.map_kwargs["output_scale"], 0.25)
    assert (
        resolve_attention("psf_mixed", 64, {"output_scale": 1.0}).map_kwargs["output_scale"] == 1.0
    )
    assert "output_scale" not in resolve_attention("psf_random", 64, {}).map_kwargs


def test_psf_mixed_far_scores_weigh_r2_less_than_at_unit_scale():
    """Same seed: features × 1/√r, so far (sketched) scores × 1/r² against exact local ones;
    the layer outputs differ (the local block is unchanged, the far blocks are not)."""
    kw = dict(attention="psf_mixed", chunk_size=8, seed=1)
    public, unit = KernelAttention(32, 2, **kw), KernelAttention(32, 2, output_scale=1.0, **kw)
    unit.load_state_dict(public.state_dict())
    q = torch.randn(1, 2, 5, 16)
    r = 32
    torch.testing.assert_close(
        public.feature_map.query(q), unit.feature_map.query(q) / math.sqrt(r)
    )
    x = torch.randn(1, 24, 32)
    a, b = public(x), unit(x)
    torch.testing.assert_close(a[:, :8], b[:, :8])  # first block: exact local scores only
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-4
