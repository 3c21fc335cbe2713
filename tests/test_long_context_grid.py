"""benchmarks/long_context.py grid (issue 44): cell logic, diagnostics, smoke run, resumption."""

import csv
import math

import long_context
import pytest
import torch
from experiments.long_context.cli import command_line
from experiments.long_context.grid import (
    LN26,
    ONSET_LOSS,
    cell_summary,
    copied,
    onset,
    past_target,
    schedule_options,
    value_at,
)
from experiments.long_context.grid_diagnostics import (
    _value_gradients,
    diagnose,
    far_keys,
    global_branches,
    source_cosines,
    source_values,
    source_weights,
)
from experiments.long_context.probe_training import ProbeSettings, model_config

from polysketch.data.repeat import RepeatConfig, make_repeat
from polysketch.features import create
from polysketch.nn import TransformerLM
from polysketch.train import TrainConfig


def _curve(points):
    """[(step, second, gain, ablated_gain)] -> curve rows as the CSV reads back."""
    return [{"step": s, "first": LN26, "second": sec, "gain": g, "ablated_gain": a}
            for s, sec, g, a in points]  # fmt: skip


def test_schedules_are_the_cli_defaults_and_the_probes_constant():
    """``cli`` is what ``polysketch train --steps 500`` runs (its warmup: 50, not 100; issue
    70 item 1), read from the CLI's own parser; ``warmup100`` the grid's old ``cli``."""
    from polysketch.cli import build_parser
    from polysketch.commands.train import _configs_from_args

    for steps in (500, 40, 3000):
        args = build_parser().parse_args(["train", "--steps", str(steps), "--out", "unused"])
        user = _configs_from_args(args)[1]
        got = schedule_options("cli", steps)
        assert (got["lr"], got["min_lr"], got["warmup_steps"]) == (
            user.lr, user.min_lr, user.warmup_steps)
    cli = schedule_options("cli", 500)
    d = TrainConfig()
    assert (cli["lr"], cli["min_lr"], cli["warmup_steps"]) == (d.lr, d.min_lr, 50)
    assert cli["schedule"] == "cosine"
    old = schedule_options("warmup100", 500)
    assert old == {**cli, "warmup_steps": 100}
    const = ProbeSettings(**schedule_options("constant", 500))
    assert const.schedule == "constant" and const.final_lr == const.lr == 1e-3
    assert const.warmup_steps == 50
    with pytest.raises(ValueError, match="schedule"):
        schedule_options("linear", 500)


def test_onset_and_values_read_at_the_last_evaluation_before_a_step():
    curve = _curve([(50, 3.2, 0.0, 0.0), (0, 3.3, 0.0, 0.0), (100, 1.7, 1.5, 0.01),
                    (150, ONSET_LOSS - 1e-6, 1.7, 0.02), (200, 0.1, 3.1, "")])  # fmt: skip
    assert onset(curve) == 150  # 1.7 is not below ln 26 / 2; unsorted input is sorted
    assert onset(curve[:3]) is None
    assert value_at(curve, 199.9, "gain") == (150, 1.7)
    assert value_at(curve, 200, "gain") == (200, 3.1)
    assert value_at(curve, 200, "ablated_gain") is None  # empty there
    assert value_at(curve, -1, "gain") is None


def test_copied_needs_the_gain_a_near_zero_recurrence_loss_and_for_a_candidate_1_5x_onset():
    big, low = 0.96 * LN26, 0.04 * LN26
    assert copied(big, low, 100, fraction=0.95, reference_onset=None, is_reference=True)
    assert not copied(0.94 * LN26, low, 100, fraction=0.95, reference_onset=None,
                      is_reference=True)  # fmt: skip
    # the gain inflated by first occurrences that got worse (l1 = 4.25, l2 = 0.52): not a copy
    assert not copied(4.25 - 0.52, 0.52, 100, fraction=0.95, reference_onset=None,
                      is_reference=True)  # fmt: skip
    assert not copied(big, low, 100, fraction=0.95, reference_onset=None, is_reference=False)
    assert not copied(big, low, 149, fraction=0.95, reference_onset=100, is_reference=False)
    assert copied(big, low, 150, fraction=0.95, reference_onset=100, is_reference=False)
    with pytest.raises(ValueError, match="fraction"):
        copied(big, low, 1, fraction=0.0, reference_onset=1, is_reference=True)
    # the screening stop: at 1.5x the reference's onset, copied or not; never without one
    assert not past_target(149, reference_onset=100) and past_target(150, reference_onset=100)
    assert not past_target(10**6, reference_onset=None)


