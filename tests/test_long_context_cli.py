"""benchmarks/long_context.py: every sub-command in smoke mode, resumption, errors."""

import csv

import long_context
import pytest
import torch

from polysketch.eval import mqar_sweep
from polysketch.nn import TransformerConfig
from polysketch.train import TrainConfig, load_model, train

SMOKE = {
    "retrieval": ["--attentions", "softmax", "psf_random", "hedgehog", "taylor"],
    "repeat": ["--attentions", "softmax", "psf_mixed", "--probe-every", "1"],
    "positions": ["--attentions", "softmax", "psf_mixed"],
    "mqar": [],
    "timing": ["--attentions", "softmax", "psf_random"],
}


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("command", list(SMOKE))
def test_subcommand_smoke_writes_tables_and_resumes(command, tmp_path, capsys):
    out = tmp_path / command
    argv = [command, "--smoke", "--no-progress", "--out", str(out), *SMOKE[command]]
    assert long_context.main(argv) == 0
    for suffix in ("csv", "md", "png"):
        assert (out / f"{command}.{suffix}").stat().st_size > 0
    rows = _rows(out / f"{command}.csv")
    assert rows
    md = (out / f"{command}.md").read_text()
    assert "long_context.py " + command in md and "CPU" in md
    if command == "repeat":
        by = {r["attention"]: r for r in rows}
        assert by["psf_mixed"]["ablated_drop"] != "" and by["softmax"]["ablated_drop"] == ""
        curve = _rows(out / "repeat_curve.csv")  # probed after steps 1, 2 and at the end (3)
        assert sorted((r["attention"], int(r["step"])) for r in curve) == sorted(
            (a, s) for a in ("softmax", "psf_mixed") for s in (1, 2, 3)
        )
        final = next(r for r in curve if r["attention"] == "softmax" and r["step"] == "3")
        assert final["drop"] == by["softmax"]["drop"]
    capsys.readouterr()
    # a finished table: --reuse measures nothing new; without it the CSV is not overwritten
    assert long_context.main([*argv, "--reuse"]) == 0
    assert _rows(out / f"{command}.csv") == rows
    assert long_context.main(argv) == 2
    assert f"long_context.py {command}: error:" in capsys.readouterr().err


def test_retrieval_on_qk_captured_from_a_trained_model(tmp_path):
    cfg = TransformerConfig(n_layer=1, n_head=2, n_embd=32, block_size=32, attention="polynomial")
    run = tmp_path / "model"
    data_source = pytest.importorskip("polysketch.data.corpus")
    try:
        corpus = data_source.load_corpus("shakespeare", max_bytes=200_000)
    except FileNotFoundError:
        pytest.skip("the Shakespeare corpus is not prepared")
    train(cfg, TrainConfig(steps=2, batch_size=2, warmup_steps=0, eval_interval=None,
                           eval_batches=1, out_dir=str(run)), corpus, progress=False)  # fmt: skip
    out = tmp_path / "ret"
    argv = ["retrieval", "--smoke", "--no-progress", "--out", str(out), "--inputs", "gaussian",
            "captured", "--checkpoint", str(run / "ckpt.pt"), "--attentions", "softmax",
            "hedgehog", "--draws", "1"]  # fmt: skip
    assert long_context.main(argv) == 0
    rows = _rows(out / "retrieval.csv")
    heads = {r["head"] for r in rows if r["input"] == "captured"}
    assert heads == {"layer 0 head 0", "layer 0 head 1"}
    assert "after the q/k LayerNorm and RoPE" in (out / "retrieval.md").read_text()


