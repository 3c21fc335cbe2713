"""Attention specs (``polysketch.eval.attention_spec``): parsing, lists, model configs."""

import pytest

from polysketch.eval import mqar_sweep
from polysketch.nn import TransformerConfig, TransformerLM
from polysketch.nn.resolve import (
    MODEL_KEYS,
    config_options,
    parse_attention,
    split_attentions,
)


def test_split_attentions_continues_keywords_of_the_spec_before():
    text = "psf_random, soft_hash_1k:num_features=320,local_window=64,temperature=8.0,softmax"
    assert split_attentions(text) == (
        "psf_random",
        "soft_hash_1k:num_features=320,local_window=64,temperature=8.0",
        "softmax",
    )
    assert split_attentions("taylor:qk_dim=16") == ("taylor:qk_dim=16",)
    assert split_attentions("hedgehog,,") == ("hedgehog",)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "at least one"),
        (" , ", "at least one"),
        ("num_features=8", "keyword with no NAME"),
        ("psf_random,num_features=8", "keyword with no NAME"),  # psf_random has no ':'
        ("nope", "unknown 'nope'"),
        ("soft_hash_1k:num_features", "key=value"),
    ],
)
def test_split_attentions_refuses_what_it_cannot_read(text, match):
    with pytest.raises(ValueError, match=match):
        split_attentions(text)


def test_config_options_reach_the_model():
    spec = "soft_hash_1k:num_features=12,local_window=8,temperature=8.0,chunk_size=16"
    options = config_options(spec, chunk_size=4)
    assert options == {
        "chunk_size": 16,  # the spec's own option wins over the default
        "local_window": 8,
        "attention": "soft_hash_1k",
        "map_kwargs": {"num_features": 12, "temperature": 8.0},
    }
    cfg = TransformerConfig(vocab_size=11, block_size=32, n_layer=1, n_head=2, n_embd=16,
                            **options)  # fmt: skip
    block = TransformerLM(cfg).blocks[0]
    assert block.attn.feature_map.feature_dim == 12
    assert block.local_attn is not None and block.local_attn.window == 8
    assert config_options("psf_random", chunk_size=4) == {
        "chunk_size": 4, "attention": "psf_random", "map_kwargs": {}
    }  # fmt: skip


def test_mqar_sweep_reads_specs_with_the_same_parser():
    assert mqar_sweep.parse_attention is parse_attention
    assert mqar_sweep.MODEL_KEYS is MODEL_KEYS
    assert parse_attention("taylor:qk_dim=16,degree=2") == ("taylor", {"qk_dim": 16}, {"degree": 2})
