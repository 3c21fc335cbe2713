"""experiments/long_context/mqar_diagnostics.py and ``long_context.py mqar-diagnose``."""

import csv
import math

import long_context
import pytest
import torch
from experiments.long_context.mqar_diagnostics import answers, information, pair_scores

from polysketch.data.mqar import IGNORE_INDEX, MQARConfig, make_mqar
from polysketch.eval import mqar_sweep


def _one_hot(buckets, f=4):
    return torch.nn.functional.one_hot(torch.tensor(buckets), f).float()


def test_information_is_zero_for_one_shared_distribution_and_log_f_for_sure_even_buckets():
    sure_even = _one_hot([0, 1, 2, 3])  # each token sure of its own bucket
    one_bucket = _one_hot([2, 2, 2, 2])
    uniform = torch.full((4, 4), 0.25)
    got = information(torch.stack([sure_even, one_bucket, uniform]))
    torch.testing.assert_close(got, torch.tensor([math.log(4), 0.0, 0.0]), rtol=0, atol=1e-6)
    half = _one_hot([0, 0, 1, 1])  # two buckets, evenly: log 2
    assert float(information(half)) == pytest.approx(math.log(2), abs=1e-6)


def test_pair_scores_read_the_source_among_the_far_keys():
    # keys 0..7 in buckets; the query (position 6) sits in bucket 0 with keys 0 and 1
    phi_k = _one_hot([0, 0, 2, 1, 3, 3, 0, 0])
    phi_q = _one_hot([1, 1, 1, 1, 1, 1, 0, 1])
    far = torch.zeros(8, 8, dtype=torch.bool)
    far[6, :4] = True  # position 6 reads keys 0-3 only (keys 6, 7 share its bucket, unread)
    got = pair_scores(phi_q, phi_k, p=6, a=0, num_kv_pairs=2, far=far)  # source: key 1
    assert got == {"source_weight": 0.5, "values_weight": 0.5, "source_top": 1.0}
    got = pair_scores(phi_q, phi_k, p=6, a=1, num_kv_pairs=2, far=far)  # source: key 3
    assert got == {"source_weight": 0.0, "values_weight": 0.5, "source_top": 0.0}
    # a tie between the source and another value is not a win
    phi_k = _one_hot([2, 0, 2, 0, 3, 3, 0, 0])
    assert pair_scores(phi_q, phi_k, p=6, a=0, num_kv_pairs=2, far=far)["source_top"] == 0.0


def test_answers_find_each_query_s_pair():
    x, y = make_mqar(MQARConfig(vocab_size=64, seq_len=64, num_kv_pairs=4, min_distance=16),
                     8, seed=3)  # fmt: skip
    found = answers(x, y, 4)
    assert len(found) == int((y != IGNORE_INDEX).sum())
    for b, p, a in found:
        assert x[b, p] == x[b, 2 * a] and y[b, p] == x[b, 2 * a + 1]


