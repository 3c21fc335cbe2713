"""Long-context data: repeat-probe windows (polysketch.data.repeat) and long-range MQAR."""

import pytest
import torch

from polysketch.data.mqar import IGNORE_INDEX, MQARConfig, make_mqar
from polysketch.data.repeat import LETTERS, RepeatConfig, make_repeat, occurrence_masks
from polysketch.eval import mqar_sweep


def _full(rs):
    """The (N, T + 1) windows back from inputs and targets."""
    return torch.cat([rs.inputs, rs.targets[:, -1:]], dim=1)


@pytest.mark.parametrize("text", ["synthetic", "natural"])
def test_passages_recur_at_the_distance_and_masks_mark_them(text):
    cfg = RepeatConfig(seq_len=100, passage_len=12, distance=20, text=text)
    assert cfg.unit_len == 32 and cfg.units == 3
    source = torch.arange(1000) % 251 if text == "natural" else None
    rs = make_repeat(cfg, 5, source=source, seed=1)
    w = _full(rs)
    assert rs.inputs.shape == rs.targets.shape == (5, 100)
    assert torch.equal(rs.inputs[:, 1:], rs.targets[:, :-1])
    for u in range(3):
        a = 32 * u
        assert torch.equal(w[:, a : a + 12], w[:, a + 20 : a + 32])
    # masks: target i holds w[i + 1]; each occurrence without its first token, L - 1 targets
    first = [i for u in range(3) for i in range(32 * u, 32 * u + 11)]
    second = [i for u in range(3) for i in range(32 * u + 20, 32 * u + 31)]
    assert rs.first_mask.nonzero().flatten().tolist() == first
    assert rs.second_mask.nonzero().flatten().tolist() == second
    assert torch.equal(rs.targets[:, rs.first_mask], rs.targets[:, rs.second_mask])
    if text == "synthetic":
        assert bool(torch.isin(w, torch.from_numpy(LETTERS)).all())
    else:  # every passage is a slice of the source (consecutive values mod 251)
        p = w[:, :12]
        assert bool(((p[:, 1:] - p[:, :-1]) % 251 == 1).all())


def test_counterfactual_changes_only_the_first_occurrences():
    cfg = RepeatConfig(seq_len=64, passage_len=16, distance=24)
    f = make_repeat(cfg, 8, seed=3)
    c = make_repeat(cfg, 8, seed=3, counterfactual=True)
    wf, wc = _full(f), _full(c)
    first_positions = torch.zeros(65, dtype=torch.bool)
    first_positions[0:16] = True
    assert torch.equal(wf[:, ~first_positions], wc[:, ~first_positions])
    assert not torch.equal(wc[:, :16], wc[:, 24:40])  # the recurrence no longer recurs
    assert torch.equal(f.second_mask, c.second_mask)


def test_twice_in_a_row_layout_and_bad_layouts_name_the_argument():
    cfg = RepeatConfig(seq_len=2048, passage_len=1024, distance=1024)
    first, second = occurrence_masks(cfg)
    assert int(first.sum()) == int(second.sum()) == 1023 and int(second.nonzero()[0]) == 1024
    with pytest.raises(ValueError, match="distance"):
        RepeatConfig(seq_len=100, passage_len=20, distance=10)
    with pytest.raises(ValueError, match="seq_len"):
        RepeatConfig(seq_len=30, passage_len=16, distance=16)
    with pytest.raises(ValueError, match="text"):
        RepeatConfig(text="poetry")
    with pytest.raises(ValueError, match="source"):
        make_repeat(RepeatConfig(seq_len=64, passage_len=16, distance=16, text="natural"), 2)
    with pytest.raises(ValueError, match="source holds"):
        make_repeat(RepeatConfig(seq_len=64, passage_len=16, distance=16, text="natural"), 2,
                    source=torch.arange(10))  # fmt: skip


