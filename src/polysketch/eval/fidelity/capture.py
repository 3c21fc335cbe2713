"""Capture the queries and keys that a model's attention layers actually score.

In ``polysketch.nn.KernelAttention`` the attention core receives, per layer,

    Q, K = RoPE(LN_q(x W_q)), RoPE(LN_k(x W_k))      (B, H, T, D), in the compute dtype

(LayerNorm only where the layer applies one, RoPE only where enabled), and a feature map φ
is then applied to exactly these tensors: s_ij = φq(Q_i)·φk(K_j). ``capture_qk`` runs a
forward pass with the core of each chosen layer wrapped, records (Q, K) as seen there, and
restores the layers afterwards, so fidelity measurements (``polysketch.eval.fidelity``) use
the distribution a trained model really feeds its feature maps.

``capture_qkv`` records (q, k, v) of every layer the same way, on the model's device (the
quality-gap diagnosis replays them through other attention cores).

``head_samples`` turns captures into per-head samples (L·H, N, D): N token positions drawn
(seeded, without replacement, independently for queries and keys) from the B·T positions of
every head of every layer, ready for ``evaluate_map`` (leading dims are independent matrices).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..._checks import check_int, check_positive_int
from ...random import make_generator

__all__ = [
    "CapturedQK",
    "attention_layers",
    "capture_qk",
    "capture_qkv",
    "head_samples",
    "split_tokens",
]


@dataclass
class CapturedQK:
    """Queries and keys entering the attention core of one layer.

    Attributes:
        layer: index of the layer among the model's ``KernelAttention`` modules.
        attention: the layer's ``attention`` setting (e.g. ``"psf_random"``).
        algorithm: ``"linear"``, ``"mixed"``, ``"softmax"`` or ``"polynomial"``.
        q, k: (B, H, T, D) detached CPU tensors in the dtype the core computed in.
    """

    layer: int
    attention: str
    algorithm: str
    q: torch.Tensor
    k: torch.Tensor


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The ``KernelAttention`` modules of ``model`` in registration (layer) order."""
    from ...nn import KernelAttention

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return [m for m in model.modules() if isinstance(m, KernelAttention)]


@torch.no_grad()
def capture_qk(
    model: nn.Module,
    idx: torch.Tensor,
    *,
    layers: Sequence[int] | None = None,
    **forward_kwargs,
) -> list[CapturedQK]:
    """Run ``model(idx, **forward_kwargs)`` once and return the (Q, K) of each chosen layer.

    Args:
        model: any module containing ``polysketch.nn.KernelAttention`` layers (e.g. a
            ``TransformerLM``); it is run in eval mode (dropout off) and restored.
        idx: the model's input, e.g. token ids (B, T).
        layers: indices into ``attention_layers(model)`` (negative allowed); None = all.

    Returns one ``CapturedQK`` per chosen layer, in layer order. The layers' attention is
    computed as usual (the model's output is unchanged); only their inputs are recorded.
    """
    found = attention_layers(model)
    if not found:
        raise ValueError("model must contain at least one polysketch.nn.KernelAttention layer")
    if layers is None:
        chosen = list(range(len(found)))
    else:
        chosen = []
        for i in layers:
            i = check_int(i, "layers")
            if not -len(found) <= i < len(found):
                raise ValueError(
                    f"layers must index the model's {len(found)} attention layers, got {i}"
                )
            chosen.append(i % len(found))
        chosen = sorted(set(chosen))
    records = _record_cores(model, found, chosen, _qk_on_cpu, idx, forward_kwargs)
    missing = [i for i in chosen if i not in records]
    if missing:
        raise RuntimeError(f"attention layers {missing} were not called by the forward pass")
    return [CapturedQK(i, found[i].attention, found[i].form, *records[i]) for i in chosen]


