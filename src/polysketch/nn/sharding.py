"""How a layer sees its piece of a sequence: a context-parallel shard and/or packed documents.

A ``SequenceShard`` tells ``KernelAttention`` / ``TransformerLM`` that the (B, T_r, ·) rows it
gets are the positions [start, start + T_r) of a sequence of T tokens,

* held by rank r of a ``cp`` group (``polysketch.distributed``: one contiguous shard per rank,
  in rank order, any lengths, empty shards allowed), and/or
* packed: the sequence holds documents [c_0, c_1), ..., [c_{n-1}, c_n) (``cu_seqlens`` of the
  WHOLE sequence, the same for every row and rank; ``polysketch.ops.varlen``).

What changes in the layer (everything else is per token):

    RoPE position of global token p:   p − c_d(p)      (c_d(p): the start of p's document;
                                                         p itself without packing)
    short conv:  y_p = SiLU(Σ_i w_i u_{p−K+1+i} [p−K+1+i ≥ c_d(p)] + b)   (K − 1 inputs of
                 the previous rank come as a halo, ``distributed.halo``)
    attention:   linear maps → ``cp_linear_attention`` (or ``ops.linear_attention`` with
                 ``cu_seqlens`` on one process); mixed (psf_mixed) → ``cp_mixed_attention``
                 (not packed: its exact local blocks do not reset at document starts);
                 sliding window w → ``ops.window_attention`` over the w − 1 keys and values
                 before the shard (a halo) and the shard's own, keys of other documents and
                 before position 0 masked (``segments``, ``key_padding_mask``).

Key padding (``keep`` (B, T_r) per rank, no packing, linear attentions): padding means
removal as on one process (``nn.padding``): RoPE positions count real tokens (the real tokens
of earlier shards come with the shard lengths), the short convolution skips pads across ranks
(``cp_short_conv(keep=)``) and padded keys drop out of the states.

Refused with a ValueError naming the cause: attentions without a context-parallel op
(softmax, polynomial; ``CP_ALGORITHMS`` lists what is supported), mixed attention with
packing, mixed or window attention with key padding on a shard, key padding with packing, decode
caches, the warm start's exact attention and rematerialization (``checkpoint=True``)
together with a shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._checks import check_int
from ..distributed import cp_short_conv, halo
from ..distributed.comm import gather_ints
from ..distributed.group import CPGroup, resolve_group
from ..ops import window_attention
from ..ops.varlen import check_cu_seqlens

__all__ = [
    "CP_ALGORITHMS",
    "SequenceShard",
    "check_core_on_shard",
    "make_shard",
    "shard_short_conv",
    "window_on_shard",
]

CP_ALGORITHMS = {"linear": "every feature map (psf_random, psf_learned, ...)",
                 "mixed": "psf_mixed / mixed=True",
                 "window": "sliding_window, and soft_hash_local's window branch"}  # fmt: skip
"""The attention forms (``AttentionCore.form``) that run on a ``SequenceShard``."""


@dataclass(frozen=True)
class SequenceShard:
    """Positions [``start``, ``start + length``) of a sequence of ``total`` tokens (module doc).

    ``group``: the resolved cp group (``None``: one process holds the whole sequence, which
    then must be packed). ``cu_seqlens``: the documents of the whole sequence, or ``None``.
    """

    group: CPGroup | None
    start: int
    length: int
    total: int
    cu_seqlens: tuple[int, ...] | None = None
    real_before: tuple[int, ...] | None = None  # key padding: real tokens before, per row

    def positions(self, device) -> torch.Tensor:
        """(T_r,) int64: each token's position in its document (its global position when not
        packed; with key padding ``KernelAttention`` counts real tokens instead,
        ``nn.padding.real_positions`` from ``real_before``)."""
        pos = torch.arange(self.start, self.start + self.length, device=device)
        if self.cu_seqlens is None:
            return pos
        starts = torch.tensor(self.cu_seqlens[:-1], device=device)
        return pos - starts[self.documents(pos)]

    def documents(self, pos: torch.Tensor) -> torch.Tensor:
        """The document index of each global position ``pos`` >= 0 (packed shards only)."""
        starts = torch.tensor(self.cu_seqlens[:-1], device=pos.device)
        return torch.bucketize(pos, starts, right=True) - 1  # the last start <= p


def make_shard(
    length: int, *, group=None, cu_seqlens=None, keep=None, device=None
) -> SequenceShard:
    """The ``SequenceShard`` of this rank's ``length`` tokens.

    ``group``: a cp group (ProcessGroup, 1-D DeviceMesh, ``CPGroup``) or ``None`` (no context
    parallelism). With a group, the ranks' lengths (and with ``keep``, a bool (B, T_r) key
    padding mask, each row's number of real tokens) are all-gathered once (every rank of the
    group must call this together); start, total and the real tokens before the shard follow
    in rank order. ``cu_seqlens``: the packed documents of the whole sequence (checked
    against the total on every rank).
    """
    length = check_int(length, "length", minimum=0)
    g = None if group is None else resolve_group(group)
    real = [] if keep is None else keep.sum(-1).tolist()
    if g is None:
        start, total, before = 0, length, [0] * len(real)
    else:
        metas = gather_ints([length, *real], group=g, name="lengths", device=device)
        start, total = sum(m[0] for m in metas[: g.rank]), sum(m[0] for m in metas)
        before = [sum(m[1 + row] for m in metas[: g.rank]) for row in range(len(real))]
    cu = None if cu_seqlens is None else tuple(check_cu_seqlens(cu_seqlens, total))
    return SequenceShard(g, start, length, total, cu, None if keep is None else tuple(before))


def check_core_on_shard(core, shard: SequenceShard) -> None:
    """Refuse (ValueError) a core that cannot compute exactly on ``shard`` (module doc)."""
    if core.form not in CP_ALGORITHMS:
        supported = "; ".join(f"{k}: {v}" for k, v in CP_ALGORITHMS.items())
        what = "context parallelism" if shard.group is not None else "packed sequences"
        raise ValueError(
            f"attention={core.attention!r} ({core.form} attention) has no {what} op; "
            f"supported: {supported}"
        )
    if core.form == "mixed" and shard.cu_seqlens is not None:
        raise ValueError(
            f"attention={core.attention!r}: mixed attention with packed sequences (cu_seqlens) "
            "is not supported: its exact local blocks would cross document boundaries; use a "
            "linear attention (e.g. psf_random) to pack"
        )
    if shard.real_before is not None and (core.form != "linear" or shard.cu_seqlens):
        raise ValueError(
            f"key_padding_mask on a context-parallel shard needs a linear attention without "
            f"packing, got attention={core.attention!r} ({core.form})"
            + (" with cu_seqlens" if shard.cu_seqlens else "")
            + ": mixed attention's block grid and the window would count each row's real "
            "tokens across ranks; pack documents with cu_seqlens instead of padding"
        )
    refusal = getattr(core.__dict__.get("_attend"), "shard_refusal", None)
    if refusal is not None:  # an instance wrapper of the attention without a shard form
        raise ValueError(refusal)
    if core.checkpoint:  # explicit True; the default (None) does not recompute on a shard
        raise ValueError(
            "checkpoint=True (rematerialization) is not supported on a sequence shard: the "
            "recomputation would repeat the collectives; build the layer with checkpoint=False"
        )


def window_on_shard(core, q, k, v, shard: SequenceShard) -> torch.Tensor:
    """Sliding-window attention of this shard's queries (B, H, T_r, ·) (module doc).

    The w − 1 keys and values before the shard come from the previous ranks (one halo of
    D + E channels; zeros on one process and before position 0), so the queries run as the
    last T_r rows of ``window_attention`` on [halo; shard] (T_r + w − 1 rows, the halo's
    query rows zero and dropped). Keys before position 0 are masked; packed, each query sees
    its own document only (``segments``)."""
    w, back = core.window, core.window - 1
    b, h, t = q.shape[:3]
    kv = torch.cat([k, v], dim=-1)
    if shard.group is not None:
        tail = halo(kv, back, group=shard.group)
    else:
        tail = kv.new_zeros(b, h, back, kv.shape[-1])
    kf, vf = torch.cat([tail, kv], dim=-2).split([k.shape[-1], v.shape[-1]], dim=-1)
    qf = torch.cat([q.new_zeros(b, h, back, q.shape[-1]), q], dim=-2)
    pos = torch.arange(shard.start - back, shard.start + t, device=q.device)
    visible = (pos >= 0).expand(b, 1, -1)  # (B, 1, T_r + w - 1): keys before 0 are not keys
    segments = None if shard.cu_seqlens is None else shard.documents(pos.clamp_min(0))
    out = window_attention(qf, kf, vf, window=w, key_padding_mask=visible, segments=segments,
                           **core.window_options())  # fmt: skip
    return out[..., back:, :]


def shard_short_conv(conv, u: torch.Tensor, shard: SequenceShard, keep=None) -> torch.Tensor:
    """``ShortConv`` on this shard's u (B, T_r, C) (module doc): the K − 1 inputs before the
    shard from the previous ranks, taps that reach before the token's document start zeroed;
    with ``keep`` (no packing) pads removed as ``ShortConv`` does (``cp_short_conv``)."""
    if shard.cu_seqlens is None:
        return cp_short_conv(u, conv.weight, conv.bias, group=shard.group, keep=keep)
    k = conv.kernel_size
    if shard.group is None:
        tail = u.new_zeros(u.shape[0], k - 1, u.shape[2])
    else:
        tail = halo(u, k - 1, group=shard.group)
    full = torch.cat([tail, u], dim=1)  # (B, K-1+T, C)
    windows = full.unfold(1, k, 1)  # (B, T, C, K): taps u_{p-K+1..p}
    back = torch.arange(k - 1, -1, -1, device=u.device)  # tap i reads K-1-i tokens back
    visible = back <= shard.positions(u.device)[:, None]  # (T, K): inside p's document
    w = conv.weight.to(u.dtype)[:, 0, :]  # (C, K)
    y = (windows * visible[None, :, None, :].to(u.dtype) * w).sum(-1)
    return F.silu(y + conv.bias.to(u.dtype))
