"""Repeat probe, global-part ablation and position losses (experiments/long_context)."""

import math

import pytest
import torch
from experiments.long_context.positions import (
    bucket_edges,
    bucket_losses,
    document_windows,
    position_losses,
    validation_documents,
)
from experiments.long_context.repeat_probe import probe_model, split_losses, token_losses
from torch import nn

from polysketch.data.repeat import RepeatConfig, make_repeat
from polysketch.nn import TransformerConfig, TransformerLM
from polysketch.nn.ablate import ablate_global, global_parts


class CopyOracle(nn.Module):
    """Predicts token x[i + 1 − d] at position i (confidently), uniform where i + 1 < d."""

    def __init__(self, distance: int, vocab: int = 256):
        super().__init__()
        self.distance, self.vocab = distance, vocab

    def forward(self, idx):
        b, t = idx.shape
        logits = torch.zeros(b, t, self.vocab)
        for i in range(self.distance - 1, t):
            logits[torch.arange(b), i, idx[:, i + 1 - self.distance]] = 60.0
        return logits, None


class Uniform(nn.Module):
    def forward(self, idx):
        return torch.zeros(*idx.shape, 256), None


def test_split_losses_average_the_masked_positions():
    losses = torch.arange(10.0).repeat(3, 1)
    first = torch.zeros(10, dtype=torch.bool)
    second = torch.zeros(10, dtype=torch.bool)
    first[[1, 2, 3]] = True
    second[[7, 9]] = True
    assert split_losses(losses, first, second) == (2.0, 8.0, -6.0)
    with pytest.raises(ValueError, match="masks"):
        split_losses(losses, first[:5], second)
    with pytest.raises(ValueError, match="at least one"):
        split_losses(losses, first, torch.zeros(10, dtype=torch.bool))


def test_probe_scores_a_copying_model_on_the_right_positions():
    # one unit: passage of 12 letters at 0 and again at 20; the oracle copies from 20 back
    cfg = RepeatConfig(seq_len=40, passage_len=12, distance=20)
    factual = make_repeat(cfg, 3, seed=0)
    counter = make_repeat(cfg, 3, seed=0, counterfactual=True)
    losses = token_losses(CopyOracle(20), factual.inputs, factual.targets, batch=2)
    assert losses.shape == (3, 40)
    row = probe_model(CopyOracle(20), factual, counter)
    assert abs(row["first"] - math.log(256)) < 1e-5  # uniform on first occurrences
    assert row["second"] < 1e-20 and abs(row["drop"] - math.log(256)) < 1e-5
    assert row["cf_drop"] < -10  # it copies the replaced text: confidently wrong
    assert row["ablated_second"] == row["ablated_drop"] == ""  # no global part
    uniform = probe_model(Uniform(), factual, counter)
    assert abs(uniform["drop"]) < 1e-6 and abs(uniform["cf_drop"]) < 1e-6


def test_ablation_is_refused_without_a_global_part():
    model = TransformerLM(TransformerConfig(n_layer=1, n_head=2, n_embd=16, attention="softmax"))
    assert not global_parts(model)
    with pytest.raises(ValueError, match="global part"):
        with ablate_global(model):
            pass
    mixed = TransformerLM(TransformerConfig(n_layer=2, n_head=2, n_embd=16, chunk_size=4,
                                            attention="psf_mixed"))  # fmt: skip
    assert len(global_parts(mixed)) == 2
    local = TransformerLM(TransformerConfig(n_layer=2, n_head=2, n_embd=16, local_window=4,
                                            attention="psf_random"))  # fmt: skip
    assert global_parts(local) == list(local.blocks)


def test_bucket_losses_and_edges():
    per_pos = torch.arange(16.0)
    assert bucket_edges(16, (0, 4, 8, 32)) == [0, 4, 8, 16]
    assert bucket_losses(per_pos, [0, 4, 8, 16]) == [(0, 4, 1.5), (4, 8, 5.5), (8, 16, 11.5)]
    with pytest.raises(ValueError, match="increasing"):
        bucket_losses(per_pos, [0, 8, 8])
    with pytest.raises(ValueError, match="edges"):
        bucket_losses(per_pos, [0, 20])


def test_document_windows_stay_inside_one_document_and_positions_average_windows(tmp_path):
    docs = [torch.arange(10, 40), torch.arange(0, 8), torch.arange(100, 160)]
    w = document_windows(docs, 20, 6, seed=0)
    assert w.shape == (6, 21)
    assert bool(((w[:, 1:] - w[:, :-1]) == 1).all())  # contiguous, never across documents
    assert {int(r[0]) >= 100 for r in w} == {False, True}  # both long documents used
    assert all(int(r[0]) >= 10 for r in w)  # the short one (0–7) skipped
    with pytest.raises(ValueError, match="no document"):
        document_windows(docs, 100, 2)
    per_pos = position_losses(Uniform(), w)
    assert per_pos.shape == (20,) and torch.allclose(per_pos, torch.full((20,), math.log(256)))
    for i, text in enumerate(["a" * 50, "b" * 30, "c" * 40]):
        (tmp_path / f"{i}.txt").write_text(text)
    # 124 bytes joined (two 2-byte separators); the last 40 % (49 bytes) start at byte 75:
    # "ccc…" (bytes 84–123) lies wholly inside, "bbb…" (52–81) straddles the split
    val = validation_documents(tmp_path, val_fraction=0.4)
    assert [bytes(d.tolist()).decode() for d in val] == ["c" * 40]


