"""``polysketch train``, ``polysketch generate`` and ``polysketch mqar`` end to end."""

import csv
import json

import pytest
import torch

from polysketch._checks import parse_key_values
from polysketch.cli import main
from polysketch.commands import train as train_command
from polysketch.data.tokenizer import ByteTokenizer
from polysketch.nn import MODEL_PRESETS
from polysketch.train import load_checkpoint, load_model

TEXT = "".join(f"To be, or not to be: that is question {i}.\n" for i in range(60))
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--chunk-size", "8", "--batch-size", "4", "--eval-batches", "2",
        "--no-progress"]  # fmt: skip


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def test_train_then_resume_then_generate(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    args = ["train", "--corpus", str(text_file), "--out", str(out), "--steps", "4",
            "--log-interval", "2", "--eval-interval", "2", "--attention", "polysketch",
            "--map-kw", "num_features=8", "--map-kw", "projection=gaussian", *TINY]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "val_loss=" in printed and str(out / "ckpt.pt") in printed
    assert (out / "ckpt.pt").is_file()
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["split"]) for r in rows] == [
        ("2", "train"), ("2", "val"), ("4", "train"), ("4", "val")
    ]  # fmt: skip
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [float(r["loss"]) for r in rows] == [r["loss"] for r in jsonl]
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    assert state["model_config"]["map_kwargs"] == {"num_features": 8, "projection": "gaussian"}
    assert state["metadata"]["source"]["corpus"] == str(text_file)

    # --resume takes configs and data from the checkpoint; --steps extends the run
    assert main(["train", "--out", str(out), "--resume", "--steps", "6", "--no-progress"]) == 0
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    assert state["step"] == 6 and len(state["history"]["train"]) == 6
    capsys.readouterr()

    # greedy generation from the checkpoint equals the model's own generate
    prompt = "To be"
    assert main(["generate", "--checkpoint", str(out / "ckpt.pt"), "--prompt", prompt,
                 "--max-new-tokens", "12", "--temperature", "0"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    model, _ = load_model(out / "ckpt.pt", "cpu")
    idx = ByteTokenizer().encode(prompt)[None]
    want = ByteTokenizer().decode(model.generate(idx, 12, temperature=0.0)[0])
    assert text == want + "\n"
    assert text.startswith(prompt)

    # sampling is reproducible by --seed
    sample = ["generate", "--checkpoint", str(out / "ckpt.pt"), "--prompt", prompt,
              "--max-new-tokens", "12", "--seed", "3", "--top-k", "5"]  # fmt: skip
    assert main(sample) == 0
    first = capsys.readouterr().out
    assert main(sample) == 0
    assert capsys.readouterr().out == first


def test_train_mqar_task_and_generate_refuses_it(tmp_path, capsys):
    out = tmp_path / "mqar"
    args = ["train", "--task", "mqar", "--mqar-vocab", "32", "--mqar-seq-len", "16",
            "--mqar-kv-pairs", "2", "--mqar-train", "16", "--mqar-val", "8", "--steps", "2",
            "--attention", "elu", "--out", str(out), "--short-conv", "3", "--qk-dim", "4",
            "--local-window", "4", "--local-shared", *TINY]  # fmt: skip
    assert main(args) == 0
    assert "val_accuracy=" in capsys.readouterr().out
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    assert state["model_config"]["vocab_size"] == 32
    assert (state["model_config"]["short_conv"], state["model_config"]["qk_dim"]) == (3, 4)
    assert state["model_config"]["local_window"] == 4
    assert state["model_config"]["local_shared"] is True
    assert main(["generate", "--checkpoint", str(out / "ckpt.pt"), "--prompt", "x"]) == 2
    assert "MQAR" in capsys.readouterr().err


def test_mqar_quick_sweep_writes_csv_and_png(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["mqar", "--quick", "--threads", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    with open(out / "mqar.csv") as f:
        rows = {r["attention"]: r for r in csv.DictReader(f)}
    expected = ["softmax", "polysketch", "llops", "tensorsketch", "hybrid_angular", "taylor", "elu"]
    assert sorted(rows) == sorted(expected)
    assert all(name in printed for name in expected)
    assert (out / "mqar.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # softmax keeps a KV cache: 2 (k, v) · layers · heads · head dim · T floats (quick sizes)
    assert int(rows["softmax"]["state_size"]) == 2 * 2 * 2 * 8 * 16
    for r in rows.values():
        assert 0.0 <= float(r["accuracy"]) <= 1.0 and float(r["val_loss"]) > 0


def test_mqar_plot_labels_of_nearby_points_do_not_overlap(tmp_path, monkeypatch):
    """Points close in state size and recall get long labels: none prints over another."""
    from polysketch.eval import mqar_sweep

    boxes = {}

    def record(fig, labels, **kw):
        real(fig, labels, **kw)
        renderer = fig.canvas.get_renderer()
        boxes["all"] = [label.get_window_extent(renderer) for label in labels]

    real = mqar_sweep._unstack
    monkeypatch.setattr(mqar_sweep, "_unstack", record)
    rows = [dict(attention=name, lr=1e-3, state_size=size, params=1, val_loss=1.0, accuracy=acc)
            for name, size, acc in (("soft_hash_far_local:num_features=128", 24436, 0.115),
                                    ("soft_hash_local:num_features=128", 33536, 0.116),
                                    ("taylor:qk_dim=16", 36548, 0.077),
                                    ("softmax", 262144, 0.5))]  # fmt: skip
    mqar_sweep.plot_sweep(rows, tmp_path / "mqar.png")
    placed = boxes["all"]
    assert len(placed) == 4
    for i, a in enumerate(placed):
        for b in placed[:i]:
            assert not a.overlaps(b)


def test_mqar_specs_and_learning_rate_sweep(tmp_path, capsys):
    """NAME:key=value specs configure model and map; each spec runs at every --lrs value and
    the table reports its best run."""
    out = tmp_path / "specs"
    argv = ["mqar", "--quick", "--threads", "1", "--out", str(out), "--short-conv", "3",
            "--attentions", "softmax", "taylor:qk_dim=4", "llops:num_features=8,degree=4",
            "--lrs", "1e-3", "3e-3"]  # fmt: skip
    assert main(argv) == 0
    with open(out / "mqar.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["attention"], float(r["lr"])) for r in rows] == [
        (a, lr) for a in ("softmax", "taylor:qk_dim=4", "llops:num_features=8,degree=4")
        for lr in (1e-3, 3e-3)
    ]  # fmt: skip
    state = {r["attention"]: int(r["state_size"]) for r in rows}
    conv_tail = 2 * 2 * (3 * 16)  # (K - 1) · layers · (q, k, v columns) with qk_dim = D = 8
    assert state["softmax"] == 2 * 2 * 2 * 8 * 16 + conv_tail
    # taylor on 4-dim q/k: 1 + 4 + 16 features, (D + 1) columns, per head and layer
    assert state["taylor:qk_dim=4"] == 2 * 2 * 21 * 9 + 2 * 2 * (2 * 2 * 4 + 16)
    assert state["llops:num_features=8,degree=4"] == 2 * 2 * 8 * 9 + conv_tail
    printed = capsys.readouterr().out
    assert "best lr" in printed and "llops:num_features=8,degree=4" in printed


def test_mqar_model_keys_and_rows_reported_as_they_finish():
    """qk_norm / rope in a spec reach the model; on_row sees the rows after every run (the CLI
    rewrites its CSV there)."""
    from polysketch.eval.mqar_sweep import QUICK, parse_attention, run_sweep

    assert parse_attention("polynomial:degree=2,qk_norm=False,rope=False") == (
        "polynomial", {"qk_norm": False, "rope": False}, {"degree": 2}
    )  # fmt: skip
    seen = []
    rows = run_sweep(
        ["polynomial:degree=2,qk_norm=False,rope=False", "polynomial:degree=2"],
        settings={**QUICK, "steps": 1}, log=None, on_row=lambda done: seen.append(len(done)),
    )  # fmt: skip
    assert seen == [1, 2] and len(rows) == 2


def test_transformer_config_qk_norm_switch():
    from polysketch.nn import TransformerConfig, TransformerLM

    base = {"vocab_size": 16, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 8,
            "attention": "polynomial"}  # fmt: skip
    assert TransformerLM(TransformerConfig(**base)).blocks[0].attn.q_norm is not None
    off = TransformerLM(TransformerConfig(**base, qk_norm=False)).blocks[0].attn
    assert off.q_norm is None and off.k_norm is None
    with pytest.raises(TypeError, match="qk_norm"):
        TransformerConfig(**base, qk_norm="no").validate()


def test_parse_attention_and_best_rows():
    from polysketch.eval.mqar_sweep import best_rows, parse_attention

    assert parse_attention("softmax") == ("softmax", {}, {})
    assert parse_attention("polysketch:num_features=16,projection=product,qk_dim=4") == (
        "polysketch", {"qk_dim": 4}, {"num_features": 16, "projection": "product"}
    )  # fmt: skip
    with pytest.raises(ValueError, match="unknown 'nope'"):
        parse_attention("nope:degree=2")
    with pytest.raises(ValueError, match="key=value"):
        parse_attention("llops:degree")
    rows = [
        {"attention": "a", "accuracy": 0.5, "val_loss": 1.0, "lr": 1},
        {"attention": "a", "accuracy": 0.7, "val_loss": 2.0, "lr": 2},
        {"attention": "b", "accuracy": 0.1, "val_loss": 1.0, "lr": 1},
        {"attention": "a", "accuracy": 0.7, "val_loss": 1.5, "lr": 3},
    ]
    assert [(r["attention"], r["lr"]) for r in best_rows(rows)] == [("a", 3), ("b", 1)]
    # the core's options (mixed attention with any map, its learned balance, the window)
    # configure the model, not the feature map
    assert parse_attention("soft_hash_1k:mixed=True,learn_balance=True,num_features=64") == (
        "soft_hash_1k", {"mixed": True, "learn_balance": True}, {"num_features": 64}
    )  # fmt: skip
    assert parse_attention("sliding_window:window=8") == ("sliding_window", {"window": 8}, {})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--corpus", "/no/such/corpus.txt"], "/no/such/corpus.txt"),
        (["train", "--attention", "no_such_attention"], "--attention"),
        (["train", "--map-kw", "oops"], "--map-kw"),
        (["train", "--lr", "-1"], "lr"),
        (["train", "--resume"], "ckpt.pt"),
        (["mqar", "--quick", "--attentions", "softmax", "bogus"], "attentions"),
        (["mqar", "--quick", "--threads", "0"], "threads"),
        (["mqar", "--quick", "--lrs", "0"], "lrs"),
        (["generate", "--checkpoint", "/no/such/ckpt.pt"], "ckpt.pt"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(tmp_path, capsys, argv, message):
    if argv[0] == "train":
        argv = [*argv, "--out", str(tmp_path / "o"), *TINY]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and message in err


def test_batch_not_divisible_by_world_size(tmp_path, text_file, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["train", "--corpus", str(text_file), "--out", str(tmp_path / "o"), *TINY]
    argv[argv.index("--batch-size") + 1] = "3"
    assert main(argv) == 2
    assert "batch_size" in capsys.readouterr().err


def test_map_kw_parses_literals_and_strings():
    items = ["num_features=32", "nonnegative=True", "projection=srht", "s=1e-3"]
    got = parse_key_values(items, "--map-kw")  # what train and linearize do with --map-kw
    assert got == {"num_features": 32, "nonnegative": True, "projection": "srht", "s": 1e-3}
    with pytest.raises(ValueError, match="--map-kw"):
        parse_key_values(["=3"], "--map-kw")


def test_train_help_lists_options(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for flag in ("--corpus", "--task", "--attention", "--amp", "--resume", "--map-kw", "--device"):
        assert flag in out


def test_gradient_surrogate_flag_sets_lambda_and_bad_values_are_refused(tmp_path, capsys):
    out = tmp_path / "far"
    assert main(["train", "--attention", "soft_hash_far_local", "--gradient-surrogate", "3",
                 "--steps", "1", "--out", str(out), *TINY]) == 0  # fmt: skip
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    assert state["model_config"]["gradient_surrogate"] == 3.0  # the flag wins over the preset
    capsys.readouterr()
    for attention, value, message in (("soft_hash_far_local", "-1", "must be >= 0"),
                                      ("psf_random", "2", "needs mixed attention")):  # fmt: skip
        code = main(["train", "--attention", attention, "--gradient-surrogate", value,
                     "--steps", "1", "--out", str(tmp_path / f"bad{value}"), *TINY])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and "error: gradient_surrogate" in err and message in err, err


def test_train_and_generate_with_the_far_preset_and_its_surrogate(tmp_path, capsys):
    out = tmp_path / "far"
    assert main(["train", "--attention", "soft_hash_far_local", "--steps", "2", "--out", str(out),
                 *TINY]) == 0  # fmt: skip
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    assert state["model_config"]["attention"] == "soft_hash_far_local"
    preset = MODEL_PRESETS["soft_hash_far_local"]  # its λ, written out (stored_model_config)
    assert state["model_config"]["gradient_surrogate"] == preset.gradient_surrogate
    assert main(["generate", "--checkpoint", str(out / "ckpt.pt"), "--prompt", "abcdefghijk",
                 "--max-new-tokens", "3"]) == 0  # fmt: skip
    capsys.readouterr()


def test_flush_denormals_is_in_force_for_the_run_only_and_refused_where_unsupported(
    tmp_path, capsys, monkeypatch
):
    calls, seen = [], []
    real = torch.set_flush_denormal
    real_train = train_command.train

    def record(flag):
        calls.append(flag)
        return real(flag)

    def train_and_look(*args, **kwargs):  # a subnormal inside the run reads 0
        seen.append((torch.tensor(1e-39) * torch.tensor(1.0)).item())
        return real_train(*args, **kwargs)

    monkeypatch.setattr(torch, "set_flush_denormal", record)
    monkeypatch.setattr(train_command, "train", train_and_look)
    out = tmp_path / "flush"
    assert main(["train", "--attention", "psf_random", "--steps", "1", "--out", str(out),
                 "--flush-denormals", *TINY]) == 0  # fmt: skip
    assert calls == [True, False] and seen == [0.0]
    assert (torch.tensor(1e-39) * torch.tensor(1.0)).item() > 0  # undone after the run
    assert main(["train", "--out", str(out), "--resume", "--steps", "2", "--no-progress",
                 "--flush-denormals"]) == 0  # fmt: skip
    assert calls == [True, False, True, False]
    monkeypatch.setattr(torch, "set_flush_denormal", lambda flag: False)  # a CPU without SSE3
    capsys.readouterr()
    assert main(["train", "--attention", "psf_random", "--steps", "1", "--out",
                 str(tmp_path / "none"), "--flush-denormals", *TINY]) == 2  # fmt: skip
    assert "--flush-denormals" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def test_train_takes_a_model_preset(tmp_path, capsys):
    out = tmp_path / "local"
    assert main(["train", "--attention", "soft_hash_local", "--steps", "2", "--out", str(out),
                 *TINY]) == 0  # fmt: skip
    assert "attention=soft_hash_local" in capsys.readouterr().out
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    assert state["model_config"]["attention"] == "soft_hash_local"
    assert main(["generate", "--checkpoint", str(out / "ckpt.pt"), "--prompt", "ab",
                 "--max-new-tokens", "3"]) == 0  # fmt: skip
    one = tmp_path / "one_head"
    assert main(["train", "--attention", "soft_hash_local", "--global-heads", "1", "--steps", "2",
                 "--value-dim", "4", "--out", str(one), *TINY]) == 0  # fmt: skip
    config = load_checkpoint(one / "ckpt.pt", restore_rng=False)["model_config"]
    assert (config["global_heads"], config["value_dim"]) == (1, 4)
    assert main(["generate", "--checkpoint", str(one / "ckpt.pt"), "--prompt", "ab",
                 "--max-new-tokens", "3"]) == 0  # fmt: skip
    assert main(["train", "--attention", "psf_random", "--global-heads", "1", "--steps", "2",
                 "--out", str(tmp_path / "bad"), *TINY]) == 2  # fmt: skip
    assert "error:" in capsys.readouterr().err
    every = tmp_path / "every"
    assert main(["train", "--attention", "soft_hash_local", "--global-every", "2", "--steps", "2",
                 "--out", str(every), *TINY, "--n-layer", "2"]) == 0  # fmt: skip
    config = load_checkpoint(every / "ckpt.pt", restore_rng=False)["model_config"]
    assert config["global_every"] == 2
    unrotated = tmp_path / "unrotated"
    assert main(["train", "--attention", "soft_hash_local", "--no-global-rope", "--steps", "2",
                 "--out", str(unrotated), *TINY]) == 0  # fmt: skip
    config = load_checkpoint(unrotated / "ckpt.pt", restore_rng=False)["model_config"]
    assert config["global_rope"] is False
    assert main(["generate", "--checkpoint", str(every / "ckpt.pt"), "--prompt", "ab",
                 "--max-new-tokens", "3"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["train", "--attention", "psf_random", "--global-every", "2", "--steps", "2",
                 "--out", str(tmp_path / "bad_every"), *TINY, "--n-layer", "2"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "error:" in err and "global_every" in err


# ----- issue 43: short runs, out of memory, the header --------------------------------------
def test_default_warmup_scales_to_a_short_run(tmp_path, text_file, capsys):
    """Without --warmup-steps, warmup is 10% of --steps (at most 100): a 20-step run leaves
    warmup after 2 steps and its last step's rate is near --min-lr, no warning."""
    out = tmp_path / "short"
    argv = ["train", "--corpus", str(text_file), "--out", str(out), "--steps", "20",
            "--eval-interval", "20", *TINY]  # fmt: skip
    assert main(argv) == 0
    assert "warning" not in capsys.readouterr().err
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    assert state["train_config"]["warmup_steps"] == 2
    lrs = [r["lr"] for r in state["history"]["train"]]
    assert max(lrs) == pytest.approx(1e-3, rel=0.02)  # the peak --lr is reached
    assert lrs[-1] < 0.15e-3  # and the cosine decays to the floor (--min-lr 1e-4)


def test_default_warmup_of_a_long_run_is_unchanged():
    from polysketch.commands.train import default_warmup

    assert default_warmup(1000) == 100 and default_warmup(5000) == 100
    assert default_warmup(30) == 3 and default_warmup(5) == 0


def test_an_explicit_warmup_longer_than_the_run_is_warned_about(tmp_path, text_file, capsys):
    out = tmp_path / "warm"
    argv = ["train", "--corpus", str(text_file), "--out", str(out), "--steps", "3",
            "--warmup-steps", "100", *TINY]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "warning:" in line]
    assert len(lines) == 1, err  # one line, not the library's warning as well
    assert "polysketch train: warning: --warmup-steps 100" in lines[0] and "--steps 3" in lines[0]
    assert "2.97e-05" in lines[0]  # the rate of the last step: 1e-3 · 3 / 101


def _oom(kind):
    def step(*args, **kwargs):
        if kind == "cuda":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
            "allocate memory: you tried to allocate 40000000000000 bytes."
        )

    return step


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_out_of_memory_is_an_error_line_and_leaves_no_folder(tmp_path, text_file, capsys,
                                                              monkeypatch, kind):  # fmt: skip
    """Issue 43 item 6, the allocation failure injected (nothing is allocated): exit 2, one
    error line naming the batch and block size, no folder left to refuse the rerun; the
    config header was printed before the first step (item 7)."""
    from polysketch.train import loop

    out = tmp_path / "oom"
    argv = ["train", "--corpus", str(text_file), "--out", str(out), "--steps", "2", *TINY]
    real = loop._optimizer_step
    monkeypatch.setattr(loop, "_optimizer_step", _oom(kind))
    assert main(argv) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("polysketch train: error: out of memory")
    assert "batch size 4" in errors[0] and "block size 16" in errors[0], errors[0]
    assert "Traceback" not in captured.err
    assert "tokens per step" in captured.out  # the header came first
    assert not out.exists()
    monkeypatch.setattr(loop, "_optimizer_step", real)
    assert main(argv) == 0  # the corrected rerun is not refused


def test_a_failed_run_keeps_a_folder_the_user_made(tmp_path, text_file, capsys, monkeypatch):
    from polysketch.train import loop

    out = tmp_path / "mine"
    out.mkdir()
    monkeypatch.setattr(loop, "_optimizer_step", _oom("cpu"))
    argv = ["train", "--corpus", str(text_file), "--out", str(out), "--steps", "2", *TINY]
    assert main(argv) == 2
    assert out.is_dir() and not any(out.iterdir())


def test_the_config_header_is_printed_before_the_first_step(tmp_path, text_file, capsys):
    out = tmp_path / "head"
    argv = ["train", "--corpus", str(text_file), "--out", str(out), "--steps", "2",
            "--grad-accum", "2", *TINY]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header = "\n".join(lines[:4])
    from polysketch.nn import TransformerConfig, TransformerLM

    config = TransformerConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16,
                               chunk_size=8)  # fmt: skip
    params = TransformerLM(config).num_parameters()
    assert f"{params:,} parameters" in header
    assert "4 sequences x 16 tokens = 64 tokens per step" in header
    assert "2 micro-batches of 2" in header
    assert "device cpu" in header and "float32" in header
    assert "warmup 0" in header and "2 steps" in header


def test_mqar_takes_no_progress_like_every_command(tmp_path, capsys, monkeypatch):
    """Issue 43: ``--no-progress`` (progress on by default), as train, approx, bench, demo."""
    from polysketch.commands import mqar

    seen = []

    def sweep(attentions, **kwargs):
        seen.append(kwargs["progress"])
        return []

    monkeypatch.setattr(mqar, "run_sweep", sweep)
    monkeypatch.setattr(mqar, "plot_sweep", lambda *a, **k: None)
    for i, (flag, progress) in enumerate((([], True), (["--no-progress"], False))):
        main(["mqar", "--quick", "--attentions", "softmax", "--out", str(tmp_path / f"o{i}"),
              *flag])  # fmt: skip
        assert seen.pop() is progress
    with pytest.raises(SystemExit):
        main(["mqar", "--quick", "--progress", "--out", str(tmp_path / "o2")])
    capsys.readouterr()


# ----- one source of truth: flags from the configs, a config file read first (issue 40) --------
def test_every_config_field_has_its_flag_with_its_help(capsys):
    """The model and training flags are generated from the dataclasses: every field the command
    does not set itself has a flag, and the flag's help is the field's."""
    import dataclasses

    from polysketch._fields import help_of
    from polysketch.nn import TransformerConfig
    from polysketch.train import TrainConfig

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    own = {"vocab_size", "seed", "map_kwargs", "out_dir", "block_size"}  # set by the command
    for cls in (TransformerConfig, TrainConfig):
        for f in dataclasses.fields(cls):
            if f.name in own:
                continue
            assert "--" + f.name.replace("_", "-") in text, f.name
            assert " ".join(help_of(f).split())[:40] in text, f.name


def test_a_config_file_is_read_first_and_flags_override_it(tmp_path, text_file, capsys):
    config = tmp_path / "run.toml"
    config.write_text(
        f'[data]\ncorpus = "{text_file}"\n\n'
        '[model]\nattention = "elu"\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\n'
        "[model.map_kwargs]\n\n"
        "[train]\nsteps = 3\nbatch_size = 2\nlr = 0.002\neval_batches = 1\n"
    )
    out = tmp_path / "run"
    argv = ["train", "--config", str(config), "--n-embd", "32", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    model, train = state["model_config"], state["train_config"]
    assert (model["attention"], model["n_layer"], model["n_embd"]) == ("elu", 1, 32)  # flag wins
    assert (train["steps"], train["lr"], train["warmup_steps"]) == (3, 0.002, 0)
    assert state["metadata"]["source"]["corpus"] == str(text_file)


@pytest.mark.parametrize("content,message", [
    ("[model]\nn_layers = 2\n", r"unknown keys \['n_layers'\] in \[model\]"),
    ("[optim]\nlr = 1.0\n", r"unknown tables \['optim'\]"),
    ("[model\n", "is not TOML"),
])  # fmt: skip
def test_a_bad_config_file_is_an_error_naming_it(tmp_path, capsys, content, message):
    config = tmp_path / "run.toml"
    config.write_text(content)
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err
    import re

    assert re.search(message, err), err
    assert not (tmp_path / "o").exists()


def test_help_states_the_warmup_default_the_cli_applies(capsys):
    """``--warmup-steps`` is 10% of ``--steps`` when not given (``default_warmup``), not the
    dataclass's 100: the help says so."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "linear warmup steps (default: 10% of --steps, at most 100)" in text
