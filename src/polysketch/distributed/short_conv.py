"""Context-parallel short convolution: the K - 1 inputs before each shard come as a halo.

The causal depthwise convolution of ``polysketch.nn.short_conv.ShortConv`` (BASED / Zoology /
fla's short convolution on q, k, v), for each channel c of u (B, T, C),

    y_t,c = SiLU( Σ_{i=0..K-1} w_c,i · u_{t-K+1+i, c} + b_c ),     u_s = 0 for s < 0,

reads K - 1 tokens back, so a rank needs the last K - 1 inputs before its shard
(``polysketch.distributed.halo``: one all-gather of (K - 1)·C values per row and rank, from as
many earlier ranks as short shards require). Padded tokens (``keep`` False) are removed, as
in ``ShortConv``: a real token sees the K - 1 real tokens before it, wherever they are, so with
a mask each row takes its own halo of the K - 1 real inputs before the shard (one halo per row,
over the rows' real tokens only), and pads output zeros. Given the module's ``weight`` and
``bias``, the result equals ``ShortConv`` on the whole sequence; an empty shard returns an
empty output that stays in the autograd graph (the halo's backward is a collective).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import check_tensor
from .group import resolve_group
from .halo import halo

__all__ = ["cp_short_conv"]


def cp_short_conv(
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    group=None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU(causal depthwise conv(u)) over a sequence sharded across ``group`` (module doc).

    Args:
        u: this rank's shard (B, T_r, C), T_r >= 0. weight: (C, 1, K), K >= 2 (e.g.
            ``ShortConv.weight``); bias: (C,) or None. keep: bool (B, T_r) or None.
        group: the cp group; every rank calls this op and its backward together.

    Returns:
        y (B, T_r, C) in u's dtype.
    """
    g = resolve_group(group)
    u = check_tensor(u, "u", min_dim=3)
    weight = check_tensor(weight, "weight", min_dim=3)
    b, t, c = u.shape
    if u.dim() != 3 or weight.dim() != 3 or weight.shape[:2] != (c, 1) or weight.shape[2] < 2:
        raise ValueError(
            f"u must be (B, T, C) and weight (C, 1, K) with K >= 2 (a depthwise kernel), got "
            f"{tuple(u.shape)} and {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (c,):
        raise ValueError(f"bias must have shape ({c},), got {tuple(bias.shape)}")
    if keep is not None:
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
            raise TypeError("keep must be a bool tensor (True = keep) or None")
        if tuple(keep.shape) != (b, t):
            raise ValueError(f"keep must have shape (B, T) = {(b, t)}, got {tuple(keep.shape)}")
        return _removing_pads(u, keep, weight, bias, g)
    return _conv(u, weight, bias, g)


def _conv(u, weight, bias, g) -> torch.Tensor:
    """SiLU(conv) of a shard whose every row is real: (B, T_r, C) -> (B, T_r, C)."""
    k = weight.shape[2]
    full = torch.cat([halo(u, k - 1, group=g), u], dim=1)  # (B, K-1+T, C)
    if u.shape[1] == 0:
        return full[:, k - 1 :]
    y = F.conv1d(
        full.transpose(1, 2),
        weight.to(u.dtype),
        None if bias is None else bias.to(u.dtype),
        groups=u.shape[2],
    )
    return F.silu(y.transpose(1, 2))


def _removing_pads(u, keep, weight, bias, g) -> torch.Tensor:
    """Row by row, the convolution of the row's real tokens (each rank's real tokens form
    the row's shard of the padless sequence, its length the halo's shard length); pads
    output zeros. One halo per row: B gathers of (K - 1)·C values."""
    y = torch.zeros_like(u)
    for row in range(u.shape[0]):
        real = keep[row].nonzero().squeeze(-1)  # (n,) positions of the real tokens
        y_row = _conv(u[row : row + 1, real], weight, bias, g)  # n may be 0: still gathers
        y = y.index_put((torch.tensor([row], device=u.device), real), y_row[0])
    return y
