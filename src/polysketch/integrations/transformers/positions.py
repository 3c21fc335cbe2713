"""Position ids of a converted model's forward when the caller gives only a padding mask.

A transformers model called without ``position_ids`` numbers its tokens 0, 1, ..., T − 1 in
every row (plus the cache length), whatever the mask says. In a left-padded batch a row with
P pads then reads its first real token at position P instead of 0. Softmax attention under
RoPE does not notice (a constant offset cancels in q_i·k_j), but a feature map sees the
absolute rotation of each q and k (and GPT-2 adds learned absolute positions), so a row's
logits differ from the same row alone. ``generate`` avoids it by building ``position_ids``
from the mask; a plain forward does not.

``install_position_ids(model)`` adds a forward pre-hook on the model's base model (the module
that turns ``position_ids=None`` into the arange, e.g. ``LlamaModel``, ``GPT2Model``): when
the call has no ``position_ids`` and a 2D ``attention_mask`` (B, M) (M = cache length + T),

    position_ids = (cumsum(mask, -1) − 1)[:, −T:], pads set to 0,

exactly what ``generate`` builds. For a mask without padding this is the arange the model
would have used, so nothing else changes; no value is read on the host (no sync). A 4D mask
with left padding (a key no query sees before a kept one) and no ``position_ids`` is
refused (ValueError naming ``position_ids``): a custom mask's positions are not derived.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

__all__ = ["install_position_ids", "positions_from_mask"]


def positions_from_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """(B, M) 0/1 mask -> (B, length) position ids of its last ``length`` columns: the count
    of real tokens before each one (pads get 0), as transformers' ``generate``."""
    keep = mask != 0
    pos = keep.long().cumsum(-1) - 1
    return pos.masked_fill(~keep, 0)[:, -length:]


def _new_length(kwargs: dict) -> int | None:
    for name in ("input_ids", "inputs_embeds"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[1]
    return None


def _check_4d(mask: torch.Tensor) -> None:
    """Refuse a 4D mask (B, 1|H, Tq, Tkv) with a padded key before a real one: a key column
    no query sees, followed by a key the last query sees (left padding, holes). Right
    padding and windows pass (their positions are the arange). Checked on the host only; on
    an accelerator the check would sync."""
    if mask.device.type != "cpu" or torch.compiler.is_compiling():
        return
    allowed = mask if mask.dtype == torch.bool else mask == 0
    allowed = allowed.any(dim=1)  # (B, Tq, Tkv)
    hidden = ~allowed.any(dim=1)  # (B, Tkv): keys no query attends to
    seen_later = allowed[:, -1, :].flip(-1).cummax(-1).values.flip(-1)  # a kept key at >= j
    later = torch.zeros_like(seen_later)
    later[:, :-1] = seen_later[:, 1:]
    if bool((hidden & later).any()):
        raise ValueError(
            "attention_mask is a 4D mask with left padding and no position_ids were given: "
            "pass position_ids (the count of real tokens before each one), or pass the 2D "
            "padding mask, from which a converted model derives them"
        )


def install_position_ids(model: nn.Module) -> None:
    """Derive ``position_ids`` from a 2D ``attention_mask`` when a forward of ``model`` (or
    of its base model) has none (module docstring); replaces an earlier ``convert``'s hook."""
    base = getattr(model, "base_model", model)
    names = [
        p.name
        for p in inspect.signature(type(base).forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ][1:]  # without self
    if "position_ids" not in names or "attention_mask" not in names:
        return  # a model without position ids (nothing to derive)

    def hook(module, args, kwargs):
        if len(args) > len(names):
            return None
        bound = {**dict(zip(names[: len(args)], args, strict=True)), **kwargs}
        mask = bound.get("attention_mask")
        if bound.get("position_ids") is not None or not isinstance(mask, torch.Tensor):
            return None
        if mask.dim() == 4:
            _check_4d(mask)
            return None
        length = _new_length(bound)
        if mask.dim() != 2 or length is None or mask.shape[-1] < length:
            return None  # the model reports a malformed mask itself
        bound["position_ids"] = positions_from_mask(mask, length)
        return (), bound

    hooks = base._forward_pre_hooks
    for key in [k for k, h in hooks.items() if getattr(h, "_polysketch_positions", False)]:
        del hooks[key]
        base._forward_pre_hooks_with_kwargs.pop(key, None)
    hook._polysketch_positions = True
    base.register_forward_pre_hook(hook, with_kwargs=True)
