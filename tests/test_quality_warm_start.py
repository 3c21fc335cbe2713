"""Polynomial-to-sketch warm start: TransformerLM.set_exact_attention, the training loop's
``warm_start_steps`` (switch and resume on either side of it) and ``--warm-start-steps``."""

import pytest
import torch

from polysketch.cli import main
from polysketch.nn import TransformerLM
from polysketch.nn.warm_start import exact_degree, target_degree
from polysketch.train import load_checkpoint, train
from test_train_loop import TEXT, corpus  # noqa: F401, F811  (the tiny corpus fixture)
from test_train_loop import tiny_model as _tiny_model
from test_train_loop import tiny_train as _tiny_train


def tiny_model(**kw):
    return _tiny_model(**{"n_layer": 2, **kw})  # two layers: the switch must reach every one


def tiny_train(out_dir=None, **kw):
    return _tiny_train(out_dir, **{"log_interval": 1, **kw})  # every step's loss logged


def _losses(history):
    return [r["loss"] for r in history["train"]]


@pytest.mark.parametrize(
    "attention, map_kwargs, degree",
    [
        ("psf_random", {}, 4),
        ("psf_random", {"projection": "product"}, 4),
        ("psf_mixed", {}, 4),
        ("psf_learned", {}, 4),
        ("polysketch", {"degree": 3}, 6),  # nonnegative by default: degree 2·3
        ("polysketch", {"degree": 3, "nonnegative": False}, 3),
    ],
)
def test_exact_mode_equals_polynomial_attention_with_the_same_weights(
    attention, map_kwargs, degree
):
    sketch = TransformerLM(tiny_model(attention=attention, map_kwargs=map_kwargs, seed=3))
    exact = TransformerLM(tiny_model(attention="polynomial", map_kwargs={"degree": degree}, seed=3))
    exact.load_state_dict(sketch.state_dict(), strict=False)  # all shared weights
    assert [target_degree(b.attn) for b in sketch.blocks] == [degree, degree]
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    want, _ = exact(idx)
    approx, _ = sketch(idx)
    assert sketch.set_exact_attention(True) == 2
    got, _ = sketch(idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (approx - want).abs().max() > 1e-3  # the sketch itself is different
    sketch.set_exact_attention(False)
    torch.testing.assert_close(sketch(idx)[0], approx, rtol=0, atol=0)


def test_set_exact_attention_refuses_what_has_no_polynomial_target():
    with pytest.raises(ValueError, match="no sketched attention"):
        TransformerLM(tiny_model(attention="softmax")).set_exact_attention(True)
    with pytest.raises(ValueError, match="not a homogeneous polynomial"):
        TransformerLM(tiny_model(attention="positive")).set_exact_attention(True)
    with pytest.raises(TypeError, match="exact"):
        TransformerLM(tiny_model(attention="psf_random")).set_exact_attention(1)
    with pytest.raises(ValueError, match="warm_start_steps"):
        tiny_train(warm_start_steps=-1).validate()


def test_training_switches_at_n_and_resumes_on_either_side(tmp_path, corpus):  # noqa: F811
    """Steps 1..N are exact polynomial steps (losses equal a polynomial run's), N+1.. the
    sketch; stopping before or after the switch and resuming equals the straight run."""
    mc = tiny_model(attention="psf_random")
    poly = train(tiny_model(attention="polynomial"), tiny_train(), corpus, progress=False)
    sketch = train(mc, tiny_train(), corpus, progress=False)
    straight = train(mc, tiny_train(tmp_path / "a", warm_start_steps=3), corpus, progress=False)
    ls, lp, lk = _losses(straight), _losses(poly), _losses(sketch)
    assert ls[:3] == lp[:3] and ls[0] != lk[0]  # exact, not the sketch, for steps 1..3
    assert ls[3] != lp[3]  # step 4 runs the sketch
    # the eval at step 2 is exact, the ones at steps 4 and 6 use the sketch
    assert straight["val"][0]["loss"] == poly["val"][0]["loss"]
    assert straight["val"][1]["loss"] != poly["val"][1]["loss"]
    model = straight["model"]
    assert all(exact_degree(b.attn) is None for b in model.blocks)  # ends in sketch mode
    for stop, folder in ((2, "before"), (4, "after")):
        out = tmp_path / folder
        first = train(
            mc, tiny_train(out, warm_start_steps=3), corpus, progress=False, stop_after=stop
        )
        assert _losses(first) == ls[:stop]
        assert [exact_degree(b.attn) for b in first["model"].blocks] == (
            [4, 4] if stop < 3 else [None, None]
        )
        resumed = train(
            mc, tiny_train(out, warm_start_steps=3), corpus, progress=False, resume=True
        )
        assert _losses(resumed) == ls
        assert [v["loss"] for v in resumed["val"]] == [v["loss"] for v in straight["val"]]
        assert all(exact_degree(b.attn) is None for b in resumed["model"].blocks)
        sa, sb = model.state_dict(), resumed["model"].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_cli_warm_start_flag_is_stored_and_resumed(tmp_path, capsys):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    out = tmp_path / "run"
    tiny = [
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--n-embd",
        "16",
        "--block-size",
        "16",
        "--chunk-size",
        "8",
        "--batch-size",
        "4",
        "--eval-batches",
        "2",
        "--no-progress",
    ]
    args = [
        "train",
        "--corpus",
        str(path),
        "--out",
        str(out),
        "--steps",
        "3",
        "--attention",
        "psf_random",
        "--warm-start-steps",
        "2",
        *tiny,
    ]
    assert main(args) == 0
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    assert state["train_config"]["warm_start_steps"] == 2
    assert main(["train", "--out", str(out), "--resume", "--steps", "4", "--no-progress"]) == 0
    assert load_checkpoint(out / "ckpt.pt", restore_rng=False)["step"] == 4
    capsys.readouterr()
    bad = [
        "train",
        "--corpus",
        str(path),
        "--out",
        str(tmp_path / "bad"),
        "--steps",
        "2",
        "--attention",
        "softmax",
        "--warm-start-steps",
        "1",
        *tiny,
    ]
    assert main(bad) == 2
    assert "no sketched attention" in capsys.readouterr().err
    bad[bad.index("softmax")] = "psf_random"
    bad[bad.index("--warm-start-steps") + 1] = "-1"
    assert main(bad) == 2
    assert "warm_start_steps" in capsys.readouterr().err