@torch.no_grad()
def capture_qkv(model: nn.Module, idx: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """(q, k, v) (B, H, T, D) entering each ``KernelAttention`` core (post-LN, post-RoPE), one
    tuple per layer in layer order, detached copies on the model's device."""
    found = attention_layers(model)
    chosen = list(range(len(found)))
    records = _record_cores(model, found, chosen, _qkv_copies, idx, {})
    return [records[i] for i in chosen]


def _qk_on_cpu(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    return q.detach().cpu().clone(), k.detach().cpu().clone()


def _qkv_copies(q, k, v) -> tuple[torch.Tensor, ...]:
    return tuple(x.detach().clone() for x in (q, k, v))


def _record_cores(model, found, chosen, keep, idx, forward_kwargs) -> dict[int, tuple]:
    """Run ``model(idx, **forward_kwargs)`` in eval mode with the attention core of each
    chosen layer wrapped to record ``keep(q, k, v)``; the layers and the mode are restored."""
    records: dict[int, tuple] = {}

    def wrap(index: int, layer: nn.Module):
        core = layer._attend  # the bound method that receives the post-LN/RoPE q, k and v

        def recording(q, k, v, *args, **kwargs):
            records[index] = keep(q, k, v)
            return core(q, k, v, *args, **kwargs)

        return recording

    was_training = model.training
    model.eval()
    before = {i: found[i].__dict__.get("_attend") for i in chosen}  # a wrapper already there
    try:
        for i in chosen:
            found[i]._attend = wrap(i, found[i])  # instance attribute shadows the method
        model(idx, **forward_kwargs)
    finally:
        for i in chosen:
            found[i].__dict__.pop("_attend", None)
            if before[i] is not None:
                found[i].__dict__["_attend"] = before[i]
        model.train(was_training)
    return records


def split_tokens(num_positions: int, parts: int = 2, *, seed: int = 0) -> list[torch.Tensor]:
    """A seeded random partition of ``range(num_positions)`` into ``parts`` disjoint index sets.

    Used to fit a learnable map (LLoPS) on some token positions and measure it on others.
    """
    n = check_positive_int(num_positions, "num_positions")
    parts = check_positive_int(parts, "parts")
    if parts > n:
        raise ValueError(f"parts must be <= num_positions ({n}), got {parts}")
    perm = torch.randperm(n, generator=make_generator(seed))
    return list(perm.chunk(parts))


def head_samples(
    captured: Sequence[CapturedQK],
    *,
    num: int = 256,
    seed: int = 0,
    positions: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head samples of captured queries and keys: q, k of shape (L·H, N, D).

    Each of the L·H (layer, head) pairs is one matrix; its N queries and N keys are token
    positions drawn without replacement (independently for q and k, seeded) from the B·T
    positions (or from ``positions``, indices into the flattened B·T axis, e.g. one part of
    ``split_tokens``). N = min(``num``, available positions).
    """
    if not captured:
        raise ValueError("captured must hold at least one CapturedQK")
    num = check_positive_int(num, "num")
    qs = [c.q.transpose(0, 1).flatten(1, 2) for c in captured]  # (H, B·T, D) each
    ks = [c.k.transpose(0, 1).flatten(1, 2) for c in captured]
    q, k = torch.cat(qs), torch.cat(ks)  # (L·H, B·T, D)
    pool = torch.arange(q.shape[1]) if positions is None else torch.as_tensor(positions)
    if pool.dim() != 1 or pool.numel() == 0:
        raise ValueError("positions must be a non-empty 1-D index tensor")
    if int(pool.min()) < 0 or int(pool.max()) >= q.shape[1]:
        raise ValueError(f"positions must index the {q.shape[1]} captured token positions")
    gen = make_generator(seed)
    n = min(num, pool.numel())
    iq = pool[torch.randperm(pool.numel(), generator=gen)[:n]]
    ik = pool[torch.randperm(pool.numel(), generator=gen)[:n]]
    return q[:, iq].to(dtype), k[:, ik].to(dtype)
