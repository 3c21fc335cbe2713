"""What ``convert`` does with model features a kernelized attention cannot carry as they are.

**Sliding windows** (Mistral, Qwen2/3 with ``use_sliding_window``, Phi-3, Gemma-2/3: a
``sliding_window`` in the config, or ``"sliding_attention"`` in ``config.layer_types``). The
model's own attention (``attention="softmax"``) keeps its windows exactly. A kernelized
attention has no window, so ``convert(..., sliding_window=)`` must say what happens:

* ``"refuse"`` (default): ``convert`` raises ValueError naming the window and the options;
* ``"full"``: every layer attends to all earlier tokens (the window is dropped; each layer
  keeps its own RoPE and everything else). The masks the model builds for its sliding layers
  are then plain causal masks with key padding (``polysketch_mask``: it checks that the mask
  it replaces is exactly the causal sliding-window mask with padding, and refuses any other,
  e.g. packed sequences), and the exact ``polynomial`` attention decodes from a full
  ``DynamicCache``, so forward and ``generate`` compute the same thing at any length.

**Logit soft-capping** (Gemma-2's ``attn_logit_softcapping`` c: scores c·tanh(s/c)). Softmax
mode keeps it exactly (the model's own eager attention computes it; SDPA cannot). Linear
modes cannot apply a tanh to scores they never form: ``convert(..., softcap=)`` is
``"refuse"`` (default, ValueError) or ``"drop"`` (scores uncapped, said explicitly).

**Caches**: ``install_cache_guards`` refuses, before anything is computed, a cache the
attention cannot decode with exactly (``cache.check_cache``), whether passed to a forward
call or made by ``generate`` from ``cache_implementation``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from ..._checks import assert_on_device
from .attention import ATTENTION_NAME, polysketch_attention_forward
from .cache import check_cache

__all__ = [
    "SLIDING_WINDOW_POLICIES",
    "SOFTCAP_POLICIES",
    "check_policies",
    "configured_window",
    "install_cache_guards",
    "polysketch_mask",
    "register",
]

SLIDING_WINDOW_POLICIES = ("refuse", "full")
SOFTCAP_POLICIES = ("refuse", "drop")


def configured_window(config) -> int | None:
    """The sliding window of a (text) config when some layer uses one, else None."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if any(t == "sliding_attention" for t in types) else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


def check_policies(config, spec, sliding_window: str, softcap: str) -> None:
    """Refuse (ValueError) what ``convert`` cannot do silently (module docstring); ``spec``:
    the layers' ``AttentionSpec`` (softmax keeps the model's own attention)."""
    attention = spec.name
    for name, value, choices in (("sliding_window", sliding_window, SLIDING_WINDOW_POLICIES),
                                 ("softcap", softcap, SOFTCAP_POLICIES)):  # fmt: skip
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    if spec.form == "softmax":
        return  # the model's own attention: windows and soft-capping kept exactly
    window = configured_window(config)
    if window is not None and sliding_window == "refuse":
        raise ValueError(
            f"the model attends within a sliding window of {window} tokens "
            f"(config.sliding_window), which attention={attention!r} cannot do: pass "
            'sliding_window="full" to convert so every layer attends to all earlier tokens '
            '(the window is dropped), or attention="softmax" to keep the model\'s own windowed '
            "attention"
        )
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None and softcap == "refuse":
        raise ValueError(
            f"the model soft-caps its attention logits (config.attn_logit_softcapping={cap}: "
            f"scores {cap}·tanh(s/{cap})), which attention={attention!r} cannot apply to the "
            'scores it never forms: pass softcap="drop" to convert to drop the cap explicitly, '
            'or use attention="softmax" (keeps it exactly)'
        )


def polysketch_mask(**kwargs) -> torch.Tensor | None:
    """The mask builder registered for ``"polysketch"``: transformers' ``sdpa_mask``, except
    that a sliding-window mask of a model converted with ``sliding_window="full"`` becomes the
    plain causal mask with the same key padding (module docstring)."""
    config = kwargs.get("config")
    window = kwargs.get("local_size")
    settings = getattr(config, "polysketch", None) or {}
    if window is None or settings.get("sliding_window") != "full":
        return sdpa_mask(**kwargs)
    strict = {**kwargs, "allow_is_causal_skip": False}
    given = sdpa_mask(**strict)
    plain = sdpa_mask(**{**strict, "mask_function": sliding_window_causal_mask_function(window)})
    if given is None or plain is None or given.shape != plain.shape:
        same = given is None and plain is None
    elif given.device.type == "cpu":
        same = torch.equal(given, plain)
    else:  # no host sync on accelerators
        assert_on_device((given == plain).all(), "sliding-window mask with more than padding")
        same = True
    if not same:
        raise ValueError(
            "the sliding-window mask holds more than the window and key padding (packed "
            "sequences or a custom mask): a model converted with sliding_window='full' cannot "
            "drop its window there"
        )
    return sdpa_mask(**{**kwargs, "mask_function": causal_mask_function, "local_size": None})


def install_cache_guards(model: nn.Module, modules: list[nn.Module]) -> None:
    """Refuse unsupported caches before anything is computed (``cache.check_cache``): a
    forward pre-hook on the model and on every attention module (a ``Cache`` among their
    arguments), replacing the ones an earlier ``convert`` installed."""

    def guard(core_of, layer_idx):
        def hook(module, args, kwargs):
            for value in (*args, *kwargs.values()):
                if isinstance(value, Cache):
                    check_cache(value, core_of(module), layer_idx)

        return hook

    targets = [(model, lambda m: modules[0].polysketch, None)]
    targets += [(m, lambda m: m.polysketch, m.layer_idx) for m in modules]
    for module, core_of, layer_idx in targets:
        hooks = module._forward_pre_hooks
        for key in [k for k, h in hooks.items() if getattr(h, "_polysketch_guard", False)]:
            del hooks[key]  # the guard of an earlier convert
            module._forward_pre_hooks_with_kwargs.pop(key, None)
        hook = guard(core_of, layer_idx)
        hook._polysketch_guard = True
        module.register_forward_pre_hook(hook, with_kwargs=True)


def register() -> None:
    """Register ``ATTENTION_NAME`` in transformers' attention and mask interfaces
    (``polysketch_attention_forward`` and ``polysketch_mask``; idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, polysketch_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, polysketch_mask)


register()
