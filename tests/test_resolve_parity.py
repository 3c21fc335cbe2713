"""One spec from the command line to Hugging Face (issue 71): ``TransformerLM`` and ``convert``
resolve names and options through the same resolver (``polysketch.nn.resolve``), so they accept
and refuse the same (name, options) pairs, but for the differences a converted layer has by
design (``CONVERTED_DIFFERENCES``), each asserted here by name; and an attention option is one
field of ``AttentionSpec``, which reaches every layer without a line in ``integrations/``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

transformers = pytest.importorskip("transformers")

from polysketch.nn import (  # noqa: E402
    ATTENTION_OPTIONS,
    MODEL_PRESETS,
    PRESETS,
    KernelAttention,
    TransformerConfig,
    TransformerLM,
)
from polysketch.nn.resolve import CONVERTED_DIFFERENCES, HYBRID_OPTIONS  # noqa: E402

NAMES = list(PRESETS) + list(MODEL_PRESETS)
NEEDS = {"sliding_window": {"window": 8}}  # a name's required option, on both sides
OPTION_SETS = [
    {},
    {"qk_norm": False},
    {"qk_norm": True},
    {"denominator_offset": 0.5},
    {"mixed": True},
    {"learn_balance": True},
    {"mixed": True, "learn_balance": True},
    {"gradient_surrogate": 1.0},
    {"window": 8},
    {"chunk_size": 16},
    {"chunk_size": 128},
    {"softmax_scale": 0.3},
    {"local_window": 16},
    {"local_window": 64},
    {"global_heads": 2},
    {"local_window": 64, "global_heads": 2},
    {"local_window": 64, "global_heads": 8},
    {"global_every": 2},
    {"local_window": 64, "global_every": 2},
    {"local_window": 64, "global_every": 3},
    {"local_window": 64, "global_rope": False},
    {"local_window": 64, "global_rope": True},
    {"local_window": 64, "local_shared": True},
    {"local_window": 64, "local_shared": False},
    {"local_window": 64, "global_out_init": 0.5},
    {"local_window": 64, "global_out_tied": True},
]
DIFFERENT = {  # option -> the (TransformerLM accepts, convert accepts) pairs it explains
    "global_out_init": {(True, False)},
    "global_out_tied": {(True, False)},
    "global_rope": {(True, False)},  # False only
    # True: convert is the shared form (LM needs global_heads = n_head); False: convert refuses
    "local_shared": {(False, True), (True, False)},
    "softmax_scale": {(True, False)},  # a converted layer's scale is the model's
    "global_heads": {(True, False)},  # LM adds heads; convert reads the model's query heads
}


def _tiny():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _accepts(build) -> bool:
    try:
        build()
    except (ValueError, TypeError):
        return False
    return True


def _lm(name, options):
    cfg = TransformerConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64,
                            attention=name, **options)  # fmt: skip
    return TransformerLM(cfg)


def _convert(name, options):
    from polysketch.integrations.transformers import convert

    return convert(_tiny(), name, **options)


def _explained(options: dict, lm_ok: bool, conv_ok: bool) -> bool:
    for key, pairs in DIFFERENT.items():
        if key in options and (lm_ok, conv_ok) in pairs:
            if key == "global_rope" and options[key] is not False:
                continue
            return True
    return False


@pytest.mark.parametrize("name", NAMES)
def test_transformer_lm_and_convert_accept_and_refuse_alike(name):
    """Every (name, option set): both accept or both refuse, or a documented difference
    (``DIFFERENT``, mirroring ``CONVERTED_DIFFERENCES``) says why not."""
    unexplained = []
    for options in OPTION_SETS:
        options = {**NEEDS.get(name, {}), **options}
        lm_ok = _accepts(lambda options=options: _lm(name, options))
        conv_ok = _accepts(lambda options=options: _convert(name, options))
        if lm_ok != conv_ok and not _explained(options, lm_ok, conv_ok):
            unexplained.append((options, lm_ok, conv_ok))
    assert not unexplained, unexplained


def test_every_difference_is_documented_and_happens():
    """Each documented difference is real: the pair of the table, on a name where it applies."""
    assert set(DIFFERENT) <= set(CONVERTED_DIFFERENCES)
    base = {"local_window": 64}
    for key, value in (("global_out_init", 0.5), ("global_out_tied", True),
                       ("global_rope", False), ("softmax_scale", 0.3)):  # fmt: skip
        options = {**base, key: value} if key != "softmax_scale" else {key: value}
        assert _accepts(lambda o=options: _lm("psf_random", o)), key
        assert not _accepts(lambda o=options: _convert("psf_random", o)), key
    # local_shared=True: a TransformerLM refuses it beside fewer heads; a converted layer is it
    options = {"local_shared": True}
    assert not _accepts(lambda: _lm("soft_hash_far_local", options))
    assert _accepts(lambda: _convert("soft_hash_far_local", options))
    options = {"local_window": 64, "local_shared": False}
    assert _accepts(lambda: _lm("psf_random", options))
    assert not _accepts(lambda: _convert("psf_random", options))
    options = {"local_window": 64, "global_heads": 8}  # more heads than the model's 4
    assert _accepts(lambda: _lm("psf_random", options))
    assert not _accepts(lambda: _convert("psf_random", options))


def test_global_heads_and_values_differ_as_documented():
    """global_heads: a TransformerLM adds g heads with projections of their own; a converted
    layer runs the attention on the model's query heads 0..g-1 (CONVERTED_DIFFERENCES). A
    model preset's heads and value width do not apply to a converted layer: every query
    head, the model's own values."""
    lm = _lm("psf_random", {"local_window": 64, "global_heads": 2})
    assert lm.blocks[0].attn.num_heads == 2 and lm.blocks[0].attn.qkv is not None
    conv = _convert("psf_random", {"local_window": 64, "global_heads": 2})
    core = conv.model.layers[0].self_attn.polysketch
    assert core.num_heads == 2 and core.total_heads == 4
    assert not any("qkv" in n for n, _ in core.named_parameters())
    preset = MODEL_PRESETS["soft_hash_far_local"]
    lm = _lm("soft_hash_far_local", {})
    assert lm.blocks[0].attn.num_heads == preset.hybrid.heads == 1
    assert lm.blocks[0].attn.value_dim == int(preset.hybrid.value_fraction * 16)
    core = _convert("soft_hash_far_local", {}).model.layers[0].self_attn.polysketch
    assert core.num_heads == 4 and core.value_dim == core.qk_dim == 16