def test_retrieval_measures_a_trained_models_own_maps(tmp_path, capsys):
    """--trained: every layer/head map of a trained soft_hash model, as trained (its rows
    equal match_weights of that head's map; a model without feature maps is refused)."""
    import torch
    from experiments.long_context.inputs import layer_norm_gaussian, near_queries
    from experiments.long_context.retrieval import FeatureKernel, match_weights

    from polysketch.data.corpus import Corpus
    from polysketch.random import make_generator
    from polysketch.train import load_model

    tokens = torch.randint(0, 256, (6000,), generator=torch.Generator().manual_seed(0))
    corpus = Corpus(train=tokens[:5000], val=tokens[5000:], vocab_size=256, source="test")
    runs = {}
    every = {"local_window": 4, "global_every": 2}  # layer 1 only: layer 0 is the window
    for name, attention, kw in (("hash", "soft_hash_1k", {}), ("poly", "polynomial", {}),
                                ("every", "soft_hash_1k", every)):  # fmt: skip
        cfg = TransformerConfig(n_layer=2, n_head=2, n_embd=32, block_size=32,
                                attention=attention, map_kwargs={"num_features": 12}
                                if attention == "soft_hash_1k" else {}, **kw)  # fmt: skip
        runs[name] = tmp_path / name
        tc = TrainConfig(steps=3, batch_size=2, warmup_steps=0, lr=3e-2, eval_interval=None,
                         eval_batches=1, out_dir=str(runs[name]))  # fmt: skip
        train(cfg, tc, corpus, progress=False)
    out = tmp_path / "ret"
    argv = ["retrieval", "--smoke", "--no-progress", "--out", str(out), "--attentions", "softmax",
            "--trained", str(runs["hash"] / "ckpt.pt"), "--draws", "1"]  # fmt: skip
    assert long_context.main(argv) == 0
    rows = _rows(out / "retrieval.csv")
    names = sorted({r["attention"] for r in rows if r["attention"].startswith("trained:")})
    assert names == [f"trained:hash:layer{i}.head{h}" for i in (0, 1) for h in (0, 1)]
    model = load_model(runs["hash"] / "ckpt.pt", "cpu")[0]
    fmap = model.blocks[1].attn.feature_map.head_map(0).double()
    assert abs(fmap.temperature - 4.0) > 1e-4  # trained (lr 3e-2), not the init's τ
    kernel = FeatureKernel(fmap, offset=0.0)
    row = next(r for r in rows if r["attention"] == "trained:hash:layer1.head0" and r["t"] == "64")
    keys = layer_norm_gaussian(64, 16, generator=make_generator(0), dtype=torch.float64)
    match = torch.randperm(64, generator=make_generator(1_000_003 * 0 + 1009 * 0 + 64))[:8]
    others = layer_norm_gaussian(8, 16, generator=make_generator(1), dtype=torch.float64)
    w = match_weights(kernel, near_queries(keys[match], 1.0, others), keys, match)
    assert row["feature_dim"] == "12"
    assert 0 < float(row["w_match"]) <= 1 and abs(float(row["w_match"]) - float(w.mean())) < 1e-9
    bad = ["retrieval", "--smoke", "--no-progress", "--out", str(tmp_path / "bad"),
           "--trained", str(runs["poly"] / "ckpt.pt")]  # fmt: skip
    assert long_context.main(bad) == 2
    assert "has no feature map" in capsys.readouterr().err
    argv = ["retrieval", "--smoke", "--no-progress", "--out", str(tmp_path / "every"),
            "--trained", str(runs["every"] / "ckpt.pt"), "--draws", "1"]  # fmt: skip
    assert long_context.main(argv) == 0  # global_every: the window-only layer 0 is skipped
    rows = _rows(tmp_path / "every" / "retrieval.csv")
    names = sorted({r["attention"] for r in rows if r["attention"].startswith("trained:")})
    assert names == ["trained:every:layer1.head0", "trained:every:layer1.head1"]


