"""Sliding-window attention: each query sees only the last ``window`` keys, exactly.

For queries and keys at positions 0..T−1 and a window w, query i sees the keys

    W(i) = { j : i − w < j <= i, key j kept }

(itself included, at most w of them) and

    softmax:     out_i = Σ_{j∈W(i)} exp(s_ij) v_j / Σ_{j∈W(i)} exp(s_ij),   s_ij = scale·q_i·k_j
                 (scale = 1/√D by default; a query with no visible key gets 0),
    polynomial:  out_i = Σ_{j∈W(i)} κ_ij v_j / stab(offset + Σ_{j∈W(i)} κ_ij),
                 κ_ij = (scale·q_i·k_j)^degree (scale = 1 by default; Eq. 1 of
                 PolySketchFormer restricted to the window).

With ``segments`` (a document id per position, e.g. packed sequences or a context-parallel
shard with its halo), W(i) also drops the keys of other documents: seg_j = seg_i.

This is the local-only control of mixed attention (``ops.mixed``): the same exact local
scores, nothing from farther back. ``window_attention`` computes it in O(T·w) time and
memory by blocks of b = min(w, T) rows: block n of queries sees only key blocks n − 1 and n
(every key within w of a query of block n lies there), under a banded mask; no T×T matrix.
``naive_window_attention`` is the quadratic reference (the full masked score matrix).
Precision: scores, softmax and normalizer in the compute dtype (fp32 for bf16/fp16 inputs);
the output in the input dtype.

On accelerators the softmax window without a key padding mask runs the same blocks through
``torch.nn.functional.scaled_dot_product_attention`` with the band as a boolean mask (one
fused kernel, FlashAttention's recomputation in backward: no (..., N, b, 2b) scores or
weights in memory), in the compute dtype. Every query of that call sees at least itself
(the key padding mask is the only way a row could see nothing), so no row is all -inf.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._checks import check_choice, check_float, check_positive_int, compute_dtype
from .._device import device_type
from ._constants import constant
from ._validate import check_key_padding_mask, check_offset_eps, check_qkv
from .naive import DEFAULT_EPS, stabilize_denominator

__all__ = ["WINDOW_KERNELS", "window_attention", "naive_window_attention"]

WINDOW_KERNELS = ("softmax", "polynomial")


def _validate(q, k, v, window, kernel, scale, degree, offset, eps, key_padding_mask,
              segments=None):  # fmt: skip
    check_qkv(q, k, v, names=("q", "k", "v"), causal=True)
    if segments is not None:
        if (
            not isinstance(segments, torch.Tensor)
            or segments.dtype == torch.bool
            or (segments.is_floating_point() or segments.is_complex())
        ):
            raise TypeError("segments must be an integer tensor of document ids (T,) or None")
        if segments.dim() != 1 or segments.shape[0] != k.shape[-2]:
            raise ValueError(
                f"segments must have shape (T,) = ({k.shape[-2]},), got {tuple(segments.shape)}"
            )
        if segments.device != k.device:
            raise ValueError(f"segments is on {segments.device}, the inputs on {k.device}")
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"q and k must have the same length T (one query per key), got {q.shape[-2]} "
            f"and {k.shape[-2]}"
        )
    window = check_positive_int(window, "window")
    kernel = check_choice(kernel, "kernel", WINDOW_KERNELS)
    degree = check_positive_int(degree, "degree")
    offset, eps = check_offset_eps(offset, eps)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if kernel == "softmax" else 1.0
    scale = check_float(scale, "scale")
    check_key_padding_mask(key_padding_mask, k)
    return window, kernel, scale, degree, offset, eps


def _band(b: int, window: int, device: torch.device) -> torch.Tensor:
    """(b, 2b) bool: key c of the block pair (previous block, own block) is among the last
    ``window`` keys of query a of the own block (0 <= i - j < window); built once per size."""

    def build():
        a = torch.arange(b, device=device)
        c = torch.arange(2 * b, device=device)
        rel = b + a[:, None] - c[None, :]  # i - j for query a of a block, key c of its pair
        return (rel >= 0) & (rel < window)

    return constant(("window_band", b, window, torch.device(device)), build)


def _weights(logits, mask, kernel, degree):
    """Unnormalized weights (0 where ``mask`` is False) of the scaled scores ``logits``."""
    if kernel == "polynomial":
        return torch.where(mask, logits.pow(degree), logits.new_zeros(()))
    logits = logits.masked_fill(~mask, float("-inf"))
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, m.new_zeros(())).detach()
    return torch.where(mask, (logits - m).exp(), logits.new_zeros(()))


def _normalize(num, den, kernel, offset, eps, dtype):
    if kernel == "softmax":
        return num / den.clamp_min(torch.finfo(dtype).tiny)
    return num / stabilize_denominator(den + offset, eps)


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    kernel: str = "softmax",
    scale: float | None = None,
    degree: int = 4,
    denominator_offset: float = 0.0,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal sliding-window attention (module docstring) in O(T·w), by blocks.

    Args:
        q, k: (..., T, D); v: (..., T, E); same leading dims, dtype and device.
        window: w >= 1, the keys each query sees (itself included).
        kernel: ``"softmax"`` or ``"polynomial"``.
        scale: multiplies q·k (default 1/√D for softmax, 1 for polynomial).
        degree, denominator_offset, eps: of the polynomial kernel (unused by softmax).
        key_padding_mask: bool of k.shape[:-1]'s rank (e.g. (B, 1, T)), True = keep.
        segments: int (T,) document ids or None: a query sees only keys of its own document.

    Returns (..., T, E) in the dtype of q. Block b = min(w, T): query block n attends key
    blocks n−1 and n, scores (..., N, b, 2b): 2·T·b entries, never T×T.
    """
    window, kernel, scale, degree, offset, eps = _validate(
        q, k, v, window, kernel, scale, degree, denominator_offset, eps, key_padding_mask,
        segments,
    )  # fmt: skip
    dtype, t = q.dtype, q.shape[-2]
    if t == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    cd = compute_dtype(dtype)
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    b = min(window, t)
    n = -(-t // b)
    pad = n * b - t
    keep = torch.ones(k.shape[:-1], dtype=torch.bool, device=k.device)
    if key_padding_mask is not None:
        keep = keep & key_padding_mask
        m = keep.unsqueeze(-1)  # a padded k or v may be non-finite: it must not reach a sum
        k, v = torch.where(m, k, k.new_zeros(())), torch.where(m, v, v.new_zeros(()))

    def blocks(x, fill=0.0):  # (..., T, X) -> (..., N, b, X)
        return F.pad(x, (0, 0, 0, pad), value=fill).unflatten(-2, (n, b))

    def with_previous(x):  # (..., N, b, X) -> (..., N, 2b, X): block n-1 then block n
        prev = F.pad(x[..., :-1, :, :], (0, 0, 0, 0, 1, 0))
        return torch.cat([prev, x], dim=-2)

    qb = blocks(q)
    kb, vb = with_previous(blocks(k)), with_previous(blocks(v))
    if kernel == "softmax" and key_padding_mask is None and device_type(q.device) != "cpu":
        out = _fused_blocks(qb, kb, vb, b, window, scale, blocks, with_previous, segments)
        return out.flatten(-3, -2)[..., :t, :].to(dtype)
    # (..., N, 2b); the "previous block" of block 0 is padding, never kept
    kept = with_previous(blocks(keep.unsqueeze(-1), fill=False)).squeeze(-1)
    mask = _band(b, window, q.device) & kept.unsqueeze(-2)  # (..., N, b, 2b)
    if segments is not None:  # (N, b, 1) == (N, 1, 2b): the same document only
        seg = blocks(segments.unsqueeze(-1), fill=-1)
        mask = mask & (seg == with_previous(seg).transpose(-1, -2))
    logits = (qb @ kb.transpose(-1, -2)) * scale
    w = _weights(logits, mask, kernel, degree)
    out = _normalize(w @ vb, w.sum(-1, keepdim=True), kernel, offset, eps, cd)
    return out.flatten(-3, -2)[..., :t, :].to(dtype)


def _fused_blocks(qb, kb, vb, b, window, scale, blocks, with_previous, segments):
    """Softmax over the band of each (query block, key block pair) by SDPA (module
    docstring): (..., N, b, D), (..., N, 2b, D), (..., N, 2b, E) -> (..., N, b, E). Block 0
    has no previous block (masked); the zero-padded keys past T are not masked: no query of
    the sequence reaches them, and each padded query row then sees at least itself."""
    lead, n = qb.shape[:-3], qb.shape[-3]

    def build():  # (2, b, 2b): block 0 (own block only), every later block
        own = torch.arange(2 * b, device=qb.device) >= b
        band = _band(b, window, qb.device)
        return torch.stack([band & own, band])

    pair = constant(("window_band_first", b, window, torch.device(qb.device)), build)
    mask = torch.cat([pair[:1], pair[1:].expand(n - 1, b, 2 * b)])  # (N, b, 2b)
    if segments is not None:  # (N, b, 1) == (N, 1, 2b): the same document only
        seg = blocks(segments.unsqueeze(-1), fill=-1)
        mask = mask & (seg == with_previous(seg).transpose(-1, -2))
    q4, k4, v4 = (x.reshape(-1, n, *x.shape[-2:]) for x in (qb, kb, vb))  # (batch, N, ., .)
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
    return out.reshape(*lead, n, b, vb.shape[-1])


def naive_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    kernel: str = "softmax",
    scale: float | None = None,
    degree: int = 4,
    denominator_offset: float = 0.0,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of ``window_attention``: the (..., T, T) score matrix under the band mask
    i − w < j <= i, the key mask and seg_i = seg_j, O(T²). Same arguments and result."""
    window, kernel, scale, degree, offset, eps = _validate(
        q, k, v, window, kernel, scale, degree, denominator_offset, eps, key_padding_mask,
        segments,
    )  # fmt: skip
    dtype, t = q.dtype, q.shape[-2]
    cd = compute_dtype(dtype)
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    i = torch.arange(t, device=q.device)[:, None]
    j = torch.arange(t, device=q.device)[None, :]
    mask = (j <= i) & (j > i - window)
    if segments is not None:
        mask = mask & (segments[:, None] == segments[None, :])
    if key_padding_mask is not None:
        mask = mask & key_padding_mask.unsqueeze(-2)
        m = key_padding_mask.unsqueeze(-1)
        k, v = torch.where(m, k, k.new_zeros(())), torch.where(m, v, v.new_zeros(()))
    w = _weights((q @ k.transpose(-1, -2)) * scale, mask, kernel, degree)
    out = _normalize(w @ v, w.sum(-1, keepdim=True), kernel, offset, eps, cd)
    return out.to(dtype)
