"""Switch off an attention's global (far-block) part from the outside, for an ablation.

Mixed attention (``psf_mixed``, any layer whose ``algorithm`` is ``"mixed"``) scores keys in
the query's own block exactly and keys of earlier blocks through the feature map,
s_ij = φq(q_i)·φk(k_j) (squared when ``square``), with one shared normalizer
(``polysketch.ops.mixed_attention``). ``zero_global_part(model)`` makes φq return zeros in
every mixed layer, so every earlier-block score is 0 and

    out_i = Σ_{j∈blk(i), j≤i} κ_ij v_j / (offset + Σ_{j∈blk(i), j≤i} κ_ij):

the block-local exact attention alone. If that raises a recurrence's loss, the layer used
what lay beyond its block. The map is wrapped, not changed: leaving the ``with`` restores it.

Attentions without a separate global part (softmax, polynomial, pure feature maps) have
nothing to zero: ``has_global_part`` is False and the ablation is not defined for them.
The library has no hook for this (``KernelAttention`` could offer one); the wrapper relies on
``KernelAttention._mixed`` calling ``self.feature_map.query``.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["mixed_layers", "has_global_part", "zero_global_part"]


def mixed_layers(model) -> list:
    """The ``KernelAttention`` layers of ``model`` whose algorithm is ``"mixed"``."""
    from polysketch.nn import KernelAttention

    return [m for m in model.modules() if isinstance(m, KernelAttention) and m.algorithm == "mixed"]


def has_global_part(model) -> bool:
    """Whether ``model`` has a layer with a separate global (far-block) part."""
    return bool(mixed_layers(model))


@contextlib.contextmanager
def zero_global_part(model):
    """Within the block, every mixed layer's far-block scores are 0 (module docstring).

    Raises ValueError if ``model`` has no mixed layer (nothing would be ablated).
    """
    layers = mixed_layers(model)
    if not layers:
        raise ValueError(
            "model has no attention with a separate global part (no mixed layer): the "
            "ablation is defined for psf_mixed-like attentions only"
        )
    maps = [layer.feature_map for layer in layers]

    def zero_query(fm):
        original = type(fm).query

        def query(x: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(original(fm, x))

        return query

    try:
        for fm in maps:
            fm.query = zero_query(fm)  # an instance attribute shadows the method
        yield model
    finally:
        for fm in maps:
            fm.__dict__.pop("query", None)
