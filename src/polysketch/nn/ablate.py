"""``ablate_global(model)``: switch off the global part of mixed attention, for ablations.

Mixed attention (``psf_mixed``, ``mixed=True``) scores the keys of the query's own block
exactly and the keys of earlier blocks through the feature map, s_ij = φq(q_i)·φk(k_j)
(squared when ``square``), under one shared normalizer (``polysketch.ops.mixed_attention``).
Inside ``with ablate_global(model):`` every mixed core of ``model`` (``AttentionCore``,
including the layers of a converted transformers model) uses φq = 0 for the earlier blocks, so

    out_i = Σ_{j∈blk(i), j≤i} κ_ij v_j / (offset + Σ_{j∈blk(i), j≤i} κ_ij):

block-local exact attention alone (forward and decoding). If that raises a model's loss on
a recurrence, the model used what lay beyond its block. A ``TransformerLM`` block with a
sliding-window branch beside its attention (``TransformerConfig.local_window``) drops its
global branch instead: the block's attention is then the exact local window alone. Sliding-
window cores have no global part (nothing to do); leaving the ``with`` restores every part.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["ablate_global", "global_cores", "global_parts", "is_ablated"]


def global_cores(model: nn.Module) -> list:
    """The ``AttentionCore`` modules of ``model`` with a separate global part (mixed)."""
    from .core import AttentionCore

    return [m for m in model.modules() if isinstance(m, AttentionCore) and m.form == "mixed"]


def global_parts(model: nn.Module) -> list:
    """What ``ablate_global`` switches off: the mixed cores of ``model`` and its blocks with a
    sliding-window branch (``local_attn``) beside a global attention."""
    blocks = [m for m in model.modules() if getattr(m, "local_attn", None) is not None]
    return global_cores(model) + blocks


def is_ablated(part: nn.Module) -> bool:
    """Whether ``ablate_global`` has switched off the global part of ``part`` (a mixed core
    or a block with a sliding-window branch)."""
    if "_global_queries" in part.__dict__:
        return True
    return bool(getattr(part, "global_ablated", False))


def _zero_queries(phi_q):
    """A mixed core's far-block queries while ablated: 0 (no score for an earlier block)."""
    return torch.zeros_like(phi_q)


@contextlib.contextmanager
def ablate_global(model: nn.Module):
    """Within the block, every mixed core of ``model`` drops its far-block scores, and every
    block with a sliding-window branch its global branch (module docstring).

    Raises ValueError if ``model`` has neither (nothing would be ablated: linear attention is
    all global, softmax and polynomial have no separate global part).
    """
    cores, blocks = global_cores(model), global_parts(model)[len(global_cores(model)) :]
    if not cores and not blocks:
        raise ValueError(
            "model has no attention with a separate global part (no mixed attention, "
            "psf_mixed or mixed=True, and no local_window branch); ablate_global is defined "
            "for those only"
        )
    wrapped = [core for core in cores if "_global_queries" not in core.__dict__]
    before = [block.global_ablated for block in blocks]
    try:
        for core in wrapped:  # a wrapper on the instance: the core keeps no ablation field
            core.__dict__["_global_queries"] = _zero_queries
        for block in blocks:
            block.global_ablated = True
        yield model
    finally:
        for core in wrapped:
            core.__dict__.pop("_global_queries", None)
        for block, was in zip(blocks, before, strict=True):
            block.global_ablated = was