def test_global_every_leaves_layers_to_the_window_alone_in_both():
    lm = _lm("psf_random", {"local_window": 8, "global_every": 2})
    assert [b.attn.form for b in lm.blocks] == ["window", "linear"]
    conv = _convert("psf_random", {"local_window": 8, "global_every": 2})
    cores = [m.self_attn.polysketch for m in conv.model.layers]
    assert [c.form for c in cores] == ["window", "linear"]
    assert cores[1].local_attn is not None and cores[0].local_attn is None


def test_options_are_the_spec_fields_and_reach_every_path():
    """``ATTENTION_OPTIONS`` is read off ``AttentionSpec``; each one given to TransformerConfig,
    KernelAttention and convert arrives in the spec alike."""
    from polysketch.nn.spec import OPTION_FIELDS, AttentionSpec

    assert set(OPTION_FIELDS) == {f.name for f in dataclasses.fields(AttentionSpec)
                                  if "option" in f.metadata}  # fmt: skip
    assert set(OPTION_FIELDS) | {"mixed"} == set(ATTENTION_OPTIONS)
    assert not set(ATTENTION_OPTIONS) & set(HYBRID_OPTIONS)
    config_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(ATTENTION_OPTIONS) <= config_fields  # one field per option for the CLI
    values = {"qk_norm": False, "denominator_offset": 0.25, "chunk_size": 16,
              "gradient_surrogate": 0.0, "learn_balance": False}  # fmt: skip
    want = {**values}
    lm = _lm("psf_random", values).blocks[0].attn.spec
    layer = KernelAttention(64, 4, attention="psf_random", **values).spec
    conv = _convert("psf_random", values).model.layers[0].self_attn.polysketch.spec
    for spec in (lm, layer, conv):
        assert {k: getattr(spec, k) for k in want} == want