def test_cell_summary_against_softmax():
    ref = _curve([(0, 3.3, 0, ""), (100, 2.0, 1.2, ""), (150, 0.5, 2.8, ""), (200, 0.1, 3.2, "")])
    # onset 150 -> 1.5x = 225: read at 200
    good = _curve([(0, 3.3, 0, 0), (200, 1.0, 2.2, 0.01), (300, 0.1, 3.1, 0.0)])
    s = cell_summary(ref, good)
    assert (s["ref_onset"], s["at"], s["at_step"], s["onset"]) == (150, 225.0, 200, 200)
    assert s["gain_at"] == 2.2 and s["ratio_at"] == pytest.approx(2.2 / 3.2) and s["passes"]
    assert (s["last_step"], s["gain_last"], s["ablated_last"]) == (300, 3.1, 0.0)
    late = _curve([(0, 3.3, 0, 0), (200, 3.0, 0.2, 0.0), (300, 0.1, 3.1, 0.0)])
    assert cell_summary(ref, late)["passes"] is False
    not_global = _curve([(0, 3.3, 0, 0), (200, 1.0, 2.2, 0.5)])  # the window copies: no
    assert cell_summary(ref, not_global)["passes"] is False
    no_ref = cell_summary(ref[:2], good)  # softmax without an onset: not counted
    assert no_ref["ref_onset"] is None and no_ref["passes"] is None
    with pytest.raises(ValueError, match="evaluation"):
        cell_summary([], good)


