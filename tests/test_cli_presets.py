"""Every command that takes an attention runs every name of ``PRESETS`` and ``MODEL_PRESETS``
as named (tiny shapes): ``bench --model``, ``bench --decode``, ``train``, ``mqar`` and
``linearize``. Two presets cannot run alone and say so, naming what they need: ``sliding_window``
(its window, ``window=w``) and ``soft_hash_far`` (an exact window beside it: the model preset
``soft_hash_far_local``). ``linearize`` converts a transformers model layer by layer, which has
no window branch: it takes the attention presets, not the model presets. The model preset
``soft_hash_far_local`` carries the block its window needs (chunk 64), so ``bench --model``,
whose default block is 256, runs it as named (issue 39 §4)."""

import pytest

from polysketch.cli import main
from polysketch.nn import MODEL_PRESETS, PRESETS

NAMES = [*PRESETS, *MODEL_PRESETS]
NEEDS = {"sliding_window": "window", "soft_hash_far": "window"}
"""Presets that cannot run without an option, and a word their refusal must contain."""
TEXT = "".join(f"To be, or not to be: that is question {i}.\n" for i in range(40))
TINY_TRAIN = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
              "--batch-size", "2", "--eval-batches", "1", "--steps", "1",
              "--no-progress"]  # fmt: skip


def _run(argv, capsys, name):
    """Run ``argv``; assert it ran (0) or, for a preset of ``NEEDS``, refused with exit 2 and
    an ``error:`` line naming what it needs."""
    rc = main(argv)
    err = capsys.readouterr().err
    if name in NEEDS:
        assert rc == 2, err
        assert "error:" in err and NEEDS[name] in err
    else:
        assert rc == 0, err


@pytest.mark.parametrize("name", NAMES)
def test_bench_model(name, tmp_path, capsys):
    _run(["bench", "--model", "--quick", "--lengths", "32", "--no-progress", "--attentions",
          name, "--out", str(tmp_path / "o")], capsys, name)  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_bench_decode(name, tmp_path, capsys):
    _run(["bench", "--decode", "--quick", "--decode-positions", "16", "--attentions", name,
          "--out", str(tmp_path / "o")], capsys, name)  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_train(name, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    _run(["train", "--corpus", str(corpus), "--attention", name, "--out", str(tmp_path / "o"),
          *TINY_TRAIN], capsys, name)  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_mqar(name, tmp_path, capsys):
    _run(["mqar", "--quick", "--steps", "2", "--attentions", name, "--out",
          str(tmp_path / "o")], capsys, name)  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_linearize(name, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "base")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    argv = ["linearize", "--model", str(tmp_path / "base"), "--attention", name, "--data",
            str(corpus), "--out", str(tmp_path / "o"), "--seq-len", "16", "--batch-size", "2",
            "--transfer-steps", "1", "--finetune", "none", "--eval-batches", "1",
            "--chunk-size", "8"]  # fmt: skip
    _run(argv, capsys, name)  # model presets too: a window branch beside the global one


def test_the_options_the_two_refusals_name_make_them_run(tmp_path, capsys):
    """sliding_window with its window, soft_hash_far with an exact window of >= its block."""
    for spec in ("sliding_window:window=8", "soft_hash_far:local_window=16,chunk_size=16"):
        argv = ["bench", "--model", "--quick", "--lengths", "32", "--no-progress",
                "--attentions", spec, "--out", str(tmp_path / spec.split(":")[0])]  # fmt: skip
        assert main(argv) == 0, capsys.readouterr().err


def test_bench_model_takes_the_block_from_the_spec_unless_given(tmp_path, capsys):
    import csv

    out = tmp_path / "o"
    argv = ["bench", "--model", "--quick", "--lengths", "128", "--no-progress",
            "--attentions", "psf_random,soft_hash_far_local", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    with (out / "model_results.csv").open() as fh:
        chunks = {r["attention"]: r["chunk_size"] for r in csv.DictReader(fh)}
    # what a TransformerLM of each runs: the one default, and the preset's own block
    assert chunks == {"psf_random": "64", "soft_hash_far_local": "64"}
    assert main([*argv[:-4], "--attentions", "psf_random:chunk_size=32,soft_hash_far_local",
                 "--out", str(out), "--overwrite"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "chunk (psf_random:chunk_size=32 32, soft_hash_far_local 64)" in printed
    # an explicit block longer than the preset's window is the user's word: refused, named
    assert main([*argv, "--chunk-size", "256", "--overwrite"]) == 2
    assert "chunk_size=256" in capsys.readouterr().err


# ----- the settings a preset needs have a path from the CLI (issue 43 item 2) --------------------
WITH_NEEDS = {
    "sliding_window": ["--window", "4"],
    "soft_hash_far": ["--local-window", "8", "--chunk-size", "8"],
}


@pytest.mark.parametrize("name", sorted(WITH_NEEDS))
def test_train_runs_each_preset_that_needs_an_option_with_it(name, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    rc = main(["train", "--corpus", str(corpus), "--attention", name, *WITH_NEEDS[name],
               "--out", str(tmp_path / "o"), *TINY_TRAIN])  # fmt: skip
    assert rc == 0, capsys.readouterr().err


def test_a_window_given_as_a_map_keyword_is_refused_naming_the_option(tmp_path, capsys):
    """Before: ``--map-kw window=32`` failed with "KernelAttention() got multiple values for
    keyword argument 'window'"."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    rc = main(["train", "--corpus", str(corpus), "--attention", "sliding_window", "--map-kw",
               "window=4", "--out", str(tmp_path / "o"), *TINY_TRAIN])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "error:" in err and "--window W" in err