def _tiny_data():
    from polysketch.train import MQARData

    rs = make_repeat(RepeatConfig(seq_len=32, passage_len=8, distance=16), 8, seed=0)
    return MQARData(rs.inputs, rs.targets, rs.inputs[:2], rs.targets[:2], 256)


def test_train_model_reuses_a_finished_run_and_refuses_other_settings(tmp_path):
    from experiments.long_context.probe_training import ProbeSettings, train_model

    data = _tiny_data()
    settings = ProbeSettings(n_layer=1, n_embd=16, n_head=2, chunk_size=8, context=32,
                             batch_size=2, steps=4, warmup_steps=1)  # fmt: skip
    seen = []
    model, facts = train_model("psf_mixed", data, settings, tmp_path / "run", progress=False,
                               probe_every=2, on_probe=lambda m, s: seen.append(s))  # fmt: skip
    assert seen == [2] and facts["steps"] == 4 and not facts["reused"]
    again, facts2 = train_model("psf_mixed", data, settings, tmp_path / "run", progress=False)
    assert facts2["reused"] and facts2["steps"] == 4
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # segments resume exactly: the same run trained straight gives the same weights
    straight, _ = train_model("psf_mixed", data, settings, tmp_path / "straight", progress=False)
    for a, b in zip(model.state_dict().values(), straight.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="other settings"):
        train_model("psf_mixed", data, ProbeSettings(**{**vars(settings), "lr": 2e-3}),
                    tmp_path / "run", progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="another model"):
        train_model("softmax", data, settings, tmp_path / "run", progress=False)


def test_train_model_extends_a_constant_schedule_run_to_more_steps(tmp_path):
    """4 steps then extended to 6 == 6 steps straight (a constant schedule's learning rates do
    not depend on the total); a cosine run, or fewer steps, is refused."""
    from experiments.long_context.probe_training import ProbeSettings, train_model

    data = _tiny_data()
    short = ProbeSettings(n_layer=1, n_embd=16, n_head=2, chunk_size=8, context=32,
                          batch_size=2, steps=4, warmup_steps=1)  # fmt: skip
    long = ProbeSettings(**{**vars(short), "steps": 6})
    train_model("psf_random", data, short, tmp_path / "run", progress=False)
    seen = []
    extended, facts = train_model("psf_random", data, long, tmp_path / "run", progress=False,
                                  probe_every=1, on_probe=lambda m, s: seen.append(s))  # fmt: skip
    assert not facts["reused"] and facts["steps"] == 6 and seen == [5]
    straight, _ = train_model("psf_random", data, long, tmp_path / "straight", progress=False)
    for a, b in zip(extended.state_dict().values(), straight.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="constant-schedule run extends"):
        train_model("psf_random", data, short, tmp_path / "run", progress=False)  # fewer steps
    cosine = ProbeSettings(**{**vars(short), "schedule": "cosine"})
    train_model("psf_random", data, cosine, tmp_path / "cos", progress=False)
    with pytest.raises(ValueError, match="constant-schedule run extends"):
        train_model("psf_random", data, ProbeSettings(**{**vars(cosine), "steps": 6}),
                    tmp_path / "cos", progress=False)  # fmt: skip


def test_train_model_reuses_a_run_saved_before_a_config_field_existed(tmp_path):
    from experiments.long_context.probe_training import ProbeSettings, train_model

    from polysketch.train import CHECKPOINT_NAME, TrainConfig, load_checkpoint, save_checkpoint

    data = _tiny_data()
    settings = ProbeSettings(n_layer=1, n_embd=16, n_head=2, chunk_size=8, context=32,
                             batch_size=2, steps=2, warmup_steps=1)  # fmt: skip
    model, _ = train_model("psf_random", data, settings, tmp_path / "run", progress=False)
    path = next((tmp_path / "run").rglob(CHECKPOINT_NAME))
    state = load_checkpoint(path, restore_rng=False)
    # as written before these fields were added (they hold their defaults here)
    assert state["model_config"].pop("local_window") is None
    assert state["train_config"].pop("pack") == TrainConfig().pack
    save_checkpoint(path, state)
    again, facts = train_model("psf_random", data, settings, tmp_path / "run", progress=False)
    assert facts["reused"]
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    state["model_config"]["local_window"] = 4  # a field that differs is still another model
    save_checkpoint(path, state)
    with pytest.raises(ValueError, match="another model"):
        train_model("psf_random", data, settings, tmp_path / "run", progress=False)


def test_train_model_stops_where_on_probe_says_and_the_run_is_a_prefix(tmp_path):
    """on_probe returning True stops after that segment: the weights are those of the full
    run at that step (the schedule spans ``steps`` either way)."""
    from experiments.long_context.probe_training import ProbeSettings, train_model

    data = _tiny_data()
    settings = ProbeSettings(n_layer=1, n_embd=16, n_head=2, chunk_size=8, context=32,
                             batch_size=2, steps=6, warmup_steps=1, schedule="cosine")  # fmt: skip
    seen, at_two = [], {}

    def on_probe(model, step):
        seen.append(step)
        return step == 2

    stopped, facts = train_model("psf_random", data, settings, tmp_path / "stop", progress=False,
                                 probe_every=1, on_probe=on_probe)  # fmt: skip
    assert seen == [1, 2] and facts["steps"] == 2 and not facts["reused"]

    def keep(model, step):
        if step == 2:
            at_two.update({k: v.clone() for k, v in model.state_dict().items()})

    train_model("psf_random", data, settings, tmp_path / "full", progress=False, probe_every=1,
                on_probe=keep)  # fmt: skip
    for name, value in stopped.state_dict().items():
        assert torch.equal(value, at_two[name])