def test_far_keys_and_source_weights_match_the_maps_kernel():
    assert far_keys(4, None).tolist() == torch.ones(4, 4).tril().bool().tolist()
    blocks = far_keys(6, 2)  # query 3 (block 1) reads keys 0, 1; query 5 reads 0–3
    assert blocks[3].tolist() == [True, True, False, False, False, False]
    assert blocks[5].tolist() == [True, True, True, True, False, False]
    assert not blocks[1].any()
    fm = create("soft_hash", 8, num_features=16, temperature=2.0, seed=0)
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(40, 8, generator=gen), torch.randn(40, 8, generator=gen)
    queries, d = torch.tensor([20, 25, 33, 39]), 16
    with torch.no_grad():
        q, k = q.double(), k.double()
        w, lift, nxt = source_weights(fm.query(q), fm.key(k), queries, d, 4)
        s = fm.target_kernel(q, k)  # (40, 40), the map's own kernel (log space)
    for n, i in enumerate(queries.tolist()):
        far = [j for j in range(40) if j < (i // 4) * 4]
        expect = (s[i, i - d] + s[i, i + 1 - d]) / s[i, far].sum()
        assert w[n] == pytest.approx(float(expect), rel=1e-10)
        assert lift[n] == pytest.approx(float(expect) * len(far) / 2, rel=1e-10)
        assert nxt[n] == pytest.approx(float(s[i, i + 1 - d] / s[i, far].sum()), rel=1e-10)
    c_src, c_far, c_next = source_cosines(q, k, queries, d, 4)
    cos = torch.nn.functional.cosine_similarity(q[:, None], k[None], dim=-1)  # (40, 40)
    for n, i in enumerate(queries.tolist()):
        far = [j for j in range(40) if j < (i // 4) * 4]
        assert c_src[n] == pytest.approx(float(cos[i, i - d] + cos[i, i + 1 - d]) / 2, rel=1e-12)
        assert c_far[n] == pytest.approx(float(cos[i, far].mean()), rel=1e-12)
        assert c_next[n] == pytest.approx(float(cos[i, i + 1 - d]), rel=1e-12)


def test_source_values_are_z_scores_of_the_values_loss_decrease_over_far_keys():
    gen = torch.Generator().manual_seed(2)
    g, v = torch.randn(40, 6, generator=gen).double(), torch.randn(40, 6, generator=gen).double()
    queries, d = torch.tensor([20, 25, 33, 39]), 16
    z_src, z_next = source_values(g, v, queries, d, 4)
    for n, i in enumerate(queries.tolist()):
        far = [j for j in range(40) if j < (i // 4) * 4]
        u = torch.tensor([-float(g[i] @ v[j]) for j in far], dtype=torch.float64)
        mean, std = u.mean(), u.std(unbiased=False)
        own = (-float(g[i] @ v[i - d]) - mean) / std
        nxt = (-float(g[i] @ v[i + 1 - d]) - mean) / std
        assert z_next[n] == pytest.approx(float(nxt), rel=1e-10)
        assert z_src[n] == pytest.approx(float(own + nxt) / 2, rel=1e-10)
    # a value that lowers the loss (u = −g·v large) scores > 0; its opposite < 0
    v2 = v.clone()
    v2[25 + 1 - d] = -5 * g[25] / g[25].norm()
    assert source_values(g, v2, torch.tensor([25]), d, 4)[1] > 0
    v2[25 + 1 - d] = 5 * g[25] / g[25].norm()
    assert source_values(g, v2, torch.tensor([25]), d, 4)[1] < 0


def test_value_gradients_give_the_loss_change_of_moving_attention_onto_a_key():
    """g from ``_value_gradients`` is the loss gradient at the branch core's output: moving
    query i's output o_i by ε(v_j − o_i) (weight ε onto key j) changes the loss by
    ε g_i·(v_j − o_i), checked by central differences in fp64: with ε = 1e-4 the rounding
    error is ≈ 2⁻⁵³·|L|/ε ≈ 5e-12 and the truncation ε²·|L‴|/6 ≈ 1e-9 or less, against a
    derivative ≈ 1e-4 (asserted > 1e-6): rel 1e-4. (Every surrogate off: with a later layer's
    surrogate on, g would also carry its training-only gradient, a 6 % change here.)"""
    model = _tiny_preset(5.0).eval()
    windows = make_repeat(RepeatConfig(seq_len=64, passage_len=32, distance=32), 2, seed=0)
    inputs, targets = windows.inputs, windows.targets
    branches = global_branches(model)
    values = _value_gradients(model, branches, inputs, targets)
    b, h, i, j = 1, 0, 45, 14  # the preset's global branch has one head here
    for layer, block in branches:
        v, g = values[layer]
        inner = block.attn.attend
        seen = {}

        def loss_with(eps, attn=block.attn, inner=inner, v=v, seen=seen):
            def attend(q, k, vv, **kw):
                out = inner(q, k, vv, **kw).clone()
                seen["o"] = out[b, h, i].clone()
                out[b, h, i] += eps * (v[b, h, j] - out[b, h, i])
                return out

            attn.attend = attend
            try:
                with torch.no_grad():
                    return float(model(inputs, targets)[1])
            finally:
                del attn.attend

        eps = 1e-4
        fd = (loss_with(eps) - loss_with(-eps)) / (2 * eps)
        expect = float(g[b, h, i] @ (v[b, h, j] - seen["o"]))
        assert abs(expect) > 1e-6
        assert fd == pytest.approx(expect, rel=1e-4)


def _tiny_model_on_windows(n_layer):
    """A small fp64 preset (F = 64), two repeat windows (d = 32) and its global branches."""
    settings = ProbeSettings(n_layer=n_layer, n_embd=32, n_head=2, chunk_size=8, context=64)
    model = TransformerLM(model_config("soft_hash_far_local:num_features=64", settings)).double()
    windows = make_repeat(RepeatConfig(seq_len=64, passage_len=32, distance=32), 2, seed=0)
    return model, windows.inputs, windows.targets, global_branches(model)


def _tiny_preset(gradient_surrogate):
    settings = ProbeSettings(n_layer=2, n_embd=32, n_head=2, chunk_size=8, context=64)
    spec = f"soft_hash_far_local:num_features=64,gradient_surrogate={gradient_surrogate}"
    return TransformerLM(model_config(spec, settings)).double()


def test_diagnose_reads_the_global_branch_and_the_surrogates_share():
    windows = make_repeat(RepeatConfig(seq_len=64, passage_len=32, distance=32), 3, seed=0)
    rows = {lam: diagnose(_tiny_preset(lam), windows, 32) for lam in (0.0, 5.0, 10.0)}
    assert [r["layer"] for r in rows[5.0]] == [0, 1]
    for r in rows[5.0]:
        assert 1.0 <= r["q_buckets"] <= 64 and 1.0 <= r["k_buckets"] <= r["k_usage"] <= 64
        assert 0.0 < r["next_weight"] < r["source_weight"] < 1.0 and r["source_lift"] > 0
        assert r["tau"] == pytest.approx(10.0)  # the preset's initial temperature
        assert r["global_rms"] > 0 and r["window_rms"] > 0
    # The surrogate is 0 in value, so the forward pass and the map's own gradient G_map do not
    # depend on λ. In the last layer G = G_map + λ·G_1 (G_sur linear in λ); an earlier layer's
    # surrogate also scales the later layers' surrogate gradient that reaches it, so there
    # G_sur = λ·G_1 + λ²·G_2. In fp64 the difference G − G_map loses ≈ 1e-16 · ‖G‖ / ‖G_sur‖
    # relatively (the ratios are O(0.1–10)).
    for r0, r5 in zip(rows[0.0], rows[5.0], strict=True):
        assert r0["surrogate_ratio"] == 0.0 and r0["surrogate_cos"] == ""
        assert 0.0 < r5["surrogate_ratio"] < 1e3
        assert r0["source_weight"] == r5["source_weight"]  # same weights (λ is training-only)
    last5, last10 = rows[5.0][-1], rows[10.0][-1]
    assert last10["surrogate_ratio"] == pytest.approx(2 * last5["surrogate_ratio"], rel=1e-9)
    assert last10["surrogate_cos"] == pytest.approx(last5["surrogate_cos"], abs=1e-9)
    first5, first10 = rows[5.0][0], rows[10.0][0]
    assert first10["surrogate_ratio"] != pytest.approx(2 * first5["surrogate_ratio"], rel=1e-6)
    for r in rows[5.0]:  # no linear term: every feature is a bucket
        assert r["source_weight_all"] == pytest.approx(r["source_weight"], rel=1e-12)
        assert all(-1.0 <= r[c] <= 1.0 for c in ("source_cos", "far_cos", "next_cos"))
        assert math.isfinite(r["source_value"]) and r["next_value"] != 0.0
    # with the linear term (Eq. 6 at c = 3), every key's score gains α(c + cos)/(1 + c): the
    # weight the branch attends with is no longer the buckets' alone
    settings = ProbeSettings(n_layer=2, n_embd=32, n_head=2, chunk_size=8, context=64)
    spec = "soft_hash_far_local:num_features=64,linear_weight=0.5,linear_offset=3.0"
    linear = diagnose(TransformerLM(model_config(spec, settings)).double(), windows, 32)
    for r in linear:
        assert r["source_weight_all"] != pytest.approx(r["source_weight"], rel=1e-3)
        assert 0.0 < r["source_weight_all"] < 1.0
    softmax = TransformerLM(model_config("softmax", ProbeSettings(n_layer=1, n_embd=32,
                                                                  context=64)))  # fmt: skip
    assert diagnose(softmax, windows, 32) == []


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_grid_smoke_writes_its_tables_and_resumes(tmp_path, capsys):
    out = tmp_path / "grid"
    argv = ["grid", "--smoke", "--no-progress", "--out", str(out), "--seeds", "0",
            "--attentions", "soft_hash_far_local:num_features=64", "softmax"]  # fmt: skip
    assert long_context.main(argv) == 0
    for name in ("grid.csv", "grid_curve.csv", "grid_diag.csv", "grid.md", "grid.png",
                 "grid_diag.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0
    cells = _rows(out / "grid.csv")
    # both schedules; softmax first in each (it sets the others' 1.5x onset)
    assert [(r["schedule"], r["attention"]) for r in cells] == [
        ("cli", "softmax"), ("cli", "soft_hash_far_local:num_features=64"),
        ("constant", "softmax"), ("constant", "soft_hash_far_local:num_features=64")]  # fmt: skip
    curve = _rows(out / "grid_curve.csv")
    assert sorted({int(r["step"]) for r in curve}) == [0, 2, 4]  # init, every 2, the budget
    preset = [r for r in curve if r["attention"] != "softmax"]
    assert all(r["ablated_gain"] != "" for r in preset)
    assert all(r["ablated_gain"] == "" for r in curve if r["attention"] == "softmax")
    diag = _rows(out / "grid_diag.csv")
    assert {(r["schedule"], int(r["step"])) for r in diag} == {
        (s, t) for s in ("cli", "constant") for t in (0, 2, 4)
    }
    for r in cells:
        assert r["stopped"] == "budget" and int(r["last_step"]) == 4 and r["budget"] == "4"
        mine = [p for p in curve if p["attention"] == r["attention"]
                and p["schedule"] == r["schedule"] and p["step"] == "4"]  # fmt: skip
        assert float(r["gain"]) == float(mine[0]["gain"])
    md = (out / "grid.md").read_text()
    assert "long_context.py grid" in md and "Every candidate cell" in md and "τ" in md
    capsys.readouterr()
    # the report alone, from the CSVs: a seed not yet trained is not trained
    (out / "grid.md").write_text("stale")
    (out / "grid_diag.png").unlink()
    assert long_context.main([*argv[:5], "--seeds", "0", "1", "--attentions", *argv[-2:],
                              "--reuse", "--report-only"]) == 0  # fmt: skip
    assert _rows(out / "grid.csv") == cells and _rows(out / "grid_curve.csv") == curve
    report = (out / "grid.md").read_text()
    assert "Every candidate cell" in report and "--report-only" not in report
    assert (out / "grid_diag.png").stat().st_size > 0
    assert long_context.main([*argv, "--report-only"]) == 2  # without --reuse
    assert "--report-only" in capsys.readouterr().err
    assert long_context.main([*argv, "--reuse"]) == 0  # nothing new to measure
    assert _rows(out / "grid.csv") == cells and _rows(out / "grid_curve.csv") == curve
    assert long_context.main(argv) == 2  # an existing table is not overwritten
    assert "long_context.py grid: error:" in capsys.readouterr().err
    # a larger grid continues the same tables: only the new cell is trained
    more_argv = [*argv[:-3], "--reuse", "--schedules", "constant", "--seeds", "0", "1",
                 "--attentions", "softmax"]  # fmt: skip
    assert long_context.main(more_argv) == 0
    more = _rows(out / "grid.csv")
    assert more[: len(cells)] == cells
    assert [(r["schedule"], r["seed"], r["attention"]) for r in more[len(cells) :]] == [
        ("constant", "1", "softmax")
    ]
    # the report names both calls that wrote rows (not the --report-only nor the empty one)
    calls = [line for line in (out / "grid.md").read_text().splitlines() if line.startswith("- `")]
    assert calls == [f"- `{command_line(argv)}`", f"- `{command_line(more_argv)}`"]


def test_grid_refuses_bad_options(tmp_path, capsys):
    base = ["grid", "--no-progress", "--out", str(tmp_path / "g")]
    for bad in (["--steps", "0"], ["--stop-fraction", "1.5"], ["--distances", "1"],
                ["--diagnose-every", "-1"]):  # fmt: skip
        assert long_context.main([*base, *bad]) == 2
        assert "long_context.py grid: error:" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()
    assert math.isclose(ONSET_LOSS, math.log(26) / 2)


def test_surrogate_schedule_parses_and_decays():
    from experiments.long_context.surrogate_schedule import SurrogateSchedule, split_schedule

    assert split_schedule("soft_hash_far_local") == ("soft_hash_far_local", None)
    spec, sched = split_schedule("soft_hash_far_local:num_features=64@surrogate=200:50:300")
    assert spec == "soft_hash_far_local:num_features=64,gradient_surrogate=200.0"
    assert sched == SurrogateSchedule(200.0, 50.0, 300)
    assert [sched.weight(t) for t in (0, 150, 300, 600)] == [200.0, 125.0, 50.0, 50.0]
    assert sched.scale(150) == 125.0 / 200.0
    assert split_schedule("soft_hash_far_local@surrogate=1:0:5")[0] == (
        "soft_hash_far_local:gradient_surrogate=1.0"
    )
    for bad in ("x@surrogate=1:2", "x@surrogate=0:1:5", "x:gradient_surrogate=1@surrogate=1:0:5"):
        with pytest.raises(ValueError, match="surrogate"):
            split_schedule(bad)


def test_scaled_surrogate_scales_the_surrogates_gradient_only():
    """One layer: G(s) = G_map + s·λ·G_1 exactly (fp64), the outputs unchanged; the class's
    method is restored after the block."""
    from experiments.long_context.grid_diagnostics import _qk_grads
    from experiments.long_context.surrogate_schedule import Scale, scaled_surrogate

    from polysketch.nn.core import AttentionCore

    model, x, y, branches = _tiny_model_on_windows(n_layer=1)
    original = AttentionCore._gradient_surrogate
    grads, losses = {}, {}
    for s in (0.0, 1.0, 0.25):
        with scaled_surrogate(Scale(s)):
            grads[s] = _qk_grads(model, branches, x, y)[0]
            losses[s] = float(model(x, y)[1].detach())
    assert AttentionCore._gradient_surrogate is original
    assert losses[0.0] == losses[1.0] == losses[0.25]
    unscaled = _qk_grads(model, branches, x, y)[0]
    assert torch.equal(unscaled, grads[1.0])
    expect = grads[0.0] + 0.25 * (grads[1.0] - grads[0.0])
    assert torch.allclose(grads[0.25], expect, rtol=0, atol=1e-12 * float(grads[1.0].abs().max()))


def test_grid_runs_a_surrogate_schedule_from_its_evaluations(tmp_path):
    """λ = 100 then 10 from step 2 (evaluations every 2 steps) against λ = 100 throughout:
    equal at step 2, not at step 4."""
    out = tmp_path / "grid"
    base = "soft_hash_far_local:num_features=64"
    argv = ["grid", "--smoke", "--no-progress", "--out", str(out), "--seeds", "0",
            "--schedules", "constant", "--attentions", f"{base},gradient_surrogate=100.0",
            f"{base}@surrogate=100:10:2"]  # fmt: skip
    assert long_context.main(argv) == 0
    curve = {(r["attention"].partition("@")[2], int(r["step"])): r
             for r in _rows(out / "grid_curve.csv")}  # fmt: skip
    assert curve[("", 2)]["second"] == curve[("surrogate=100:10:2", 2)]["second"]
    assert curve[("", 4)]["second"] != curve[("surrogate=100:10:2", 4)]["second"]


def test_surrogate_values_parses():
    from experiments.long_context.surrogate_values import split_values

    assert split_values("soft_hash_far_local") == ("soft_hash_far_local", None)
    assert split_values("soft_hash_far_local:num_features=64@values=0.5") == (
        "soft_hash_far_local:num_features=64", 0.5)  # fmt: skip
    for bad in ("x@values=a", "x@values=-1"):
        with pytest.raises(ValueError, match="values"):
            split_values(bad)


def test_surrogate_values_gives_the_values_a_near_uniform_attentions_gradient():
    """fp64, one global branch: the term is 0 in value, q and k get the library surrogate's
    gradient unchanged, and v gets μ·Wᵀg with W the far-block attention of the kernel
    1 + cos(q, k), formed here from its definition (surrogate_values' docstring)."""
    from experiments.long_context.grid_diagnostics import far_keys, global_branches
    from experiments.long_context.surrogate_values import surrogate_values

    from polysketch.nn.core import AttentionCore

    settings = ProbeSettings(n_layer=1, n_embd=32, n_head=2, chunk_size=8, context=64)
    model = TransformerLM(model_config("soft_hash_far_local:num_features=64", settings)).double()
    attn = global_branches(model)[0][1].attn
    t, (dq, _, dv), mu = 40, attn._split, 0.5
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(2, 1, t, d, generator=gen, dtype=torch.float64)
                  for d in (dq, dq, dv, dv))  # fmt: skip

    def run():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        term = attn._gradient_surrogate(*leaves, None)
        (term * g).sum().backward()
        return term.detach(), [x.grad for x in leaves]

    base, (gq0, gk0, gv0) = run()
    original = AttentionCore._gradient_surrogate
    with surrogate_values(mu):
        term, (gq, gk, gv) = run()
    assert AttentionCore._gradient_surrogate is original
    assert torch.count_nonzero(base) == torch.count_nonzero(term) == 0
    assert gv0 is None  # the library's term detaches the values
    assert torch.equal(gq, gq0) and torch.equal(gk, gk0)
    unit_q, unit_k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    kernel = (1 + unit_q @ unit_k.transpose(-1, -2)) * far_keys(t, attn.chunk_size)
    weights = kernel / kernel.sum(-1, keepdim=True).clamp_min(1e-300)
    expect = mu * weights.transpose(-1, -2) @ g
    assert torch.allclose(gv, expect, rtol=1e-10, atol=1e-12)


def test_linear_schedule_parses_and_fades_the_linear_term():
    """α(t) = A·scale: the map's score under faded_linear(Scale(s)) is its hash score plus
    s·A(1 + cos)/2 (fp64, against target_kernel with linear_weight = s·A); the class's method
    is restored after the block."""
    from experiments.long_context.linear_schedule import faded_linear, split_linear
    from experiments.long_context.surrogate_schedule import Scale, SurrogateSchedule

    from polysketch.features.soft_hash import SoftHashFeatureMap

    assert split_linear("soft_hash_far_local") == ("soft_hash_far_local", None)
    spec, sched = split_linear("soft_hash_far_local@linear=0.001:0:300")
    assert spec == "soft_hash_far_local:linear_weight=0.001"
    assert sched == SurrogateSchedule(0.001, 0.0, 300) and sched.scale(150) == 0.5
    for bad in ("x@linear=1:2", "x:linear_weight=1@linear=1:0:5"):
        with pytest.raises(ValueError, match="linear"):
            split_linear(bad)
    fm = create("soft_hash", 8, num_features=16, linear_weight=0.25, seed=0).double()
    x, y = (torch.randn(5, 8, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
            for s in (1, 2))  # fmt: skip
    original = SoftHashFeatureMap.linear_features
    for s in (1.0, 0.4, 0.0):
        with faded_linear(Scale(s)):
            got = fm.query(x) @ fm.key(y).T
        ref = create("soft_hash", 8, num_features=16, linear_weight=0.25 * s, seed=0).double()
        expect = ref.target_kernel(x, y)
        assert torch.allclose(got, expect, rtol=1e-12, atol=1e-15)
    assert SoftHashFeatureMap.linear_features is original


def test_grid_combines_remedy_tags(tmp_path, capsys):
    """SPEC@surrogate=...@linear=... runs; an unknown tag is refused naming it, before any
    cell runs."""
    out = tmp_path / "grid"
    base = "soft_hash_far_local:num_features=64"
    argv = ["grid", "--smoke", "--no-progress", "--out", str(out), "--seeds", "0",
            "--schedules", "constant", "--attentions", "softmax",
            f"{base}@surrogate=100:10:2@linear=0.001:0:4"]  # fmt: skip
    assert long_context.main(argv) == 0
    rows = _rows(out / "grid.csv")
    assert rows[-1]["attention"].endswith("@linear=0.001:0:4")
    for bad in (f"{base}@nope=1", f"{base}@values=1@values=2"):
        bad_out = tmp_path / "bad"
        assert long_context.main([*argv[:4], str(bad_out), "--attentions", "softmax", bad]) == 2
        assert "unknown or repeated tag" in capsys.readouterr().err
        assert not bad_out.exists()


def test_push_scaled_surrogate_is_the_librarys_at_one_and_pull_only_at_zero():
    """fp64. s = 1: the library surrogate's q/k gradient (autograd through its mixed op);
    s = 0: Σ_j min(c_ij, 0)/Σ_l w_il · ∂w_ij/∂q_i written pair by pair (module docstring)."""
    from experiments.long_context.grid_diagnostics import global_branches
    from experiments.long_context.surrogate_push import pushed_surrogate_grads, split_push

    settings = ProbeSettings(n_layer=1, n_embd=32, n_head=2, chunk_size=4, context=64)
    model = TransformerLM(model_config("soft_hash_far_local:num_features=64", settings)).double()
    attn = global_branches(model)[0][1].attn
    lam = attn.gradient_surrogate
    t, (dq_dim, _, dv_dim) = 14, attn._split
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(2, 1, t, d, generator=gen, dtype=torch.float64)
                  for d in (dq_dim, dq_dim, dv_dim, dv_dim))  # fmt: skip
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    (attn._gradient_surrogate(qq, kk, v, None) * g).sum().backward()
    dq1, dk1 = pushed_surrogate_grads(q, k, v, lam * g, 4, 1.0)
    torch.testing.assert_close(dq1, qq.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dk1, kk.grad, rtol=1e-10, atol=1e-12)
    dq0, dk0 = pushed_surrogate_grads(q, k, v, lam * g, 4, 0.0)
    eq, ek = torch.zeros_like(q), torch.zeros_like(k)
    for b in range(2):
        for i in range(t):
            far = list(range((i // 4) * 4))
            if not far:
                continue
            w = [1 + torch.nn.functional.cosine_similarity(q[b, 0, i], k[b, 0, j], dim=0)
                 for j in far]  # fmt: skip
            den = sum(w)
            o = sum(wj * v[b, 0, j] for wj, j in zip(w, far, strict=True)) / den
            for j in far:
                c = min(float(lam * g[b, 0, i] @ (v[b, 0, j] - o)), 0.0)
                qi, kj = q[b, 0, i].clone().requires_grad_(), k[b, 0, j].clone().requires_grad_()
                gq, gk = torch.autograd.grad(torch.nn.functional.cosine_similarity(qi, kj, dim=0),
                                             (qi, kj))  # fmt: skip
                eq[b, 0, i] += c / den * gq
                ek[b, 0, j] += c / den * gk
    torch.testing.assert_close(dq0, eq, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dk0, ek, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(dq0, dq1)
    assert split_push("soft_hash_far_local@push=0") == ("soft_hash_far_local", 0.0)
    for bad in ("x@push=2", "x@push=a"):
        with pytest.raises(ValueError, match="push"):
            split_push(bad)


def test_push_scaled_surrogate_in_a_model_changes_gradients_only():
    from experiments.long_context.grid_diagnostics import _qk_grads
    from experiments.long_context.surrogate_push import surrogate_push

    from polysketch.nn.core import AttentionCore

    model, x, y, branches = _tiny_model_on_windows(n_layer=2)
    original = AttentionCore._gradient_surrogate
    base = _qk_grads(model, branches, x, y)
    loss = float(model(x, y)[1].detach())
    with surrogate_push(1.0):
        same = _qk_grads(model, branches, x, y)
    with surrogate_push(0.0):
        pull = _qk_grads(model, branches, x, y)
        assert float(model(x, y)[1].detach()) == loss
    assert AttentionCore._gradient_surrogate is original
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[:, :3] = False  # padded keys: the explicit pairs do not drop them, so refused
    with surrogate_push(0.0), pytest.raises(ValueError, match="@push: padded"):
        model(x, y, key_padding_mask=keep)[1].backward()
    for layer in base:
        scale = float(base[layer].abs().max())
        torch.testing.assert_close(same[layer], base[layer], rtol=1e-9, atol=1e-12 * scale)
        assert not torch.allclose(pull[layer], base[layer])


def test_grid_runs_a_push_scaled_surrogate_with_a_schedule(tmp_path):
    """@push=1 is the library's surrogate (the same curve as without the tag); @push=0
    differs; both combine with @surrogate (the schedule wraps the pushed term)."""
    out = tmp_path / "grid"
    base = "soft_hash_far_local:num_features=64,gradient_surrogate=100.0"
    argv = ["grid", "--smoke", "--no-progress", "--out", str(out), "--seeds", "0",
            "--schedules", "constant", "--attentions", base, f"{base}@push=1",
            f"{base}@push=0",
            "soft_hash_far_local:num_features=64@surrogate=100:10:2@push=0"]  # fmt: skip
    assert long_context.main(argv) == 0
    curve = {(r["attention"].partition("@")[2], int(r["step"])): r["second"]
             for r in _rows(out / "grid_curve.csv")}  # fmt: skip
    # push=1 forms the library's gradient another way (fp32 rounding differs by ~1e-7 of it;
    # times lr < 1e-4 over 4 steps, far below the loss's own fp32 resolution)
    assert float(curve[("push=1", 4)]) == pytest.approx(float(curve[("", 4)]), rel=1e-5)
    assert curve[("push=0", 4)] != curve[("", 4)]
    assert curve[("surrogate=100:10:2@push=0", 2)] == curve[("push=0", 2)]
    assert curve[("surrogate=100:10:2@push=0", 4)] != curve[("push=0", 4)]


def test_outinit_tag_is_the_global_out_init_option():
    from experiments.long_context.global_init import split_outinit

    assert split_outinit("soft_hash_far_local@outinit=0") == (
        "soft_hash_far_local:global_out_init=0.0", 0.0)  # fmt: skip
    assert split_outinit("soft_hash_far_local:num_features=64@outinit=0.5") == (
        "soft_hash_far_local:num_features=64,global_out_init=0.5", 0.5)  # fmt: skip
    assert split_outinit("soft_hash_far_local") == ("soft_hash_far_local", None)
    for bad in ("soft_hash_far_local@outinit=-1", "x:global_out_init=1.0@outinit=0"):
        with pytest.raises(ValueError, match="outinit"):
            split_outinit(bad)


def test_grid_runs_a_zero_initialized_global_branch(tmp_path):
    """@outinit=0: at step 0 the global branch adds nothing (its loss equals the ablated
    one); training moves it off 0 (the global branch matters by the last step)."""
    out = tmp_path / "grid"
    base = "soft_hash_far_local:num_features=64"
    argv = ["grid", "--smoke", "--no-progress", "--out", str(out), "--seeds", "0",
            "--schedules", "constant", "--attentions", "softmax", f"{base}@outinit=0"]  # fmt: skip
    assert long_context.main(argv) == 0
    curve = [r for r in _rows(out / "grid_curve.csv") if r["attention"].endswith("@outinit=0")]
    first, last = curve[0], curve[-1]
    assert int(first["step"]) == 0 and first["second"] == first["ablated_second"]
    assert int(last["step"]) > 0 and last["second"] != last["ablated_second"]


@pytest.mark.filterwarnings("ignore:warmup_steps=50 >= steps=8")
def test_grid_stop_at_target_stops_a_candidate_where_its_target_is_read(tmp_path, capsys):
    """--stop-at-target: with softmax's onset at step 2 (set by hand in its curve), the
    candidate stops at step 4 = the first evaluation >= 1.5 x 2, of a budget of 8 (the full
    grid trains it to 8), labelled ``target``; its curve up to 4 is the full run's, so the
    target's verdict is the same; grids with and without the flag do not mix."""
    tiny = ["--n-layer", "1", "--n-embd", "32", "--chunk-size", "8", "--steps", "8",
            "--probe-every", "2", "--val-windows", "2", "--distances", "16",
            "--batch-sizes", "2", "--diagnose-every", "0", "--seeds", "0",
            "--schedules", "constant", "--no-progress"]  # fmt: skip
    cand = "soft_hash_far_local:num_features=64"
    curves = {}
    for flag in ([], ["--stop-at-target"]):
        out = tmp_path / f"grid{len(flag)}"
        base = ["grid", *tiny, *flag, "--out", str(out), "--runs", str(out / "runs")]
        assert long_context.main([*base, "--attentions", "softmax"]) == 0
        rows = _rows(out / "grid_curve.csv")
        for r in rows:  # softmax's onset at step 2
            if r["step"] == "2":
                r["second"] = str(0.1 * ONSET_LOSS)
        with (out / "grid_curve.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        assert long_context.main([*base, "--reuse", "--attentions", "softmax", cand]) == 0
        row = next(r for r in _rows(out / "grid.csv") if r["attention"] == cand)
        curves[len(flag)] = [(int(r["step"]), r["second"]) for r in _rows(out / "grid_curve.csv")
                             if r["attention"] == cand]  # fmt: skip
        if flag:
            assert (row["stopped"], row["last_step"]) == ("target", "4")
            assert "stopped: target" in (out / "grid.md").read_text()
            without = [a for a in base if a != "--stop-at-target"]
            capsys.readouterr()
            assert long_context.main([*without, "--reuse", "--attentions", "softmax"]) == 2
            assert "stop_at_target" in capsys.readouterr().err
        else:
            assert (row["stopped"], row["last_step"]) == ("budget", "8")
    assert [s for s, _ in curves[1]] == [0, 2, 4]
    assert curves[1] == curves[0][:3]
