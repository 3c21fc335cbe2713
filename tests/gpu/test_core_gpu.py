"""CUDA-only: a converted bf16 transformers model and the layer under autocast reach the ops
with half operands (``ops.dispatch`` decides on the device; issue 23 §2). Skipped without CUDA."""

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA checks: run `make test-gpu` on a CUDA machine"
)


def _spy(monkeypatch):
    from polysketch.ops import kernel

    seen, real = [], kernel.plan

    def plan(*args, **kwargs):
        p = real(*args, **kwargs)
        seen.append((p.name, p.operand_dtype))
        return p

    monkeypatch.setattr(kernel, "plan", plan)
    return seen


def test_converted_bf16_model_runs_half_operands_on_cuda(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from polysketch.integrations.transformers import PolysketchCache, convert

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).eval()
    convert(model, "psf_random", chunk_size=64)
    seen = _spy(monkeypatch)
    x = torch.randint(0, 64, (2, 300), device="cuda")
    with torch.no_grad():
        logits = model(input_ids=x, past_key_values=PolysketchCache(model)).logits
    assert torch.isfinite(logits).all()
    assert seen and all(entry == ("chunked_blocks", torch.bfloat16) for entry in seen)


def test_layer_with_qk_norm_under_autocast_runs_half_operands(monkeypatch):
    from polysketch.nn import KernelAttention

    layer = KernelAttention(256, 4, attention="psf_random", chunk_size=64).cuda()
    seen = _spy(monkeypatch)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(torch.randn(1, 300, 256, device="cuda"))
    assert y.dtype == torch.bfloat16
    assert seen == [("chunked_blocks", torch.bfloat16)]
