"""Context-parallel mixed attention: a halo for the block that crosses each shard boundary.

``polysketch.ops.mixed_attention`` scores keys of a query's own block (of b = ``chunk_size``
rows, aligned to position 0) exactly and earlier blocks through the features. Under context
parallelism the block grid stays GLOBAL: rank r's first rows belong to the block starting at
g_r = b·⌊start_r/b⌋ <= start_r, whose first h_r = start_r - g_r rows sit on earlier ranks.
So rank r

1. receives those h_r rows of k, φk, v (the halo, ``polysketch.distributed.halo``: one
   all-gather of every rank's last b - 1 rows and its length, which also gives start_r);
2. runs the block function of ``polysketch.ops.blocks`` on [halo; own rows] from g_r, in two
   calls: the complete blocks [g_r, b·⌊end_r/b⌋), whose final state is this rank's carry
   C_r = Σ of the blocks that END inside (start_r, end_r], then the partial last block,
   reading C_r; the halo rows' own outputs are dropped (their queries are zero);
3. all-gathers the carries and adds the exclusive prefix Σ_{ρ<r} C_ρ through the features
   (``polysketch.distributed.exchange``, ``polysketch.ops.state_read``).

Each block is counted once, by the rank where it ends: Σ_{ρ<r} C_ρ holds exactly the blocks
ending at or before start_r, i.e. every key before g_r, and never the halo's partial block
(whose keys rank r scores exactly). The output equals ``mixed_attention`` on the whole
sequence up to rounding; bytes per rank and layer: the halo (W-1)·(b-1)·(D+F+E) and the state
(W-1)·F'·(E+1) elements per head, forward and again backward.
"""

from __future__ import annotations

import torch

from .._checks import compute_dtype
from ..ops.blocks import blocks_lt_multiply
from ..ops.dispatch import group_bytes_for, operand_dtype
from ..ops.mixed import _validate
from ..ops.naive import DEFAULT_EPS, stabilize_denominator
from ..ops.pairs import key_state
from ..ops.state_read import read_state
from .exchange import exchange_states
from .group import resolve_group
from .halo import halo_exchange

__all__ = ["cp_mixed_attention"]


def cp_mixed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    *,
    group=None,
    chunk_size: int = 256,
    local: str = "polynomial",
    degree: int = 4,
    square: bool = False,
    denominator_offset: float = 0.0,
    scale: float | None = None,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """``polysketch.ops.mixed_attention`` over a sequence sharded across ``group``'s ranks.

    Args:
        q, k: this rank's shard (..., T_r, D); v (..., T_r, E); phi_q, phi_k (..., T_r, F).
            T_r >= 0, any split in rank order; leading dims, D, F, E, dtype and device equal
            on every rank. group: the cp group (``polysketch.distributed.resolve_group``);
            every rank calls this op and its backward together.
        local: ``"polynomial"`` only (the psf_mixed preset; the "relu" kernel has no block
            function with states). Others as ``mixed_attention``.

    Returns:
        this rank's rows of the output (..., T_r, E) in the dtype of q.
    """
    g = resolve_group(group)
    b, local, degree, offset, eps, scale = _validate(
        q, k, v, phi_q, phi_k, chunk_size, local, degree, square, denominator_offset, eps, scale
    )
    if local != "polynomial":
        raise ValueError(
            f"local: context-parallel mixed attention supports 'polynomial' only, got {local!r}"
        )
    out_dtype, device = q.dtype, q.device
    od, acc = operand_dtype(q.dtype, device), compute_dtype(q.dtype)
    q, k, v, phi_q, phi_k = (x.to(od) for x in (q, k, v, phi_q, phi_k))
    t, d, f, e = q.shape[-2], q.shape[-1], phi_q.shape[-1], v.shape[-1]
    halo, lengths = halo_exchange(torch.cat([k, phi_k, v], dim=-1), b - 1, group=g)
    h = sum(lengths[: g.rank]) % b  # rows of this rank's first block held by earlier ranks
    hk, hf, hv = halo[..., b - 1 - h :, :].split([d, f, e], dim=-1)
    lead = q.shape[:-2]
    keys = torch.cat([hk, k], dim=-2)
    fk = torch.cat([hf, phi_k], dim=-2)
    vals = torch.cat([hv, v], dim=-2)
    vals = torch.cat([vals, vals.new_ones(*vals.shape[:-1], 1)], dim=-1)  # Ṽ = [V 1]
    zero_rows = q.new_zeros(*lead, h, d), phi_q.new_zeros(*lead, h, f)
    qs = torch.cat([zero_rows[0], q * scale if scale != 1.0 else q], dim=-2)
    fq = torch.cat([zero_rows[1], phi_q], dim=-2)
    n = h + t
    full = (n // b) * b
    kw = {"square": square, "chunk_size": b, "local_power": degree,
          "group_bytes": group_bytes_for(device)}  # fmt: skip
    nums = []
    if full:
        num, carry = blocks_lt_multiply(fq[..., :full, :], fk[..., :full, :], vals[..., :full, :],
                                        local_q=qs[..., :full, :], local_k=keys[..., :full, :],
                                        **kw)  # fmt: skip
        nums.append(num)
    else:  # no block ends here: a zero carry, kept in the graph (the backward gathers)
        kn, kz = key_state(fk[..., :0, :].to(acc), vals[..., :0, :-1].to(acc), square=square)
        carry = torch.cat([kn, kz.unsqueeze(-1)], dim=-1)
    if n > full:
        num, _ = blocks_lt_multiply(fq[..., full:, :], fk[..., full:, :], vals[..., full:, :],
                                    initial=carry, local_q=qs[..., full:, :],
                                    local_k=keys[..., full:, :], **kw)  # fmt: skip
        nums.append(num)
    num = torch.cat(nums, dim=-2)[..., h:, :] if nums else fq.new_zeros(*lead, 0, e + 1)
    prefix, _, _ = exchange_states(carry, group=g)
    num = num.to(acc) + read_state(phi_q, prefix, square=square)
    out = num[..., :e] / stabilize_denominator(num[..., e:] + offset, eps)
    return out.to(out_dtype)
