"""The training loop: exact resume, atomic checkpoints, accumulation, metrics, data, errors."""

import csv
import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F

from polysketch.data.corpus import load_corpus
from polysketch.data.mqar import MQARConfig
from polysketch.nn import TransformerConfig, TransformerLM
from polysketch.train import (
    CorpusBatches,
    MQARBatches,
    MQARData,
    TrainConfig,
    load_checkpoint,
    param_groups,
    train,
)

TEXT = "".join(f"line {i}: the quick brown fox jumps over {i % 7} lazy dogs.\n" for i in range(80))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT)
    return load_corpus(path)


def tiny_model(**kw):
    base = dict(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16, chunk_size=8)
    return TransformerConfig(**{**base, **kw})


def tiny_train(out_dir=None, **kw):
    base = dict(steps=6, batch_size=4, lr=1e-2, min_lr=1e-3, warmup_steps=2, eval_interval=2,
                eval_batches=2, log_interval=2)  # fmt: skip
    base["out_dir"] = None if out_dir is None else str(out_dir)
    return TrainConfig(**{**base, **kw})


def _losses(history):
    return torch.tensor([r["loss"] for r in history["train"]], dtype=torch.float64)


def _metric_rows(out_dir):
    with open(out_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return [(r["step"], r["split"], r["loss"], r["accuracy"], r["lr"]) for r in rows]


@pytest.mark.parametrize(
    "attention, extra", [("polysketch", {}), ("llops", {"dropout": 0.1, "grad_accum": 2})]
)
def test_resume_is_bitwise_identical_to_a_straight_run(tmp_path, corpus, attention, extra):
    """N steps, checkpoint, resume, N steps == 2N straight steps (losses and parameters)."""
    dropout = extra.get("dropout", 0.0)
    mc = tiny_model(attention=attention, dropout=dropout)
    kw = {k: v for k, v in extra.items() if k != "dropout"}
    straight = train(mc, tiny_train(tmp_path / "a", **kw), corpus, progress=False)
    first = train(mc, tiny_train(tmp_path / "b", **kw), corpus, progress=False, stop_after=3)
    assert len(first["train"]) == 3
    torch.manual_seed(1234)  # resume must not depend on the caller's RNG state
    resumed = train(mc, tiny_train(tmp_path / "b", **kw), corpus, progress=False, resume=True)
    assert torch.equal(_losses(resumed), _losses(straight))
    assert torch.equal(_losses(first), _losses(straight)[:3])
    assert [v["loss"] for v in resumed["val"]] == [v["loss"] for v in straight["val"]]
    sa, sb = straight["model"].state_dict(), resumed["model"].state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    # the metric files are rewritten from the checkpoint's history: no duplicated rows
    assert _metric_rows(tmp_path / "a") == _metric_rows(tmp_path / "b")
    # and the losses actually moved (the test compares real training, not a no-op)
    assert straight["train"][-1]["loss"] < straight["train"][0]["loss"]


def test_a_run_saved_before_a_config_field_existed_resumes(tmp_path, corpus):
    """A checkpoint whose configs lack fields added since (``local_window``, ``local_shared``,
    ``pack``) resumes as the same run with those fields at their defaults; a field that
    differs is still refused."""
    from polysketch.train import CheckpointError, save_checkpoint, saved_config

    mc = tiny_model(attention="psf_random")
    straight = train(mc, tiny_train(tmp_path / "a"), corpus, progress=False)
    train(mc, tiny_train(tmp_path / "b"), corpus, progress=False, stop_after=3)
    path = tmp_path / "b" / "ckpt.pt"
    state = load_checkpoint(path, restore_rng=False)
    assert state["model_config"].pop("local_window") is None
    assert state["model_config"].pop("local_shared") is None
    assert state["train_config"].pop("pack") is False
    save_checkpoint(path, state)
    old = load_checkpoint(path, restore_rng=False)
    filled = saved_config(TransformerConfig, old["model_config"])
    assert filled["local_window"] is None and filled["local_shared"] is None
    resumed_config = TransformerConfig(**old["model_config"])  # as `train --resume` builds it
    resumed = train(resumed_config, tiny_train(tmp_path / "b"), corpus, progress=False,
                    resume=True)  # fmt: skip
    assert torch.equal(_losses(resumed), _losses(straight))
    train(mc, tiny_train(tmp_path / "c"), corpus, progress=False, stop_after=3)
    with pytest.raises(CheckpointError, match="model_config differs"):
        train(tiny_model(attention="psf_random", local_window=4), tiny_train(tmp_path / "c"),
              corpus, progress=False, resume=True)  # fmt: skip


def test_a_presets_surrogate_lambda_is_stored_so_a_changed_preset_resumes_the_run(
    tmp_path, corpus, monkeypatch
):
    """A model preset's training-only ``gradient_surrogate`` λ is written out in the
    checkpoint (``stored_model_config``): when the preset's λ changes later, resuming from the
    checkpoint's config continues bit-for-bit with the λ the run was trained with, and a
    config that leaves λ to the (changed) preset is refused; a checkpoint that stored None
    (written before λ was stored) takes the current preset's."""
    from polysketch.nn.presets import MODEL_PRESETS
    from polysketch.train import CheckpointError, save_checkpoint

    mc = tiny_model(attention="soft_hash_far_local", map_kwargs={"num_features": 32})
    trained_with = mc.resolve().attention.gradient_surrogate
    assert mc.gradient_surrogate is None and trained_with > 0
    straight = train(mc, tiny_train(tmp_path / "a"), corpus, progress=False)
    train(mc, tiny_train(tmp_path / "b"), corpus, progress=False, stop_after=3)
    path = tmp_path / "b" / "ckpt.pt"
    saved = load_checkpoint(path, restore_rng=False)["model_config"]
    assert saved["gradient_surrogate"] == trained_with
    changed = dataclasses.replace(MODEL_PRESETS["soft_hash_far_local"], gradient_surrogate=1000.0)
    monkeypatch.setitem(MODEL_PRESETS, "soft_hash_far_local", changed)
    with pytest.raises(CheckpointError, match="model_config differs"):
        train(mc, tiny_train(tmp_path / "b"), corpus, progress=False, resume=True)
    resumed = train(TransformerConfig(**saved), tiny_train(tmp_path / "b"), corpus,
                    progress=False, resume=True)  # fmt: skip
    assert torch.equal(_losses(resumed), _losses(straight))
    # λ = 1000 would have trained another run: the comparison above can fail
    other = train(mc, tiny_train(tmp_path / "c"), corpus, progress=False)
    assert not torch.equal(_losses(other), _losses(straight))
    # a checkpoint that stored None resumes under the current preset's λ
    train(mc, tiny_train(tmp_path / "d"), corpus, progress=False, stop_after=3)
    state = load_checkpoint(tmp_path / "d" / "ckpt.pt", restore_rng=False)
    state["model_config"]["gradient_surrogate"] = None
    save_checkpoint(tmp_path / "d" / "ckpt.pt", state)
    old = train(TransformerConfig(**state["model_config"]), tiny_train(tmp_path / "d"), corpus,
                progress=False, resume=True)  # fmt: skip
    assert torch.equal(_losses(old), _losses(other))


def test_failing_save_leaves_previous_checkpoint_intact(tmp_path, corpus, monkeypatch):
    out = tmp_path / "run"
    mc = tiny_model()
    cfg = tiny_train(out, steps=4, checkpoint_interval=2)
    real_save = torch.save
    calls = {"n": 0}

    def flaky_save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the step-4 checkpoint: write some bytes, then die
            f.write(b"partial garbage")
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", flaky_save)
    with pytest.raises(OSError, match="disk full"):
        train(mc, cfg, corpus, progress=False)
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(os.listdir(out)) == ["ckpt.pt", "metrics.csv", "metrics.jsonl"]  # no temp file
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    assert state["step"] == 2
    # the surviving checkpoint resumes into the same run as a straight one
    resumed = train(mc, cfg, corpus, progress=False, resume=True)
    straight = train(mc, tiny_train(tmp_path / "ref", steps=4), corpus, progress=False)
    assert torch.equal(_losses(resumed), _losses(straight))


def test_grad_accumulation_matches_one_big_batch(corpus):
    """Four micro-batches sum the gradient in another order than one batch. AdamW's first
    steps move each weight by about lr g/(|g| + eps), which turns a rounding difference in a
    gradient entry near 0 into a difference of up to lr in the weight: in fp32 that is a coin
    toss between BLAS paths, so the comparison runs in fp64 (model and optimizer), where the
    same amplification (lr/eps = 1e6) leaves ~1e-10."""
    torch.set_default_dtype(torch.float64)
    try:
        mc = tiny_model()
        one = train(mc, tiny_train(steps=3), corpus, progress=False)
        acc = train(mc, tiny_train(steps=3, grad_accum=4), corpus, progress=False)
    finally:
        torch.set_default_dtype(torch.float32)
    assert next(one["model"].parameters()).dtype == torch.float64
    torch.testing.assert_close(_losses(acc), _losses(one), rtol=1e-12, atol=0)
    for (name, a), b in zip(
        acc["model"].named_parameters(), one["model"].parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


def test_metrics_files_and_checkpoint_contents(tmp_path, corpus):
    out = tmp_path / "run"
    h = train(tiny_model(), tiny_train(out, steps=5), corpus, progress=False, metadata={"x": 1})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if r["split"] == "train"]
    val_steps = [r["step"] for r in rows if r["split"] == "val"]
    assert train_steps == [2, 4, 5]  # every log_interval and the last step
    assert val_steps == [2, 4, 5]
    assert len(_metric_rows(out)) == len(rows)
    assert [r["loss"] for r in rows if r["split"] == "train"] == [
        h["train"][s - 1]["loss"] for s in train_steps
    ]
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    assert {"model", "optimizer", "scheduler", "data", "rng", "step", "history"} <= set(state)
    assert state["step"] == 5 and state["metadata"] == {"x": 1}
    assert state["model_config"]["attention"] == "polysketch"
    # the feature maps' random buffers are part of the saved model
    buffers = dict(h["model"].named_buffers())
    assert buffers and all(torch.equal(state["model"][k], v) for k, v in buffers.items())


def test_bf16_autocast_trains_close_to_fp32(corpus):
    fp32 = train(tiny_model(), tiny_train(steps=2), corpus, progress=False)
    bf16 = train(tiny_model(), tiny_train(steps=2, amp="bf16"), corpus, progress=False)
    first32, first16 = fp32["train"][0]["loss"], bf16["train"][0]["loss"]
    assert first16 != first32  # autocast was really on
    assert abs(first16 - first32) < 2e-2 * first32


def test_param_groups_skip_norms_biases_embeddings():
    model = TransformerLM(tiny_model(attention="psf_learned"))
    decay, plain = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    skipped = {names[id(p)] for p in plain["params"]}
    assert decay["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert decayed.isdisjoint(skipped) and decayed | skipped == set(names.values())
    assert "wte.weight" in skipped and "blocks.0.ln_1.weight" in skipped
    assert "blocks.0.attn.qkv.weight" in decayed and "blocks.0.ffn.up.weight" in decayed
    assert not any("bias" in n or "norm" in n for n in decayed)  # incl. stacked per-head ones
    assert any("feature_map" in n for n in decayed)  # learned sketch matrices are decayed


def test_corpus_batches_are_shifted_blocks_and_resume():
    tokens = torch.arange(100)
    b = CorpusBatches(tokens, 8, seed=3)
    x, y = b.next(5)
    assert x.shape == y.shape == (5, 8)
    assert torch.equal(y, x + 1) and torch.equal(x[:, 1:], x[:, :-1] + 1)
    state = b.state_dict()
    want = b.next(5)
    b2 = CorpusBatches(tokens, 8, seed=99)
    b2.load_state_dict(state)
    assert all(torch.equal(a, c) for a, c in zip(b2.next(5), want, strict=True))
    with pytest.raises(ValueError, match="block_size"):
        CorpusBatches(torch.arange(5), 8, seed=0)


def test_mqar_batches_visit_each_example_once_per_epoch():
    inputs = torch.arange(10)[:, None].repeat(1, 3)
    b = MQARBatches(inputs, inputs, seed=0)
    seen = torch.cat([b.next(4)[0][:, 0] for _ in range(5)])  # 20 = two epochs
    assert sorted(seen[:10].tolist()) == list(range(10))
    assert sorted(seen[10:].tolist()) == list(range(10))
    assert not torch.equal(seen[:10], seen[10:])  # a fresh permutation per epoch
    state = b.state_dict()
    want = b.next(7)[0]
    b2 = MQARBatches(inputs, inputs, seed=5)
    b2.load_state_dict(state)
    assert torch.equal(b2.next(7)[0], want)


def test_mqar_training_reports_recall_accuracy():
    task = MQARConfig(vocab_size=32, seq_len=16, num_kv_pairs=2)
    data = MQARData.make(task, num_train=32, num_val=24, seed=0)
    mc = tiny_model(vocab_size=32, attention="elu")
    h = train(mc, tiny_train(steps=2, batch_size=8), data, progress=False)
    with torch.no_grad():
        logits, _ = h["model"](data.val_inputs)
    mask = data.val_targets != -100
    acc = (logits.argmax(-1)[mask] == data.val_targets[mask]).double().mean().item()
    loss = F.cross_entropy(logits.flatten(0, 1), data.val_targets.flatten(), ignore_index=-100)
    assert h["val"][-1]["accuracy"] == pytest.approx(acc, abs=1e-12)
    assert h["val"][-1]["loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_bad_configs_raise_naming_the_argument(tmp_path, corpus, monkeypatch):
    mc = tiny_model()
    for field, value in [("lr", -1.0), ("steps", 0), ("amp", "fp8"), ("grad_accum", 0)]:
        with pytest.raises((ValueError, TypeError), match=field):
            train(mc, tiny_train(**{field: value}), corpus, progress=False)
    with pytest.raises(ValueError, match="attention"):
        train(tiny_model(attention="no_such_map"), tiny_train(), corpus, progress=False)
    with pytest.raises(ValueError, match="vocab_size"):
        train(tiny_model(vocab_size=64), tiny_train(), corpus, progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        train(mc, tiny_train(batch_size=6, grad_accum=4), corpus, progress=False)
    monkeypatch.setenv("WORLD_SIZE", "2")  # checked before any process group is created
    with pytest.raises(ValueError, match="batch_size"):
        train(mc, tiny_train(batch_size=3), corpus, progress=False)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(FileNotFoundError, match="resume"):
        train(mc, tiny_train(tmp_path / "empty"), corpus, progress=False, resume=True)
    with pytest.raises(ValueError, match="block_size"):
        train(mc, tiny_train(block_size=10_000), corpus, progress=False)
    with pytest.raises(TypeError, match="data"):
        train(mc, tiny_train(), [1, 2, 3], progress=False)


def test_init_weights_start_the_run_from_given_weights(corpus):
    """A run from another model's weights continues from them (a curriculum's next stage);
    refused with resume, a non-dict, or weights of another model."""
    first = train(tiny_model(), tiny_train(steps=3, eval_interval=None), corpus, progress=False)
    ended = {k: v.clone() for k, v in first["model"].state_dict().items()}
    fresh = TransformerLM(tiny_model()).state_dict()
    assert any(not torch.equal(ended[k], fresh[k]) for k in ended)
    # lr ~ 0: the weights after one step are the ones given, not model_config.seed's
    tiny = tiny_train(steps=1, lr=1e-30, min_lr=1e-30, warmup_steps=0, eval_interval=None)
    second = train(tiny_model(), tiny, corpus, progress=False, init_weights=ended)
    after = second["model"].state_dict()
    assert all(torch.allclose(after[k], ended[k], atol=1e-12) for k in ended)
    # the optimizer starts fresh: its first step is AdamW's first step from these weights
    model = TransformerLM(tiny_model())
    model.load_state_dict(ended)
    step = train(tiny_model(), tiny_train(steps=1, warmup_steps=0, eval_interval=None), corpus,
                 progress=False, init_weights=ended)  # fmt: skip
    x, y = CorpusBatches(corpus.train, 16, 0).next(4)
    torch.manual_seed(0)
    assert step["train"][0]["loss"] == pytest.approx(model(x, y)[1].item(), rel=1e-6)
    with pytest.raises(ValueError, match="init_weights and resume"):
        train(tiny_model(), tiny, corpus, progress=False, init_weights=ended, resume=True)
    with pytest.raises(TypeError, match="init_weights must be a state dict"):
        train(tiny_model(), tiny, corpus, progress=False, init_weights=first["model"])
    with pytest.raises(ValueError, match="init_weights do not fit"):
        train(tiny_model(n_embd=32), tiny, corpus, progress=False, init_weights=ended)


def test_a_warmup_as_long_as_the_run_is_warned_about(corpus):
    from polysketch.train.loop import WarmupWarning

    with pytest.warns(WarmupWarning, match=r"warmup_steps=5 >= steps=3"):
        train(tiny_model(), tiny_train(steps=3, warmup_steps=5, eval_interval=None), corpus,
              progress=False)  # fmt: skip


def test_out_of_memory_names_the_batch_and_writes_no_metrics(tmp_path, corpus, monkeypatch):
    from polysketch.train import loop

    def step(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8")

    monkeypatch.setattr(loop, "_optimizer_step", step)
    out = tmp_path / "run"
    with pytest.raises(loop.TrainingOutOfMemoryError, match="batch size 4 x block size 16"):
        train(tiny_model(), tiny_train(out, grad_accum=2), corpus, progress=False)
    assert not out.exists() or not any(out.iterdir())  # no header-only metrics files
    # other runtime errors are not relabelled
    monkeypatch.setattr(loop, "_optimizer_step", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("shape mismatch")))  # fmt: skip
    with pytest.raises(RuntimeError, match="shape mismatch"):
        train(tiny_model(), tiny_train(out), corpus, progress=False)


def test_header_lines_go_to_log(corpus):
    lines = []
    train(tiny_model(), tiny_train(steps=1, warmup_steps=0, eval_interval=None), corpus,
          progress=False, log=lines.append)  # fmt: skip
    assert any("parameters" in line for line in lines)
    assert any("64 tokens per step" in line for line in lines)