def test_a_new_option_reaches_every_layer_through_the_same_path(monkeypatch):
    """Adding an option (docs/models.md, "Adding an attention option"): one field of
    ``AttentionSpec`` marked as an option, and a ``TransformerConfig`` field for the command
    line. The resolver, ``KernelAttention``, ``TransformerLM``, ``convert`` and the saved
    config.json carry it with no other change (here a dummy field, patched in)."""
    import polysketch.nn.resolve as resolve
    import polysketch.nn.spec as spec_module
    from polysketch._fields import documented
    from polysketch.integrations.transformers import convert

    @dataclass(frozen=True)
    class WithDummy(spec_module.AttentionSpec):
        dummy: float = spec_module._option(0.0, "a dummy option (test)")

    options = (*spec_module.OPTION_FIELDS, "dummy")
    monkeypatch.setattr(spec_module, "AttentionSpec", WithDummy)
    monkeypatch.setattr(resolve, "AttentionSpec", WithDummy)
    monkeypatch.setattr(resolve, "OPTION_FIELDS", options)
    monkeypatch.setattr(resolve, "ATTENTION_OPTIONS", (*options, "mixed"))

    @dataclass
    class Config(TransformerConfig):
        dummy: float | None = documented(None, help="a dummy option (test)")

    assert KernelAttention(16, 2, attention="psf_random", dummy=0.5).spec.dummy == 0.5
    lm = TransformerLM(Config(vocab_size=64, block_size=32, n_layer=1, n_head=4, n_embd=64,
                              attention="psf_random", dummy=0.25))  # fmt: skip
    assert lm.blocks[0].attn.spec.dummy == 0.25
    model = convert(_tiny(), "psf_random", dummy=0.75)
    assert all(m.self_attn.polysketch.spec.dummy == 0.75 for m in model.model.layers)
    assert model.config.polysketch["layers"][0]["attention"]["dummy"] == 0.75


def test_an_unknown_option_is_refused_naming_the_options():
    from polysketch.nn import resolve_attention

    with pytest.raises(ValueError, match=r"unknown attention options \['nope'\].*qk_norm"):
        resolve_attention("psf_random", 16, None, {"nope": 1})
    with pytest.raises(ValueError, match="window-branch options"):
        from polysketch.nn.resolve import resolve_converted

        resolve_converted("psf_random", head_dim=16, num_heads=4, scaling=0.25,
                          branch={"value_dim": 3})  # fmt: skip


def test_chunk_size_comes_from_the_spec_everywhere():
    """One default (``DEFAULT_CHUNK_SIZE``), a model preset's own block carried to
    TransformerLM and convert alike, and an explicit one winning."""
    from polysketch.nn import DEFAULT_CHUNK_SIZE

    assert _lm("psf_random", {}).blocks[0].attn.chunk_size == DEFAULT_CHUNK_SIZE == 64
    assert _lm("psf_random", {"chunk_size": 16}).blocks[0].attn.chunk_size == 16
    conv = _convert("psf_random", {})
    assert conv.model.layers[0].self_attn.polysketch.chunk_size == DEFAULT_CHUNK_SIZE
    preset = MODEL_PRESETS["soft_hash_far_local_balanced"]
    lm = _lm("soft_hash_far_local_balanced", {})
    assert lm.blocks[0].attn.chunk_size == preset.chunk_size
    assert lm.blocks[0].local_attn.chunk_size == preset.chunk_size
    core = _convert("soft_hash_far_local_balanced", {}).model.layers[0].self_attn.polysketch
    assert core.chunk_size == core.local_attn.chunk_size == preset.chunk_size
    x = torch.randint(0, 64, (1, 9))
    assert torch.isfinite(lm(x)[0]).all()
