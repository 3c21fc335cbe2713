"""Argument checks shared by the attention ops.

Every check raises ``ValueError`` or ``TypeError`` whose message names the offending argument
(``phi_q``, ``phi_k``, ``v``, ``key_padding_mask``, ``initial_state``, ``chunk_size``, ...).
Leading dims (batch, heads, ...) must be *equal* across ``q``/``k``/``v``: the ops do not
broadcast them.
"""

from __future__ import annotations

import torch

from .._checks import check_float, check_positive_int, check_same_dtype_device, check_tensor

__all__ = [
    "check_qkv",
    "check_key_padding_mask",
    "check_attn_mask",
    "check_bool",
    "check_chunk_size",
    "check_offset_eps",
]


def check_bool(value, name: str) -> bool:
    """Return ``value`` if it is a ``bool``; raise ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def check_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    names: tuple[str, str, str] = ("phi_q", "phi_k", "v"),
    causal: bool = False,
) -> None:
    """Check q (..., Tq, F), k (..., Tk, F), v (..., Tk, E): same leading dims, dtype, device.

    Tq = 0 is allowed (an empty output, as torch SDPA); keys are required when Tq >= 1.
    ``causal=True`` additionally requires ``Tq <= Tk`` (queries are aligned with the *last*
    ``Tq`` keys, see ``polysketch.ops.naive``).
    """
    nq, nk, nv = names
    for x, name in ((q, nq), (k, nk), (v, nv)):
        check_tensor(x, name, min_dim=2)
    check_same_dtype_device(nq, q, nk, k)
    check_same_dtype_device(nq, q, nv, v)
    for x, name in ((q, nq), (k, nk)):
        if x.shape[-1] < 1:
            raise ValueError(f"{name} must have last dim >= 1, got {tuple(x.shape)}")
    if k.shape[-2] < 1 and q.shape[-2] > 0:
        raise ValueError(
            f"{nk} must have length >= 1 when there are queries, got {tuple(k.shape)} for "
            f"{nq} of shape {tuple(q.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{nq} and {nk} must have the same last (feature) dimension, got shapes "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"{nk} and {nv} must have the same length Tk (dim -2), got shapes "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            f"{nq}, {nk} and {nv} must have the same leading dims (no broadcasting), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if causal and q.shape[-2] > k.shape[-2]:
        raise ValueError(
            f"causal attention needs {nq} no longer than {nk} (queries are aligned with the last "
            f"keys), got Tq={q.shape[-2]} > Tk={k.shape[-2]}"
        )


def check_key_padding_mask(mask, k: torch.Tensor, name: str = "key_padding_mask"):
    """Check a boolean key mask of the keys' leading rank, broadcastable to ``k.shape[:-1]`` =
    (..., Tk); True = keep.

    The convention is torch SDPA's boolean ``attn_mask``: True means the key takes part. The
    mask must have as many dims as ``k.shape[:-1]`` (each of size 1 or the keys'): for k of
    shape (B, H, Tk, F) pass (B, 1, Tk) or (B, H, Tk). A lower-rank mask is refused: a (B, Tk)
    mask on (B, H, Tk, F) keys would broadcast right-aligned as (H, Tk), silently wrong when
    B == H. Returns ``mask`` (or ``None``).
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must have dtype torch.bool (True = keep), got {mask.dtype}")
    if mask.device != k.device:
        raise ValueError(
            f"{name} must be on the device of the keys ({k.device}), got {mask.device}"
        )
    target = tuple(k.shape[:-1])
    if mask.dim() < len(target):
        fix = "mask[:, None]" if (mask.dim(), len(target)) == (2, 3) else "a mask with 1s added"
        raise ValueError(
            f"{name} must have the keys' leading rank {len(target)} (shape (..., Tk) with each "
            f"dim 1 or the keys' {target}), got {tuple(mask.shape)}: a lower-rank mask would "
            f"broadcast right-aligned (a (B, Tk) mask read as (H, Tk)); pass {fix}, e.g. "
            f"(B, 1, Tk) for keys of shape (B, H, Tk, F)"
        )
    ok = mask.dim() == len(target) and mask.shape[-1] == target[-1]
    if ok:
        try:
            ok = tuple(torch.broadcast_shapes(mask.shape, target)) == target
        except RuntimeError:
            ok = False
    if not ok:
        raise ValueError(
            f"{name} must have shape (..., Tk) broadcastable to {target} (right-aligned; use "
            f"(B, 1, Tk) for keys of shape (B, H, Tk, F)), got {tuple(mask.shape)}"
        )
    return mask


def check_attn_mask(attn_mask) -> None:
    """Refuse a general attention mask: kernelized attention cannot linearize it."""
    if attn_mask is not None:
        raise ValueError(
            "attn_mask is not supported: an arbitrary (..., Tq, Tk) mask cannot be applied "
            "without materializing the Tq x Tk score matrix; linear attention supports only "
            "causal=True and key_padding_mask (..., Tk)"
        )


def check_chunk_size(chunk_size) -> int:
    """``chunk_size`` as an int >= 1."""
    return check_positive_int(chunk_size, "chunk_size")


def check_offset_eps(denominator_offset, eps) -> tuple[float, float]:
    """``denominator_offset`` any finite real; ``eps`` a finite real >= 0."""
    return (
        check_float(denominator_offset, "denominator_offset"),
        check_float(eps, "eps", minimum=0.0),
    )
