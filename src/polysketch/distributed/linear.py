"""Context-parallel causal linear attention: shards of T per rank, one all-gather of states.

Rank r holds the rows [start_r, end_r) of φq, φk, V (``polysketch.distributed.group``). The
causal output of a row i splits into the keys of its own shard and those of earlier shards:

    num_i = lt(s) V |_own  +  Ψq(φq_i)·N_{<r},     den_i = lt(s) 1 |_own  +  Ψq(φq_i)·Z_{<r},
    out_i = num_i / stab(offset + den_i)                          (``polysketch.ops.kernel``)

with (N, Z) the state of ``polysketch.ops.state`` (pair layout for squared maps), and the
earlier shards' state is the sum of their own. So each rank (LASP-2's order)

1. sums its keys into its state C_r = Σ_{own j} Ψ(φk_j)ᵀ [v_j 1] (``ops.state_io.sum_state``:
   O(T_r·F'·E), pair features recomputed in the backward, never stored);
2. all-gathers the C_ρ once, in the accumulation dtype (fp32 for bf16/fp16 inputs), and takes
   the exclusive prefix P_r = Σ_{ρ<r} C_ρ (``polysketch.distributed.exchange``);
3. runs the backend contract of ``polysketch.ops.dispatch`` on its shard with P_r as the
   initial state (chunked, any T_r, key padding; ``ops.varlen.causal_parts``) and divides.

The local attention thus reads the earlier shards exactly as a single process reads the
earlier blocks (Theorem 3.1): no output correction, no T-sized temporary beyond the
single-process op's. (Measured, fp32, T_r = 64k, H = 4, psf_random, one process: this order
peaks 60 MB above ``linear_attention`` at the same T, the backward of step 1; correcting the
outputs afterwards with a read of the prefix instead peaked 165 MB above it.) The
returned final state is the total Σ_ρ C_ρ, the same on every rank. Backward: autograd through
each step; the exchange's backward all-gathers the prefix gradients (reverse prefix). Per
layer and step one rank receives (W-1)·F'·(E+1) floats per head in the forward, as much again
in the backward (twice with ``return_state``): independent of T (LASP-2's all-gather; ring
attention sends every K and V).

Packed sequences (``cu_seqlens`` of the whole sequence, the same on every rank): the shard's
documents reset as in ``polysketch.ops.varlen``; a rank's state is that of its keys after its
last document start, and the prefix over ranks restarts at the last shard in which a document
begins. A small all-gather of the shard lengths comes first (packing needs start_r before the
local step).
"""

from __future__ import annotations

import torch

from .._checks import check_choice, compute_dtype
from ..ops._validate import (
    check_bool,
    check_chunk_size,
    check_key_padding_mask,
    check_offset_eps,
    check_qkv,
)
from ..ops.dispatch import ALGORITHMS
from ..ops.naive import DEFAULT_EPS, stabilize_denominator
from ..ops.state import LinearAttentionState, unpack_state
from ..ops.state_io import sum_state
from ..ops.varlen import causal_parts, check_cu_seqlens, document_starts
from .comm import gather_ints
from .exchange import exchange_states, keep_in_graph
from .group import resolve_group

__all__ = ["cp_linear_attention"]


