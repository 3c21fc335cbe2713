"""Presets: every preset builds, its description names its key settings, defaults resolve."""

import math

import pytest
import torch

from polysketch.features import available
from polysketch.nn import PRESETS, KernelAttention, valid_attentions
from polysketch.nn.resolve import resolve_attention

KEY_WORDS = {
    "psf_random": ["LayerNorm", "Gaussian", "degree-2", "r = 32", "nonnegative", "1 + Σ", "256"],
    "psf_learned": ["learned_polysketch", "r = 32", "square", "nonnegative", "LayerNorm", "1 + Σ"],
    "psf_mixed": ["exact local polynomial degree 4", "psf_random", "r = 32", "1 + Σ"],
    "polynomial": ["degree 4", "LayerNorm", "1 + Σ", "quadratic"],
    "soft_hash_1k": ["soft_hash", "1024", "temperature 4", "LayerNorm", "no offset", "1.9×"],
    "soft_hash_far": [
        "soft_hash",
        "1920",
        "temperature 10",
        "LayerNorm",
        "normalizer Σ",
        "local='none'",
        "window of >= chunk_size",
    ],
    "softmax": ["softmax", "1/sqrt(D)", "no q/k norm"],
    "sliding_window": ["last w keys", "window=w", "softmax", "1/sqrt(D)", "O(T·w)", "polynomial"],
}
NEEDS = {"sliding_window": {"window": 3}}  # presets with a required option


def test_preset_names():
    assert set(PRESETS) == set(KEY_WORDS)
    assert valid_attentions()[: len(PRESETS)] == list(PRESETS)
    assert set(available()) <= set(valid_attentions())


@pytest.mark.parametrize("name", list(KEY_WORDS))
def test_each_preset_builds_and_describes_itself(name):
    row = PRESETS[name]
    for word in KEY_WORDS[name]:
        assert word in row.description, (name, word)
    layer = KernelAttention(16, 2, attention=name, chunk_size=4, **NEEDS.get(name, {}))
    assert layer.form == row.form
    assert (layer.q_norm is not None) == row.qk_norm
    assert layer.denominator_offset == row.denominator_offset
    if row.feature_map is not None:
        assert layer.feature_map.name == row.feature_map
        head = layer.feature_map.head_map(0)
        for key, value in row.map_kwargs.items():
            got = getattr(head, key)  # a learned temperature is exp(log τ): to rounding
            assert got == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value)
        assert head.square == name.startswith("psf_")  # the sketches are self-tensored
    y = layer(torch.randn(1, 6, 16))
    assert y.shape == (1, 6, 16) and torch.isfinite(y).all()


def test_defaults_by_map_kind_and_overrides():
    d = 8
    poly = resolve_attention("tensorsketch", d, {})
    assert poly.qk_norm and poly.denominator_offset == 1.0 and poly.form == "linear"
    soft = resolve_attention("trig", d, {})
    assert not soft.qk_norm and soft.denominator_offset == 0.0
    assert soft.map_kwargs["scale"] == pytest.approx(1 / math.sqrt(d))
    other = resolve_attention("elu", d, {})
    assert not other.qk_norm and other.map_kwargs == {}
    assert resolve_attention("polysketch", d, {}).map_kwargs == {"nonnegative": True}
    over = resolve_attention("psf_random", d, {"num_features": 8}, qk_norm=False)
    assert over.map_kwargs["num_features"] == 8 and not over.qk_norm
    assert resolve_attention("polynomial", d, {"degree": 2}).degree == 2
    assert resolve_attention("psf_mixed", d, {"degree": 6}).degree == 6
    with pytest.raises(ValueError, match="map_kwargs"):
        resolve_attention("polynomial", d, {"num_features": 3})
    with pytest.raises(TypeError, match="attention"):
        resolve_attention(3, d, {})