def test_mqar_diagnose_reads_saved_models(tmp_path, capsys):
    """A soft-hash far model trained by ``mqar --save-models`` is diagnosed per layer on its
    own validation set (the recall equals its run's); a model without a far branch gets no
    row and is named; a model shorter, or longer, than the setting's sequences is refused."""
    saved, out = tmp_path / "models", tmp_path / "diag"
    specs = ["soft_hash_far_local_tied:chunk_size=8,global_heads=2", "softmax"]
    argv = ["mqar", "--smoke", "--no-progress", "--setting", "curriculum256", "--out",
            str(tmp_path / "mqar"), "--lrs", "0.003", "--save-models", str(saved),
            "--attentions", *specs]  # fmt: skip
    assert long_context.main(argv) == 0
    with open(tmp_path / "mqar" / "mqar.csv", newline="") as f:
        recall = {r["attention"]: float(r["accuracy"]) for r in csv.DictReader(f)}
    ckpts = [saved / mqar_sweep.run_name(s, 0.003) / "ckpt.pt" for s in specs]
    num_val = mqar_sweep.QUICK["num_val"]
    argv = ["mqar-diagnose", "--smoke", "--setting", "curriculum256", "--examples",
            str(num_val), "--out", str(out), *map(str, ckpts)]  # fmt: skip
    assert long_context.main(argv) == 0
    with open(out / "mqar_diagnose.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["layer"]), r["head"]) for r in rows] == [(0, "mean"), (1, "mean")]
    for r in rows:
        assert float(r["accuracy"]) == pytest.approx(recall[specs[0]], abs=1e-9)
        for name in ("source_weight", "values_weight", "source_top"):
            assert 0.0 <= float(r[name]) <= 1.0
        assert float(r["source_weight"]) <= float(r["values_weight"]) + 1e-6
        assert 1.0 <= float(r["q_buckets"]) <= 1920  # between one bucket and the F of the map
        for name in ("q_information", "k_information"):
            assert 0.0 <= float(r[name]) <= math.log(1920) + 1e-6
    assert "No soft-hash far branch (no rows): models/softmax_lr0.003" in (
        out / "mqar_diagnose.md").read_text()  # fmt: skip
    # --per-head: a row per layer and head, each head with its own map; their means over the
    # heads are the layer's row (every head sees the same answers)
    heads_out = tmp_path / "heads"
    argv = ["mqar-diagnose", "--smoke", "--setting", "curriculum256", "--per-head",
            "--examples", str(num_val), "--out", str(heads_out), str(ckpts[0])]  # fmt: skip
    assert long_context.main(argv) == 0
    with open(heads_out / "mqar_diagnose.csv", newline="") as f:
        heads = list(csv.DictReader(f))
    assert [(int(r["layer"]), r["head"]) for r in heads] == [(0, "0"), (0, "1"), (1, "0"), (1, "1")]
    for layer, row in enumerate(rows):
        pair = heads[2 * layer : 2 * layer + 2]
        assert pair[0]["tau"] != pair[1]["tau"] or pair[0]["q_buckets"] != pair[1]["q_buckets"]
        for name in ("tau", "q_buckets", "k_buckets", "q_information", "source_weight",
                     "source_top"):  # fmt: skip
            mean = (float(pair[0][name]) + float(pair[1][name])) / 2
            assert mean == pytest.approx(float(row[name]), rel=1e-5, abs=1e-9), name
    capsys.readouterr()
    argv = ["mqar-diagnose", "--setting", "long_curriculum", "--examples", "1", "--out",
            str(tmp_path / "too_long"), str(ckpts[0])]  # fmt: skip
    # the smoke model's vocabulary and block are smaller than T = 1,024's setting needs
    assert long_context.main(argv) == 2
    assert "does not fit the --setting's sequences" in capsys.readouterr().err
    assert not (tmp_path / "too_long" / "mqar_diagnose.csv").exists()
    # a model trained on longer sequences than the setting's (a full curriculum's, diagnosed
    # at the screen's T): refused, not read on sequences it was not trained on
    longer = tmp_path / "longer"
    argv = ["mqar", "--smoke", "--no-progress", "--setting", "curriculum256", "--seq-len", "48",
            "--out", str(tmp_path / "mqar48"), "--lrs", "0.003", "--save-models", str(longer),
            "--attentions", specs[0]]  # fmt: skip
    assert long_context.main(argv) == 0
    capsys.readouterr()
    ckpt = longer / mqar_sweep.run_name(specs[0], 0.003) / "ckpt.pt"
    argv = ["mqar-diagnose", "--smoke", "--setting", "curriculum256", "--examples", "1",
            "--out", str(tmp_path / "shorter"), str(ckpt)]  # fmt: skip
    assert long_context.main(argv) == 2
    assert "trained on T = 48 sequences, --setting curriculum256's have T = 32" in (
        capsys.readouterr().err)  # fmt: skip
    assert not (tmp_path / "shorter" / "mqar_diagnose.csv").exists()


def test_mqar_diagnose_refuses_bad_options(tmp_path, capsys):
    assert long_context.main(["mqar-diagnose", "--examples", "0", "x.pt"]) == 2
    assert "--examples must be >= 1" in capsys.readouterr().err
    assert long_context.main(["mqar-diagnose", str(tmp_path / "missing.pt")]) == 2
    assert "error:" in capsys.readouterr().err
