"""Specs: an attention name resolved once into frozen, self-validating values (issue 40)."""

import copy
import dataclasses
import pickle

import pytest
import torch

from polysketch.nn import (
    MODEL_PRESETS,
    AttentionSpec,
    HybridSpec,
    ModelSpec,
    TransformerConfig,
    TransformerLM,
    resolve_attention,
    resolve_model,
    valid_model_attentions,
)
from polysketch.nn.spec import FrozenMap

SMALL = dict(vocab_size=16, n_layer=2, n_head=2, n_embd=16, chunk_size=4, block_size=32)


def _config(name: str, **kw) -> TransformerConfig:
    kw = {**SMALL, **kw}
    if name == "sliding_window":
        kw["window"] = 3
    if name in ("soft_hash_far",):
        kw["local_window"] = 4
    if name in ("soft_hash_far", "soft_hash_1k", "soft_hash") or name in MODEL_PRESETS:
        kw["map_kwargs"] = {"num_features": 12}
    return TransformerConfig(attention=name, **kw)


def test_specs_are_frozen_and_their_keywords_read_only():
    spec = resolve_attention("psf_random", 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.form = "mixed"
    with pytest.raises(TypeError):
        spec.map_kwargs["num_features"] = 64
    assert isinstance(spec.map_kwargs, FrozenMap) and spec.map_kwargs["num_features"] == 32
    assert copy.deepcopy(spec) == spec and pickle.loads(pickle.dumps(spec)) == spec
    hybrid = HybridSpec(window=64, heads=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        hybrid.window = 8


@pytest.mark.parametrize("name", valid_model_attentions())
def test_every_model_attention_resolves_once_and_round_trips(name):
    spec = _config(name).resolve()
    assert isinstance(spec, ModelSpec) and isinstance(spec.attention, AttentionSpec)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert resolve_model(_config(name)) == spec  # resolving twice gives the same value
    model = TransformerLM(_config(name))
    assert model.spec == spec
    for block in model.blocks:  # every layer reads the model's spec, nothing re-resolves
        assert block.attn.spec in (spec.attention, spec.window_attention)


def test_the_spec_validates_itself():
    with pytest.raises(ValueError, match="form must be one of"):
        AttentionSpec(name="x", form="chunked", feature_map="elu")
    with pytest.raises(ValueError, match="needs feature map"):
        AttentionSpec(name="x", form="linear")
    with pytest.raises(ValueError, match="takes no feature map"):
        AttentionSpec(name="x", form="softmax", feature_map="elu")
    with pytest.raises(ValueError, match="window= is an option"):
        AttentionSpec(name="x", form="softmax", window=4)
    with pytest.raises(ValueError, match="gradient_surrogate needs mixed attention without"):
        resolve_attention("psf_mixed", 8, gradient_surrogate=1.0)
    with pytest.raises(ValueError, match="learn_balance=True"):
        resolve_attention("psf_random", 8, learn_balance=True)
    with pytest.raises(ValueError, match="unknown fields"):
        AttentionSpec.from_dict({"name": "softmax", "form": "softmax", "algorithm": "x"})
    with pytest.raises(ValueError, match="global_heads must be an int >= 1"):
        HybridSpec(window=4, heads=0)


def test_a_checkpoint_keeps_its_spec_when_the_preset_changes(tmp_path, monkeypatch):
    """A checkpoint stores its model's ``ModelSpec``: loaded after the preset of its name
    changed, the model computes what it computed (the stored spec wins); a checkpoint written
    before specs were stored resolves its config (tests/test_nn_golden.py's stored files)."""
    from polysketch.train import load_model, save_checkpoint

    config = _config("soft_hash_far_local")
    model = TransformerLM(config)
    idx = torch.randint(0, 16, (1, 9), generator=torch.Generator().manual_seed(0))
    want = model(idx)[0]
    state = {"model": model.state_dict(), "model_config": dataclasses.asdict(config),
             "model_spec": model.spec.to_dict()}  # fmt: skip
    save_checkpoint(tmp_path / "ckpt.pt", state)
    changed = dataclasses.replace(
        MODEL_PRESETS["soft_hash_far_local"],
        map_kwargs={"num_features": 12, "temperature": 3.0},
        hybrid=HybridSpec(window=8, heads=1, value_fraction=29 / 32),
    )
    monkeypatch.setitem(MODEL_PRESETS, "soft_hash_far_local", changed)
    assert TransformerLM(config).spec != model.spec  # the preset did change
    loaded, _ = load_model(tmp_path / "ckpt.pt", device="cpu")
    assert loaded.spec == model.spec
    torch.testing.assert_close(loaded(idx)[0], want, rtol=0, atol=0)
