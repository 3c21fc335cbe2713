"""Polynomial-to-sketch warm start (PolySketchFormer §6, "directions": train the first steps
with quadratic-time polynomial attention, then switch to the linear-time sketch).

A sketched layer (``algorithm`` ``"linear"`` with a polynomial-kernel feature map, or
``"mixed"``) estimates an exact attention with the same weights:

    O_i = Σ_{j≤i} (q_i·k_j)^p v_j / (offset + Σ_{j≤i} (q_i·k_j)^p),

p the degree of the map's ``target_kernel`` (``psf_random``: the degree-2 sketch
self-tensored, p = 4; ``psf_learned``: its target degree 4; ``psf_mixed``: its local degree
4), on the same LayerNorm'd, rotated q and k and the same normalizer offset. In *exact* mode
the layer computes that instead of the sketch (a wrapper around the layer's attention call,
installed and removed here: the core holds no field for it; ``exact_degree(layer)`` reads
it), so a model can be trained exactly for N steps and then continue with the sketch, every
weight shared. Decoding (a cache) always runs the sketch.

The mode is not model state: ``polysketch.train`` sets it from the step count at every step
(``TrainConfig.warm_start_steps``), so a run resumed after the switch is in sketch mode and
one resumed before it in exact mode; a loaded model is always in sketch mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops import polynomial_attention

__all__ = ["exact_attention_layers", "exact_degree", "set_exact_attention", "target_degree"]


@torch.no_grad()
def target_degree(layer: nn.Module) -> int:
    """p of the exact attention a sketched ``KernelAttention`` estimates (module docstring).

    ``"mixed"``: the layer's local degree. ``"linear"``: the degree of the map's
    ``target_kernel`` read off a probe, target(2·e1, e1) = 2^p. Raises ValueError for maps
    whose target is not a homogeneous polynomial (softmax kernels, inhomogeneous sketches)
    and for exact layers (softmax, polynomial), which have nothing to warm-start.
    """
    if layer.form == "mixed":
        return int(layer.degree)
    if layer.form != "linear":
        raise ValueError(f"attention={layer.attention!r} is exact: nothing to warm-start")
    fmap = layer.feature_map.head_map(0)
    e1 = torch.zeros(1, layer.qk_dim)
    e1[0, 0] = 1.0
    ratio = float(fmap.target_kernel(2.0 * e1, e1).squeeze())  # 2^p, exact in fp32
    p = math.log2(ratio) if ratio > 0 else float("nan")
    if not (p >= 1 and abs(p - round(p)) < 1e-6):
        raise ValueError(
            f"attention={layer.attention!r}: the feature map's target is not a homogeneous "
            f"polynomial (target(2e1, e1) = {ratio:g}); no exact polynomial warm start"
        )
    return int(round(p))


def exact_attention_layers(model: nn.Module) -> list[nn.Module]:
    """The ``KernelAttention`` layers of ``model`` that a warm start switches."""
    from .attention import KernelAttention

    return [
        m
        for m in model.modules()
        if isinstance(m, KernelAttention) and m.form in ("linear", "mixed")
    ]


def exact_degree(layer: nn.Module) -> int | None:
    """p while ``layer`` computes the exact attention of degree p (exact mode), else None."""
    attend = layer.__dict__.get("_attend")
    return getattr(attend, "exact_degree", None)


def _exact_mode(layer: nn.Module, p: int):
    """The wrapper of ``layer._attend`` in exact mode: (q·k)^p attention without a cache."""
    sketch = type(layer)._attend.__get__(layer)

    def attend(q, k, v, keep, cache, shard=None):
        if cache is not None or shard is not None:  # decoding, a shard: the sketch
            return sketch(q, k, v, keep, cache, shard)
        kpm = None if keep is None else keep.unsqueeze(1)
        return polynomial_attention(q, k, v, degree=p, causal=layer.causal,
                                    denominator_offset=layer.denominator_offset,
                                    key_padding_mask=kpm)  # fmt: skip

    attend.exact_degree = p
    attend.shard_refusal = (  # read by sharding.check_core_on_shard
        "the warm start's exact polynomial attention (set_exact_attention(True)) has no "
        "context-parallel or packed form: switch it off first"
    )
    return attend


def set_exact_attention(model: nn.Module, exact: bool) -> int:
    """Put every sketched layer of ``model`` in exact (True) or sketch (False) mode.

    Returns the number of layers switched. Raises ValueError (before changing anything) if
    ``exact`` and some layer has no polynomial target, or if the model has no sketched layer.
    """
    if not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool, got {type(exact).__name__}")
    layers = exact_attention_layers(model)
    if not layers:
        raise ValueError("the model has no sketched attention layer to warm-start")
    degrees = [(exact_degree(m) or target_degree(m)) if exact else None for m in layers]
    for layer, p in zip(layers, degrees, strict=True):
        layer.__dict__.pop("_attend", None)
        if p is not None:
            layer.__dict__["_attend"] = _exact_mode(layer, p)
    return len(layers)
