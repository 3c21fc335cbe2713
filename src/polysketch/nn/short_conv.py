"""``ShortConv``: a causal depthwise convolution of a few taps over time, then SiLU.

Linear attentions recall poorly in small models without a way to look one or two tokens
back: BASED (Arora et al., 2024) and the Zoology models that define the MQAR task put short
convolutions beside their linear attention, and fla's linear-attention layers (GLA, DeltaNet)
apply one to the projected queries, keys and values. ``KernelAttention(short_conv=K)`` does
the latter: for each channel c of the projections u (B, T, C),

    y_t,c = SiLU( Σ_{i=0..K-1} w_c,i · u_{t-K+1+i, c} + b_c ),     u_s = 0 for s < 0,

so position t sees tokens t-K+1 .. t only (causal). Padded tokens (``keep`` False) are
removed (``polysketch.nn.padding``): a real token sees the K - 1 real tokens before it, pads
reach no token and output zeros, and a row with pads anywhere computes what it computes
without them (left padding reads as zeros before the sequence start, as without pads).
Decoding keeps the last K - 1 real inputs (``tail``, (B, K-1, C)) between calls: feeding a
sequence in pieces gives the same outputs as feeding it whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .._checks import check_int, check_positive_int
from .padding import compaction, gather_time

__all__ = ["ShortConv"]


class ShortConv(nn.Module):
    """Causal depthwise convolution of ``kernel_size`` taps over T, then SiLU: (B, T, C) -> same.

    Args:
        channels: C. kernel_size: K ≥ 2 (K = 1 would be a per-channel scale).
    Parameters: ``weight`` (C, 1, K) and ``bias`` (C,), torch's ``Conv1d`` initialization.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.channels = check_positive_int(channels, "channels")
        self.kernel_size = check_int(kernel_size, "kernel_size", minimum=2)
        conv = nn.Conv1d(channels, channels, kernel_size, groups=channels)
        self.weight, self.bias = conv.weight, conv.bias

    def forward(
        self,
        u: torch.Tensor,
        *,
        keep: torch.Tensor | None = None,
        tail: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """u (B, T, C) -> (y (B, T, C), new tail (B, K-1, C)).

        ``keep``: bool (B, T), False rows are removed (their outputs are zeros).
        ``tail``: the inputs of the K - 1 real tokens before u (from the previous call), None =
        the sequence starts here.
        """
        b, t, c = u.shape
        if c != self.channels:
            raise ValueError(f"u must have {self.channels} channels (last dim), got {c}")
        inverse = None
        if keep is not None:  # real tokens first, in order: the convolution skips the pads
            perm, inverse = compaction(keep)
            u = gather_time(u * keep[..., None].to(u.dtype), perm, dim=1)
        if tail is None:
            tail = u.new_zeros(b, self.kernel_size - 1, c)
        elif tuple(tail.shape) != (b, self.kernel_size - 1, c):
            raise ValueError(
                f"tail must have shape {(b, self.kernel_size - 1, c)}, got {tuple(tail.shape)}"
            )
        full = torch.cat([tail.to(u.dtype), u], dim=1)  # (B, K-1+T, C)
        y = F.conv1d(
            rearrange(full, "b t c -> b c t"),
            self.weight.to(u.dtype),
            self.bias.to(u.dtype),
            groups=c,
        )
        y = F.silu(rearrange(y, "b c t -> b t c"))
        if inverse is None:
            return y, full[:, full.shape[1] - (self.kernel_size - 1) :]
        real = keep.sum(-1, keepdim=True)  # the tail: the K - 1 inputs before row b's end
        last = real + torch.arange(self.kernel_size - 1, device=u.device)  # in `full`
        y = gather_time(y, inverse, dim=1) * keep[..., None].to(y.dtype)  # pads: zeros
        return y, gather_time(full, last, dim=1)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, kernel_size={self.kernel_size}"
