"""Linearize fails early and clearly; peft keeps the added modules training; quiet reloads.

Tiny random-init models built from configs (as tests/test_integrations_transformers.py);
nothing is downloaded.
"""

import importlib
import logging
import os
import stat

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from polysketch._files import process_umask  # noqa: E402
from polysketch.cli import main  # noqa: E402
from polysketch.integrations.transformers import (  # noqa: E402
    LinearizeConfig,
    convert,
    linearize,
    load_converted,
    lora_targets,
    peft_modules_to_save,
    trainable_attention_parameters,
)

linearize_module = importlib.import_module("polysketch.integrations.transformers.linearize")

V = 64


def tiny(family: str, *, vocab: int = V):
    """A tiny random-init causal LM (2 layers × 64, GQA 4/2) of a family without a table
    entry in today's LoRA targets (qwen3, phi3) or with one (llama)."""
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
           "phi3": transformers.Phi3Config}[family]  # fmt: skip
    cfg = cls(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=0, eos_token_id=1, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def tokens(n=600, seed=0, vocab=V):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


QUICK = dict(seq_len=16, batch_size=2, transfer_steps=1, finetune_steps=1, eval_batches=1)


@pytest.mark.parametrize(
    "family, targets",
    [
        ("qwen3", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]),
        ("phi3", ["self_attn.o_proj", "self_attn.qkv_proj"]),
    ],
)
def test_default_lora_finetune_works_for_qwen3_and_phi3(family, targets):
    model = tiny(family)
    assert lora_targets(model) == targets
    out, res = linearize(
        model, tokens(), tokens(seed=1), attention="psf_random",
        config=LinearizeConfig(**QUICK, finetune="lora"), chunk_size=8,
    )  # fmt: skip
    assert len(res["finetune_history"]) == 1 and res["loss_finetune"] > 0
    assert not any("lora" in k for k in out.state_dict())  # merged back into a plain model


def _spy_on_work(monkeypatch):
    calls = []
    for name in ("convert", "evaluate_loss", "attention_transfer"):
        real = getattr(linearize_module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(linearize_module, name, spy)
    return calls


def test_lora_targets_that_do_not_fit_fail_before_any_work(monkeypatch):
    calls = _spy_on_work(monkeypatch)
    model = tiny("llama")
    config = LinearizeConfig(**QUICK, lora_targets=("query_proj",))
    with pytest.raises(ValueError, match="query_proj") as err:
        linearize(model, tokens(), tokens(seed=1), attention="psf_random", config=config)
    assert "--lora-targets" in str(err.value) and "--finetune full" in str(err.value)
    assert calls == []  # not evaluated, converted or transferred
    assert not any(hasattr(m, "polysketch") for m in model.modules())


def test_attention_without_linear_layers_has_no_default_targets():
    model = tiny("llama")
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, name, nn.Identity())
    with pytest.raises(ValueError, match="no LoRA targets") as err:
        lora_targets(model)
    assert "--lora-targets" in str(err.value) and "--finetune full" in str(err.value)


def test_cli_checks_lora_targets_before_any_work(tmp_path, capsys):
    tiny("llama", vocab=256).save_pretrained(tmp_path / "base")
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"Now is the winter of our discontent {i}.\n" for i in range(200)))
    out = tmp_path / "out"
    rc = main(["linearize", "--model", str(tmp_path / "base"), "--data", str(text),
               "--out", str(out), "--seq-len", "16", "--lora-targets", "query_proj"])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert "polysketch linearize: error:" in err and "--lora-targets" in err
    assert list(out.iterdir()) == []  # no results, no model


def test_peft_modules_to_save_keeps_the_added_modules_training():
    model = tiny("llama")
    convert(model, "psf_learned", chunk_size=8, num_features=8)
    names = peft_modules_to_save(model)
    assert names == ["polysketch.q_norm", "polysketch.k_norm", "polysketch.feature_map"]
    added = {n: p.detach().clone() for n, p in model.named_parameters() if ".polysketch." in n}
    assert len(added) == len(trainable_attention_parameters(model))

    frozen = peft.get_peft_model(tiny("llama"), peft.LoraConfig(target_modules=["q_proj"]))
    assert not any(p.requires_grad for n, p in frozen.named_parameters() if "lora" not in n)

    config = peft.LoraConfig(r=4, target_modules=lora_targets(model), modules_to_save=names)
    pm = peft.get_peft_model(model, config)
    copies = [p for n, p in pm.named_parameters() if ".modules_to_save." in n]
    assert len(copies) == len(added) and all(p.requires_grad for p in copies)
    optimizer = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=1.0)
    x = tokens(32).reshape(2, 16)
    pm(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    merged = pm.merge_and_unload()
    after = {n: p for n, p in merged.named_parameters() if ".polysketch." in n}
    assert after.keys() == added.keys()
    changed = [n for n in added if not torch.equal(after[n], added[n])]
    assert len(changed) == len(added)  # every added parameter trained and was kept


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_load_converted_is_quiet_unless_something_is_really_wrong(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    model = tiny("llama")
    convert(model, "psf_random", chunk_size=8)
    model.save_pretrained(tmp_path / "m")
    logger = logging.getLogger("transformers.modeling_utils")
    records = _Records()
    logger.addHandler(records)
    try:
        load_converted(tmp_path / "m")
        assert not any("LOAD REPORT" in m for m in records.messages)  # only our tensors: quiet
        (weights,) = (tmp_path / "m").glob("*.safetensors")
        tensors = load_file(str(weights))
        del tensors["model.norm.weight"]  # a real problem: a base weight is missing
        save_file(tensors, str(weights), metadata={"format": "pt"})
        load_converted(tmp_path / "m")
    finally:
        logger.removeHandler(records)
    (report,) = [m for m in records.messages if "LOAD REPORT" in m]
    assert "MISSING" in report and "model.norm.weight" in report


def test_saved_model_folder_follows_the_umask(tmp_path):
    from polysketch.integrations.transformers.linearize import _save_model_atomically

    model = tiny("llama")
    old = os.umask(0o022)
    try:
        path = _save_model_atomically(model, tmp_path / "model")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in path.iterdir())
    path = _save_model_atomically(model, tmp_path / "model")  # replaces the folder
    assert stat.S_IMODE(path.stat().st_mode) == 0o777 & ~process_umask()
    assert not list(tmp_path.glob(".model.*"))  # no temporary or old folder left


def test_missing_model_is_named_before_transformers_is_asked(tmp_path, capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("transformers was asked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    missing = tmp_path / "missing"
    assert main(["linearize", "--model", str(missing), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"polysketch linearize: error: --model {missing} does not exist" in err
    (tmp_path / "empty").mkdir()
    assert (
        main(["linearize", "--model", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    )
    assert "no config.json" in capsys.readouterr().err


def _option_help(text: str, flag: str) -> str:
    """The help entry of ``flag`` in ``--help`` output (its lines, joined)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(flag + " "))
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if line.startswith("  -") or not line.strip():  # the next option (continuations: deeper)
            break
        block.append(line)
    return " ".join(" ".join(block).split())


def test_linearize_help(capsys):
    with pytest.raises(SystemExit):
        main(["linearize", "--help"])
    text = capsys.readouterr().out
    out_help = _option_help(text, "--out")
    assert "results.json" in out_help and "(default: linearize-out)" in out_help
    tbs = _option_help(text, "--transfer-batch-size")
    assert tbs.count("default") == 1 and "--batch-size" in tbs and "None" not in tbs