def test_min_distance_puts_every_query_far_from_its_key():
    cfg = MQARConfig(vocab_size=128, seq_len=256, num_kv_pairs=8, min_distance=100)
    x, y = make_mqar(cfg, 40, seed=0)
    for row, labels in zip(x, y, strict=True):
        keys = row[: 2 * 8 : 2].tolist()
        answered = (labels != IGNORE_INDEX).nonzero().flatten()
        assert len(answered) == 8
        for i in answered.tolist():  # x[i] is the repeated key, its value the label
            key_pos = 2 * keys.index(int(row[i]))
            assert i - key_pos >= 100
            assert int(row[key_pos + 1]) == int(labels[i])
    # d <= 2 changes nothing: the sequences of the unconstrained task
    plain = MQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=4)
    for d in (0, 1, 2):
        same = MQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=4, min_distance=d)
        assert all(
            torch.equal(a, b)
            for a, b in zip(make_mqar(plain, 9, seed=5), make_mqar(same, 9, seed=5), strict=True)
        )
    with pytest.raises(ValueError, match="min_distance"):
        MQARConfig(vocab_size=128, seq_len=64, num_kv_pairs=8, min_distance=40)
    with pytest.raises(ValueError, match="min_distance"):
        MQARConfig(min_distance=-1)


def test_long_mqar_settings_reach_past_every_local_window():
    for name in ("long", "long512", "long_curriculum", "curriculum256"):
        s, attentions = mqar_sweep.SETTINGS[name]
        assert s["min_distance"] >= s["seq_len"] // 2 > 64  # psf_mixed's block: the chunk
        MQARConfig(
            vocab_size=s["vocab_size"],
            seq_len=s["seq_len"],
            num_kv_pairs=s["num_kv_pairs"],
            min_distance=s["min_distance"],
        )  # valid
        assert "softmax" in attentions and "psf_mixed" in attentions
    data = mqar_sweep.make_data({**mqar_sweep.QUICK, "seq_len": 32, "min_distance": 16})
    answered = (data.train_targets != IGNORE_INDEX).nonzero()[:, 1]
    assert int(answered.min()) >= 16 + 2 * (mqar_sweep.QUICK["num_kv_pairs"] - 1)


def test_curriculum_stages_follow_the_settings_and_bad_stages_are_refused():
    s = mqar_sweep.LONG_CURRICULUM
    stages = mqar_sweep.curriculum_settings(s)
    assert [(st["seq_len"], st["min_distance"], st["num_kv_pairs"], st["steps"])
            for st in stages] == list(s["curriculum"])  # fmt: skip
    assert all(st["batch_size"] == s["batch_size"] and not st["curriculum"] for st in stages)
    # the T = 256 stage already keeps its answers past a 64-token window
    assert stages[-1]["min_distance"] > 64
    assert mqar_sweep.curriculum_settings(mqar_sweep.LONG) == []
    # the screen: the first stage, then the second as the task, the same in every setting
    screen = mqar_sweep.CURRICULUM_256
    assert mqar_sweep.curriculum_settings(screen) == stages[:1]
    task = {**screen, "curriculum": ()}
    assert task == stages[1]
    for bad in (
        (64, 0, 8),
        (64, 0, 8, -1),
        (64, 0, 8, 1.5),
        "64,0,8,100",
        (64, 0, 8, 0),
        (64, -1, 8, 10),
        (64, 0, True, 10),
    ):
        with pytest.raises(ValueError, match="curriculum"):
            mqar_sweep.curriculum_settings({**s, "curriculum": (bad,)})


def test_a_curriculum_trains_its_stages_then_the_task_from_their_weights(monkeypatch):
    """Each stage's data has the stage's length; every stage after the first, and the task,
    starts from the weights the stage before it ended with."""
    calls = []
    real_train = mqar_sweep.train

    def recording_train(model_config, train_config, data, **kw):
        start = kw.get("init_weights")
        history = real_train(model_config, train_config, data, **kw)
        calls.append((data.train_inputs.shape[1], train_config.steps, start, history["model"]))
        return history

    monkeypatch.setattr(mqar_sweep, "train", recording_train)
    settings = {**mqar_sweep.QUICK, "seq_len": 32, "min_distance": 16, "steps": 1,
                "curriculum": ((16, 0, 2, 2), (24, 8, 2, 1))}  # fmt: skip
    (row,) = mqar_sweep.run_sweep(["softmax"], settings=settings, log=None)
    assert [(t, n) for t, n, _, _ in calls] == [(16, 2), (24, 1), (32, 1)]
    assert calls[0][2] is None
    for (_, _, _, before), (_, _, start, _) in zip(calls, calls[1:], strict=False):
        ended = before.state_dict()
        assert start.keys() == ended.keys()
        assert all(torch.equal(start[k], ended[k]) for k in ended)
    assert row["curriculum_accuracy"].startswith("T16:") and " T24:" in row["curriculum_accuracy"]
