"""Context-parallel mixed attention: a halo for the block that crosses each shard boundary.

``polysketch.ops.mixed_attention`` scores keys of a query's own block (of b = ``chunk_size``
rows, aligned to position 0) exactly and earlier blocks through the features. Under context
parallelism the block grid stays GLOBAL: rank r's first rows belong to the block starting at
g_r = b·⌊start_r/b⌋ <= start_r, whose first h_r = start_r - g_r rows sit on earlier ranks.
So rank r

1. receives those h_r rows of k, φk, v (the halo, ``polysketch.distributed.halo``: one
   all-gather of every rank's last b - 1 rows and its length, which also gives start_r);
2. sums into its state C_r the blocks that END inside its shard, (start_r, end_r]: the rows
   [g_r, b·⌊end_r/b⌋) of [halo; own rows], Σ Ψ(φk)ᵀ [v 1] (``ops.state_io.sum_state``);
3. all-gathers the C_ρ and takes P_r = Σ_{ρ<r} C_ρ (``polysketch.distributed.exchange``);
4. runs the block function of ``polysketch.ops.blocks`` on [halo; own rows] from g_r with
   P_r as its initial state; the halo rows' own outputs are dropped (their queries are zero).

Each block is summed once, by the rank where it ends: P_r holds exactly the blocks ending at
or before start_r, i.e. every key before g_r, and never the halo's partial block (whose keys
rank r scores exactly). The output equals ``mixed_attention`` on the whole sequence up to
rounding; per rank and layer it receives the halo, (W-1)·(b-1)·(D+F+E), and the states,
(W-1)·F'·(E+1) elements per head, in the forward, and as much again in the backward.
"""

from __future__ import annotations

import torch

from .._checks import compute_dtype
from ..ops.blocks import blocks_lt_multiply
from ..ops.dispatch import group_bytes_for, operand_dtype
from ..ops.mixed import _validate
from ..ops.naive import DEFAULT_EPS, stabilize_denominator
from ..ops.state_io import sum_state
from .exchange import exchange_states, keep_in_graph
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
        local: ``"polynomial"`` (the psf_mixed preset) or ``"none"`` (no in-block scores,
            ``soft_hash_far``); the "relu" kernel has no block function with states and is
            refused. Others as ``mixed_attention``.

    Returns:
        this rank's rows of the output (..., T_r, E) in the dtype of q.
    """
    g = resolve_group(group)
    b, local, degree, offset, eps, scale = _validate(
        q, k, v, phi_q, phi_k, chunk_size, local, degree, square, denominator_offset, eps, scale
    )
    if local not in ("polynomial", "none"):
        raise ValueError(
            "local: context-parallel mixed attention supports 'polynomial' and 'none' only, "
            f"got {local!r}"
        )
    out_dtype, device = q.dtype, q.device
    od, acc = operand_dtype(q.dtype, device), compute_dtype(q.dtype)
    q, k, v, phi_q, phi_k = (x.to(od) for x in (q, k, v, phi_q, phi_k))
    t, d, f, e = q.shape[-2], q.shape[-1], phi_q.shape[-1], v.shape[-1]
    m = min(t, b - 1)
    tail = torch.cat([x[..., t - m :, :] for x in (k, phi_k, v)], dim=-1)
    halo, lengths = halo_exchange(tail, b - 1, length=t, group=g)
    h = sum(lengths[: g.rank]) % b  # rows of this rank's first block held by earlier ranks
    hk, hf, hv = halo[..., b - 1 - h :, :].split([d, f, e], dim=-1)
    lead = q.shape[:-2]
    keys, fk, vals = _prepend(hk, k), _prepend(hf, phi_k), _prepend(hv, v)
    vals = torch.cat([vals, vals.new_ones(*vals.shape[:-1], 1)], dim=-1)  # Ṽ = [V 1]
    qs = _prepend(q.new_zeros(*lead, h, d), q * scale if scale != 1.0 else q)
    fq = _prepend(phi_q.new_zeros(*lead, h, f), phi_q)
    full = ((h + t) // b) * b  # the rows of the blocks that end inside this shard
    n, z = sum_state(fk[..., :full, :].to(acc), vals[..., :full, :-1].to(acc), square=square)
    carry = keep_in_graph(torch.cat([n, z.unsqueeze(-1)], dim=-1), halo)  # halo read or not
    prefix, _, _ = exchange_states(carry, group=g)
    if t:
        num, _ = blocks_lt_multiply(
            fq, fk, vals, square=square, chunk_size=b, initial=prefix, local_q=qs, local_k=keys,
            local_power=degree, group_bytes=group_bytes_for(device), in_block=local == "polynomial",
        )  # fmt: skip
        num = num[..., h:, :]
    else:  # nothing to compute; the prefix's backward gathers on every rank: keep it
        num = keep_in_graph(fq.new_zeros(*lead, 0, e + 1, dtype=acc), prefix)
    out = num[..., :e] / stabilize_denominator(num[..., e:] + offset, eps)
    return out.to(out_dtype)


def _prepend(rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[rows; x] along T, or x itself (no copy) when there are no rows."""
    return x if rows.shape[-2] == 0 else torch.cat([rows, x], dim=-2)