def cp_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    square: bool = False,
    chunk_size: int = 256,
    normalize: bool = True,
    denominator_offset: float = 0.0,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens=None,
    algorithm: str = "chunked",
    eps: float = DEFAULT_EPS,
):
    """Causal ``linear_attention`` over a sequence sharded across the ranks of ``group``.

    Args:
        phi_q, phi_k: this rank's shard of the features (..., T_r, F); v (..., T_r, E).
            T_r >= 0 (shards may be empty or unequal; rank order is sequence order); leading
            dims, F, E, dtype and device equal on every rank.
        group: the cp group: a ProcessGroup, a 1-D DeviceMesh (``mesh["cp"]``) or ``None``
            (world). Every rank of it must call this op (and its backward) together.
        initial_state: the state of keys before the sequence; read on the group's first
            rank only (other ranks' argument is validated, then ignored: pass the same state
            or ``None``). return_state: also return the state after the whole sequence
            (the same on every rank; its ``length`` is the first rank's ``initial_state``
            length + Σ T_r, or with ``cu_seqlens`` the last document's tokens).
        key_padding_mask: this rank's shard (..., T_r), True = keep.
        cu_seqlens: packed documents of the WHOLE sequence (``polysketch.ops.varlen``), the
            same on every rank; its last entry must be Σ_r T_r.
        square, chunk_size, normalize, denominator_offset, algorithm, eps: as
            ``polysketch.ops.linear_attention`` (the earlier shards enter the local call as
            an initial state, so ``algorithm="triton"``, which takes none, is refused).

    Returns:
        this rank's rows of the output (..., T_r, E) in the input dtype, or ``(out, state)``.
        Equal to ``linear_attention`` on the whole sequence, up to rounding.
    """
    g = resolve_group(group)
    for value, name in ((square, "square"), (normalize, "normalize"),
                        (return_state, "return_state")):  # fmt: skip
        check_bool(value, name)
    check_qkv(phi_q, phi_k, v, causal=True)
    if phi_q.shape[-2] != phi_k.shape[-2]:
        raise ValueError(
            "context parallelism needs phi_q and phi_k of the same shard length, got "
            f"{tuple(phi_q.shape)} and {tuple(phi_k.shape)}"
        )
    chunk_size = check_chunk_size(chunk_size)
    check_choice(algorithm, "algorithm", ALGORITHMS)
    check_key_padding_mask(key_padding_mask, phi_k)
    offset, eps = check_offset_eps(denominator_offset, eps)
    t, f, e = phi_q.shape[-2], phi_q.shape[-1], v.shape[-1]
    acc = compute_dtype(phi_q.dtype)
    init = unpack_state(initial_state, leading=tuple(phi_q.shape[:-2]), feature_dim=f,
                        value_dim=e, square=square, dtype=acc, device=phi_q.device)  # fmt: skip
    init = init if initial_state is not None and g.rank == 0 else None
    init_length = initial_state.length if init is not None else 0

    starts, resets, cu = [], None, None
    if cu_seqlens is not None:
        lengths = [m[0] for m in gather_ints([t], group=g, name="lengths", device=phi_q.device)]
        cu = check_cu_seqlens(cu_seqlens, sum(lengths))  # the same verdict on every rank
        begins = [sum(lengths[:rho]) for rho in range(g.world_size)]
        starts = document_starts(cu, begins[g.rank], begins[g.rank] + t)
        resets = [bool(document_starts(cu, b, b + n)) for b, n in zip(begins, lengths, strict=True)]

    if key_padding_mask is not None:  # masked keys (and their possibly non-finite v) drop out
        keep = key_padding_mask.unsqueeze(-1)
        phi_k = torch.where(keep, phi_k, phi_k.new_zeros(()))
        v = torch.where(keep, v, v.new_zeros(()))
    last = starts[-1] if starts else 0  # this rank's state: its keys after its last start
    n, z = sum_state(phi_k[..., last:, :].to(acc), v[..., last:, :].to(acc), square=square)
    carry = torch.cat([n, z.unsqueeze(-1)], dim=-1)  # [N Z] (..., F', E+1)
    if init is not None and not starts:  # the first rank's document continues the initial state
        carry = carry + torch.cat([init[0], init[1].unsqueeze(-1)], dim=-1)
    prefix, total, metas = exchange_states(carry, group=g, resets=resets, with_total=return_state,
                                           ints=[t, init_length])  # fmt: skip
    if init is not None:  # the first rank's prefix is empty: it reads the initial state
        prefix = prefix + torch.cat([init[0], init[1].unsqueeze(-1)], dim=-1)
    num, den, _ = causal_parts(
        phi_q, phi_k, v, starts=starts, square=square, chunk_size=chunk_size,
        initial=(prefix[..., :e], prefix[..., e]), algorithm=algorithm,
    )  # fmt: skip
    if t == 0 or (starts and starts[0] == 0):  # the prefix is not read here, but its
        den = keep_in_graph(den, prefix)  # backward gathers on every rank: keep it
    out = num / stabilize_denominator(den.unsqueeze(-1) + offset, eps) if normalize else num
    out = out.to(phi_q.dtype)
    if not return_state:
        return out
    lengths = [m[0] for m in metas]
    length = metas[0][1] + sum(lengths)
    if cu is not None:
        inner = [c for c in cu[1:-1] if 0 < c < cu[-1]]
        length = cu[-1] - inner[-1] if inner else length
    return out, LinearAttentionState(total[..., :e], total[..., e], length)