def test_bad_options_print_an_error_and_exit_2(tmp_path, capsys):
    base = ["--smoke", "--no-progress", "--out", str(tmp_path / "x")]
    assert long_context.main(["retrieval", *base, "--inputs", "captured"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert long_context.main(["retrieval", *base, "--attentions", "psf_mixed"]) == 2
    assert "position-free" in capsys.readouterr().err
    assert long_context.main(["timing", *base, "--sizes", "4by128"]) == 2
    assert "--sizes" in capsys.readouterr().err
    assert long_context.main(["mqar", *base, "--min-distance", "40"]) == 2
    assert "min_distance" in capsys.readouterr().err


def test_mqar_estimate_projects_a_run(tmp_path):
    out = tmp_path / "est"
    argv = ["mqar", "--smoke", "--estimate", "--estimate-steps", "1", "--out", str(out),
            "--attentions", "softmax"]  # fmt: skip
    assert long_context.main(argv) == 0
    assert "hours for" in (out / "estimate.md").read_text()


def test_mqar_save_models_keeps_each_trained_model(tmp_path):
    """``--save-models DIR``: each run's last stage leaves a checkpoint that loads back as the
    model it scored (the same validation loss); the curriculum screen's stage is recorded."""
    out, saved = tmp_path / "cur", tmp_path / "models"
    argv = ["mqar", "--smoke", "--no-progress", "--setting", "curriculum256", "--out", str(out),
            "--attentions", "taylor:qk_dim=4", "--lrs", "0.003",
            "--save-models", str(saved)]  # fmt: skip
    assert long_context.main(argv) == 0
    (row,) = _rows(out / "mqar.csv")
    assert row["setting"] == "curriculum256" and row["curriculum_accuracy"].startswith("T16:")
    run = saved / mqar_sweep.run_name("taylor:qk_dim=4", 0.003)
    assert run.name == "taylor_qk_dim=4_lr0.003"
    model, state = load_model(run / "ckpt.pt", device="cpu")
    assert model.config.attention == "taylor" and model.config.qk_dim == 4
    assert state["step"] == int(row["steps"])
    settings = {**mqar_sweep.QUICK, "seq_len": 32, "num_kv_pairs": 2, "min_distance": 16}
    data = mqar_sweep.make_data(settings, seed=0)
    with torch.no_grad():  # the whole validation set (64 rows) is the run's one evaluation
        loss = float(model(data.val_inputs, data.val_targets)[1])
    # the same float32 sums batched otherwise: eps 1.2e-7 × a few hundred terms
    assert loss == pytest.approx(float(row["val_loss"]), rel=1e-4)


def test_mqar_curriculum_setting_reports_each_stage(tmp_path):
    """``--setting long_curriculum`` trains its stages first and records their recall; the
    estimate counts their steps too."""
    out = tmp_path / "cur"
    argv = ["mqar", "--smoke", "--no-progress", "--setting", "long_curriculum", "--out",
            str(out), "--attentions", "softmax"]  # fmt: skip
    assert long_context.main(argv) == 0
    (row,) = _rows(out / "mqar.csv")
    assert row["setting"] == "long_curriculum" and row["curriculum_accuracy"].startswith("T16:")
    argv = ["mqar", "--smoke", "--setting", "long_curriculum", "--estimate", "--estimate-steps",
            "1", "--out", str(tmp_path / "est"), "--attentions", "softmax"]  # fmt: skip
    assert long_context.main(argv) == 0
    assert "and the curriculum" in (tmp_path / "est" / "estimate.md").read_text()


def test_flush_denormals_turns_subnormal_floats_to_zero_for_the_run(tmp_path):
    """``--flush-denormals`` (any sub-command) sets torch's flush-to-zero for the process:
    a sharp soft hash's probabilities below fp32's smallest normal (1.2e-38) become 0."""
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert float(tiny * 1.0) > 0  # subnormals kept by default
    try:
        argv = ["mqar", "--smoke", "--no-progress", "--out", str(tmp_path), "--flush-denormals"]
        assert long_context.main(argv) == 0
        assert float(tiny * 1.0) == 0.0
    finally:
        torch.set_flush_denormal(False)
    assert float(tiny * 1.0) > 0
