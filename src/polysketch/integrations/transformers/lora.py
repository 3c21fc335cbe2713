"""LoRA (peft) on a converted model: which modules to adapt, which to keep training.

* ``lora_targets(model, names=None)``: peft ``target_modules`` — the linear layers of the
  attention modules (any family ``attention_modules`` finds: Llama, Qwen2/3, Mistral, Phi-3's
  fused ``qkv_proj``, GPT-NeoX, GPT-2's ``Conv1D``), or given names checked against the model.
  It only reads the module tree, so ``linearize`` calls it before any work.
* ``peft_modules_to_save(model)``: peft ``modules_to_save`` — the trainable submodules that
  ``convert`` added (q/k norms, learnable feature maps). ``get_peft_model`` freezes every
  module it does not adapt; without these names they would silently stop training.
"""

from __future__ import annotations

from torch import nn

from .convert import attention_modules, converted_cores

__all__ = ["lora_targets", "peft_modules_to_save", "lora_model", "require_peft", "LORA_HINT"]

LORA_HINT = (
    "pass --lora-targets NAME [NAME ...] (module names of the attention projections; "
    "LinearizeConfig(lora_targets=...) in Python) or --finetune full"
)
"""What to do when LoRA targets do not fit, phrased as the CLI flags (and the Python name)."""


def _adaptable(module: nn.Module) -> bool:
    """A layer peft's LoRA can adapt: ``nn.Linear`` or transformers' ``Conv1D`` (GPT-2)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def lora_targets(model: nn.Module, names=None) -> list[str]:
    """The modules LoRA adapts in ``model``, as peft ``target_modules`` (name suffixes).

    ``names=None``: the linear layers that are direct children of the attention modules,
    e.g. ``self_attn.q_proj`` ... ``self_attn.o_proj`` (Llama, Qwen2/3, Mistral),
    ``self_attn.qkv_proj`` and ``self_attn.o_proj`` (Phi-3), ``attn.c_attn`` and
    ``attn.c_proj`` (GPT-2). Given ``names`` are checked: each must match (equal, or end
    with ``"." + name``, as peft matches) at least one linear layer of ``model`` outside
    the polysketch modules. Raises ValueError, naming the CLI flags to use instead, when
    nothing fits.
    """
    modules = dict(model.named_modules())
    if names is None:
        found: list[str] = []
        for module in attention_modules(model):
            path = next(n for n, m in modules.items() if m is module)
            attr = path.rsplit(".", 1)[-1]
            for child, sub in module.named_children():
                if _adaptable(sub) and f"{attr}.{child}" not in found:
                    found.append(f"{attr}.{child}")
        if not found:
            model_type = model.config.get_text_config(decoder=True).model_type
            raise ValueError(
                f"no LoRA targets found in model_type={model_type!r} (its attention modules "
                f"have no linear layers): {LORA_HINT}"
            )
        return found
    names = [names] if isinstance(names, str) else list(names)
    linear = [n for n, m in modules.items() if _adaptable(m) and ".polysketch." not in f".{n}."]
    for name in names:
        if not any(n == name or n.endswith("." + name) for n in linear):
            example = ", ".join(sorted({n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1]
                                        for n in linear if "." in n})[:6])  # fmt: skip
            raise ValueError(
                f"LoRA target {name!r} matches no linear layer of the model (it has e.g. "
                f"{example}): {LORA_HINT}"
            )
    return names


def peft_modules_to_save(model: nn.Module) -> list[str]:
    """Names for peft's ``LoraConfig(modules_to_save=...)``: what ``convert`` added that trains.

    Each name is a child of the ``polysketch`` module that holds parameters
    (``polysketch.q_norm``, ``polysketch.k_norm``, ``polysketch.feature_map``); peft trains a
    copy of each and ``merge_and_unload`` puts it back. The ``polysketch`` module itself is
    never named: the attention function needs it unwrapped. Empty when nothing added trains.
    """
    names: list[str] = []
    for core in converted_cores(model):
        direct = [n for n, _ in core.named_parameters(recurse=False)]
        if direct:
            raise ValueError(
                f"polysketch attention holds parameters outside submodules ({direct}): "
                "modules_to_save cannot cover them; set requires_grad on "
                "trainable_attention_parameters(model) after get_peft_model instead"
            )
        for name, child in core.named_children():
            if any(True for _ in child.parameters()) and f"polysketch.{name}" not in names:
                names.append(f"polysketch.{name}")
    return names


def require_peft():
    """The ``peft`` module, or an ImportError saying how to get it (or avoid it)."""
    try:
        import peft
    except ImportError as err:  # pragma: no cover - only without the extra
        raise ImportError(
            "LoRA fine-tuning needs peft: pip install polysketch[hf] (or --finetune full)"
        ) from err
    return peft


def lora_model(model: nn.Module, rank: int, targets=None):
    """``get_peft_model(model, LoraConfig(...))`` on ``lora_targets(model, targets)``."""
    peft = require_peft()
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=lora_targets(model, targets)
    )
    return peft.get_peft_model(model, config)
