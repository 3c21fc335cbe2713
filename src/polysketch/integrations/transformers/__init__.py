"""Hugging Face transformers integration: kernelized attention in pretrained causal LMs.

    model = AutoModelForCausalLM.from_pretrained(path)
    convert(model, attention="psf_mixed")            # q/k/v/o, RoPE and GQA kept
    model.generate(ids, max_new_tokens=50)           # decodes from a constant-size state
    linearize(model, train_tokens, val_tokens, ...)  # attention transfer + short fine-tune
    model.save_pretrained(out); load_converted(out)  # round trip

Mechanism (see ``docs/hf_integration.md``): every supported family (Llama, Qwen2, Mistral,
GPT-NeoX, GPT-2) calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with the
projected, rotated q (B, H, T, D) and k, v (B, H_kv, T, D) after the cache update, so one
registered attention function (``"polysketch"``) serves them all; the per-layer state it
needs (q/k norms, per-head feature maps) is a submodule ``polysketch`` of each attention
module, so it is in the ``state_dict``. Decoding uses ``PolysketchCache`` (a transformers
``Cache``) that holds ``LinearAttentionState``s instead of keys and values.

Requires the ``hf`` extra (``pip install polysketch[hf]``: transformers >= 5.0, peft; tested
with transformers 5.23 and peft 0.21).
"""

from __future__ import annotations

try:
    import transformers as _transformers  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "polysketch.integrations.transformers needs Hugging Face transformers: "
        "pip install polysketch[hf]"
    ) from err

from .attention import ATTENTION_NAME, PolysketchAttention, polysketch_attention_forward
from .cache import PolysketchCache
from .convert import attention_modules, convert, load_converted, polysketch_settings
from .linearize import (
    LinearizeConfig,
    attention_transfer,
    evaluate_loss,
    finetune,
    linearize,
    linearize_saved,
    trainable_attention_parameters,
)
from .lora import lora_targets, peft_modules_to_save

__all__ = [
    "ATTENTION_NAME",
    "LinearizeConfig",
    "PolysketchAttention",
    "PolysketchCache",
    "attention_modules",
    "attention_transfer",
    "convert",
    "evaluate_loss",
    "finetune",
    "linearize",
    "linearize_saved",
    "load_converted",
    "lora_targets",
    "peft_modules_to_save",
    "polysketch_attention_forward",
    "polysketch_settings",
    "trainable_attention_parameters",
]
