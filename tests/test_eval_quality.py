"""``experiments.quality``: the comparison driver of ``python -m experiments.quality``."""

import pytest
from experiments.quality import compare, quality_table, remedy_attentions

from polysketch.data.corpus import load_corpus
from polysketch.nn.resolve import valid_attentions
from polysketch.nn.transformer import TransformerConfig
from polysketch.train.loop import TrainConfig


@pytest.fixture(scope="module")
def setup():
    corpus = load_corpus("shakespeare", max_bytes=20_000)
    model = TransformerConfig(vocab_size=corpus.vocab_size, block_size=16, n_layer=1,
                              n_head=2, n_embd=16, chunk_size=8, seed=0)  # fmt: skip
    train = TrainConfig(steps=3, batch_size=2, block_size=16, warmup_steps=1,
                        eval_interval=3, eval_batches=1, seed=0)  # fmt: skip
    return corpus, model, train


def test_remedies_name_valid_attentions_and_warm_steps():
    remedies = remedy_attentions(300, warm_fraction=0.3)
    assert {spec[0] for spec in remedies.values()} <= set(valid_attentions())
    assert remedies["psf_random_r128+warm"] == ("psf_random", {"num_features": 128},
                                                {"warm_start_steps": 90})  # fmt: skip
    assert remedies["psf_random_no_qk_norm"][3] == {"qk_norm": False}


def test_compare_applies_train_and_model_overrides(setup):
    corpus, model, train = setup
    labels = {
        "plain": ("psf_random", {}),
        "no_norm+warm": ("psf_random", {}, {"warm_start_steps": 2}, {"qk_norm": False}),
    }
    results = compare(labels, corpus, model, train, progress=False, log=None)
    plain, other = results["plain"], results["no_norm+warm"]
    assert plain["train_overrides"] == {} and plain["model_overrides"] == {}
    assert other["train_overrides"] == {"warm_start_steps": 2}
    assert other["model_overrides"] == {"qk_norm": False}
    # the q/k LayerNorms (2 × (weight + bias) of the head dim 8) are gone
    assert plain["params"] - other["params"] == 2 * 2 * 8
    assert [row["step"] for row in other["val"]] == [3]
    assert [r["attention"] for r in quality_table(results)] == ["plain", "no_norm+warm"]


def test_compare_rejects_unknown_attention(setup):
    corpus, model, train = setup
    with pytest.raises(ValueError, match="attentions: unknown"):
        compare({"x": ("nope", {})}, corpus, model, train, progress=False, log=None)