def test_map_families_are_derived_from_the_declarations():
    # The families used to be listed twice by hand with different members (here and in
    # commands/approx.py); both now come from each map's declared ``family``.
    from polysketch.commands import approx
    from polysketch.features import get_class
    from polysketch.nn import presets

    assert presets.POLYNOMIAL_MAPS == set(available("polynomial"))
    assert presets.SOFTMAX_TARGET_MAPS == set(available("softmax"))
    assert presets.SOFTMAX_MAPS == presets.SOFTMAX_TARGET_MAPS - {"hedgehog"}
    assert all(get_class(n).kind in ("unbiased", "exact") for n in presets.SOFTMAX_MAPS)
    assert set(approx.POLYNOMIAL_MAPS) == presets.POLYNOMIAL_MAPS | {"elu", "soft_hash", "taylor"}
    assert set(approx.SOFTMAX_MAPS) == presets.SOFTMAX_MAPS
    # the attention defaults follow the family: polynomial -> LayerNorm, offset 1
    for name in available():
        spec = resolve_attention(name, 8, {})
        polynomial = get_class(name).family == "polynomial"
        assert spec.qk_norm == polynomial and spec.denominator_offset == float(polynomial)
        assert ("scale" in spec.map_kwargs) == (get_class(name).family == "softmax")


def test_soft_hash_preset_sets_the_screened_configuration():
    # The configuration measured on the repeat probe (docs/results/long_context/screens/):
    # soft_hash, F = 1024, τ from 4, LayerNorm on q/k, normalizer Σ, plain linear attention.
    spec = resolve_attention("soft_hash_1k", 64, {})
    assert (spec.form, spec.feature_map, spec.qk_norm) == ("linear", "soft_hash", True)
    assert spec.denominator_offset == 0.0
    assert spec.map_kwargs == {"num_features": 1024, "temperature": 4.0}
    layer = KernelAttention(128, 2, attention="soft_hash_1k")
    assert layer.feature_map.feature_dim == 1024
    assert layer.decode_state_size(5000) == 2 * 1024 * (64 + 1)


def test_soft_hash_far_reads_earlier_blocks_only_and_refuses_what_it_lacks():
    """soft_hash_far is mixed attention without in-block scores (ops local="none"): a query
    sees nothing of its own block, the first block's outputs are 0; it has no degree to set
    and no local blocks to balance."""
    spec = resolve_attention("soft_hash_far", 8, {})
    assert (spec.form, spec.local, spec.denominator_offset) == ("mixed", "none", 0.0)
    layer = KernelAttention(16, 2, attention="soft_hash_far", chunk_size=4, num_features=12)
    x = torch.randn(1, 10, 16)
    y = layer(x)
    assert not y[:, :4].any()  # block 0 has no earlier block (no biases: out_proj(0) = 0)
    changed = x.clone()
    changed[:, 5] += 1.0  # key 5 (block 1) is seen from block 2 on, not by its own block
    z = layer(changed)
    same = [0, 1, 2, 3, 4, 6, 7]  # (row 5's own query changed)
    assert torch.equal(z[:, same], y[:, same]) and not torch.allclose(z[:, 8:], y[:, 8:])
    with pytest.raises(ValueError, match="no degree"):
        resolve_attention("soft_hash_far", 8, {"degree": 2})
    with pytest.raises(ValueError, match="learn_balance"):
        KernelAttention(16, 2, attention="soft_hash_far", learn_balance=True)


def test_a_far_only_attention_without_a_wide_enough_window_is_refused_with_the_fix():
    """soft_hash_far reads only earlier blocks, so a model must give it an exact window of
    >= chunk_size keys: refused otherwise, the message naming what to change."""
    from polysketch.nn import TransformerConfig, TransformerLM

    def build(**kw):
        cfg = dict(vocab_size=32, block_size=64, n_layer=1, n_head=2, n_embd=32, **kw)
        return TransformerLM(TransformerConfig(**cfg).validate())

    with pytest.raises(
        ValueError, match=r"local_window=64 \(chunk_size <= 64, or local_window >= 256\)"
    ):
        build(attention="soft_hash_far_local_balanced", chunk_size=256)
    with pytest.raises(
        ValueError,
        match=r"local_window=None \(local_window >= 16, or a model preset .*_local_balanced",
    ):
        build(attention="soft_hash_far", chunk_size=16)
    build(attention="soft_hash_far_local_balanced", chunk_size=64)  # the preset's own block
