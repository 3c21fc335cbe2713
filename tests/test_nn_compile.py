"""torch.compile(fullgraph=True) of TransformerLM, sync-free id checks, the layer's precision
policy (half stays half on accelerators), and ``polysketch train --compile``."""

import pytest
import torch
import torch.nn.functional as F

from polysketch.cli import main
from polysketch.nn import KernelAttention, TransformerConfig, TransformerLM
from polysketch.train import load_checkpoint


@pytest.mark.parametrize("attention", ["psf_random", "softmax"])
def test_transformer_compiles_fullgraph_and_matches_eager(attention):
    torch._dynamo.reset()
    model = TransformerLM(
        TransformerConfig(n_layer=1, n_head=2, n_embd=32, attention=attention, chunk_size=16)
    )
    # backend "eager": dynamo's graph capture (where graph breaks happen) without AOT tracing,
    # which test_ops_blocks covers for the attention op; keeps this test fast on CPU
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    for t in (40, 70):  # two lengths (a recompile at most), no graph break
        idx = torch.randint(0, 256, (2, t), generator=torch.Generator().manual_seed(t))
        logits, loss = compiled(idx, idx)
        loss.backward()
        ref, _ = model(idx, idx)
        assert torch.allclose(logits, ref, atol=1e-5)


def test_compiled_model_still_refuses_bad_ids():
    torch._dynamo.reset()
    model = TransformerLM(TransformerConfig(n_layer=1, n_head=2, n_embd=16))
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with pytest.raises(RuntimeError, match="vocab_size"):
        compiled(torch.full((1, 5), 300))
    with pytest.raises(ValueError, match="vocab_size"):  # eager on CPU: a ValueError
        model(torch.full((1, 5), -1))


@pytest.mark.parametrize("attention", ["softmax", "psf_random"])
def test_attention_core_keeps_half_on_accelerators(attention, monkeypatch):
    """With the accelerator policy (operand dtype = input dtype) bf16 q/k/v reach the core as
    bf16 (so SDPA can pick FlashAttention); with the CPU policy they are computed in fp32."""
    import polysketch.nn.core as attention_module  # the one attention core (nn.core)
    from polysketch.ops import dispatch

    seen = []
    real_sdpa, real_linear = F.scaled_dot_product_attention, attention_module.linear_attention

    def sdpa(q, *args, **kwargs):
        seen.append(q.dtype)
        return real_sdpa(q, *args, **kwargs)

    def linear(phi_q, *args, **kwargs):
        seen.append(phi_q.dtype)
        return real_linear(phi_q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(attention_module, "linear_attention", linear)
    layer = KernelAttention(32, 2, attention=attention, chunk_size=8).to(torch.bfloat16)
    x = torch.randn(1, 20, 32, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16
    assert seen[-1] == torch.float32  # CPU policy: fp32 compute
    monkeypatch.setattr(dispatch, "operand_dtype", lambda dtype, device: dtype)
    assert layer(x).dtype == torch.bfloat16
    assert seen[-1] == torch.bfloat16  # accelerator policy: half operands into the core


def test_train_compile_flag_runs_and_checkpoints_the_plain_model(tmp_path, capsys):
    torch._dynamo.reset()
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"line {i} of a small corpus.\n" for i in range(80)))
    out = tmp_path / "run"
    args = ["train", "--corpus", str(path), "--out", str(out), "--steps", "2",
            "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
            "--chunk-size", "8", "--batch-size", "2", "--eval-batches", "1", "--no-progress",
            "--attention", "psf_random", "--compile", "aot_eager"]  # fmt: skip
    assert main(args) == 0
    state = load_checkpoint(out / "ckpt.pt", restore_rng=False)
    assert state["train_config"]["compile"] == "aot_eager"
    assert not any(k.startswith("_orig_mod") for k in state["model"])
    assert main(["train", "--corpus", str(path), "--out", str(tmp_path / "bad"),
                 "--compile", "no-such-backend", "--steps", "1"]) == 2  # fmt: skip
    assert "compile" in capsys.readouterr().err
