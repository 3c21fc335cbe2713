"""Packed sequences: several documents in one row, the causal state reset at each boundary.

A row of T tokens holds documents [c_0, c_1), [c_1, c_2), ..., [c_{n-1}, c_n) with
``cu_seqlens`` = (c_0 = 0, c_1, ..., c_n = T) (the cumulative lengths of flash-attention and
fla's varlen kernels). Query i of document d sees the keys j of d with j <= i only:

    out_i = Σ_{c_d <= j <= i} s_ij v_j / stab(offset + Σ_{c_d <= j <= i} s_ij),  c_d <= i < c_{d+1},

s_ij = φq_i·φk_j (squared with ``square``), as ``linear_attention`` per document. The first
document continues ``initial_state`` (the keys before the row, e.g. a document cut at the row's
start); every later document starts empty. The returned state is that of the last document.

Algorithm (pad-to-batch over the backend contract of ``polysketch.ops.dispatch``): the
documents before the last, sorted by length, are cut into batches, each zero-padded to its
longest document and stacked (..., n, L, F) (a zero key adds nothing, a zero query row is
dropped), one backend call without state per batch; a batch holds as many documents as the
dispatcher's group budget allows (``_run_batched``). The last document runs alone with the
state in and out. A state read (``polysketch.ops.state_io``) adds ``initial_state`` to the
first document's rows when it is not also the last. ``benchmarks/cp_varlen.py`` measures it
against the unpacked row and a loop of one call per document. ``naive_varlen_linear_attention``
is the reference (a loop over the documents of ``naive_linear_attention``).

``causal_parts`` is the shared core (the numerator, the normalizer and the last document's
state before normalizing); ``polysketch.distributed`` builds context parallelism on it.
"""

from __future__ import annotations

import math

import torch

from .._checks import check_choice, compute_dtype
from ._validate import (
    check_bool,
    check_chunk_size,
    check_key_padding_mask,
    check_offset_eps,
    check_qkv,
)
from .blocks import group_blocks_for
from .dispatch import ALGORITHMS, operand_dtype, plan
from .naive import (
    DEFAULT_EPS,
    naive_linear_attention,
    refuse_zero_normalizers,
    stabilize_denominator,
)
from .pairs import key_state
from .state import LinearAttentionState, unpack_state
from .state_io import read_state

__all__ = [
    "causal_parts",
    "check_cu_seqlens",
    "document_starts",
    "naive_varlen_linear_attention",
    "varlen_linear_attention",
]


def check_cu_seqlens(cu_seqlens, length: int, name: str = "cu_seqlens") -> list[int]:
    """``cu_seqlens`` as a list of ints: 1-D, starts at 0, non-decreasing, ends at ``length``.

    Accepts a 1-D integer tensor (any device: read once to the host) or a sequence of ints.
    Repeated values (empty documents) are allowed.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise TypeError(
                f"{name} must be a 1-D integer tensor or a sequence of ints, got a tensor of "
                f"shape {tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}"
            )
        values = [int(x) for x in cu_seqlens.tolist()]
    elif isinstance(cu_seqlens, (list, tuple)) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens
    ):
        values = list(cu_seqlens)
    else:
        raise TypeError(
            f"{name} must be a 1-D integer tensor or a sequence of ints, got "
            f"{type(cu_seqlens).__name__}"
        )
    if not values or values[0] != 0 or values[-1] != length:
        raise ValueError(
            f"{name} must start at 0 and end at the sequence length {length} (the cumulative "
            f"document lengths), got {values[:4]}{'...' if len(values) > 4 else ''} ending at "
            f"{values[-1] if values else None}"
        )
    if any(b < a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    return values


def document_starts(cu: list[int], start: int, end: int) -> list[int]:
    """The documents starting inside the rows [start, end) of a packed row, relative to start.

    ``cu`` a checked ``cu_seqlens`` of the whole row. Boundaries at 0 and at the end of the
    row are not starts (the first document continues the initial state); a boundary at
    ``start`` gives 0 (the rows begin a new document).
    """
    total = cu[-1]
    inside = sorted({c for c in cu[1:-1] if 0 < c < total and start <= c < end})
    return [c - start for c in inside]


def causal_parts(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    starts: list[int] | tuple[int, ...] = (),
    square: bool,
    chunk_size: int,
    initial: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_padding_mask: torch.Tensor | None = None,
    algorithm: str = "chunked",
    return_state: bool = False,
):
    """(num, den, state) of causal linear attention with resets at ``starts``, unnormalized.

    Shapes (validated by the caller): phi_q, phi_k (..., T, F), v (..., T, E), T >= 0;
    ``starts`` sorted document starts in [0, T) (0: the rows begin a new document);
    ``initial`` (N_0 (..., F', E), Z_0 (..., F')) in the accumulation dtype, read by the
    first document unless a document starts at 0. Returns num (..., T, E) and den (..., T) in
    the accumulation dtype (module docstring, before ``offset`` and the division) and, with
    ``return_state``, the state (N, Z) of the keys after the last start (with ``initial`` if
    there is none), else ``None``. The state stays connected to the inputs' autograd graph
    even when T = 0 (a collective in its backward needs every rank to take part).
    """
    t, e = phi_q.shape[-2], v.shape[-1]
    acc = compute_dtype(phi_q.dtype)
    bounds = [0, *starts, t]
    segs = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    continues = not starts or starts[0] > 0
    if key_padding_mask is not None:  # masked keys (and their possibly non-finite v) drop out
        keep = key_padding_mask.unsqueeze(-1)
        phi_k = torch.where(keep, phi_k, phi_k.new_zeros(()))
        v = torch.where(keep, v, v.new_zeros(()))
    if not segs:  # no token: an empty output; the state is the initial one (or zero)
        num = phi_q.new_zeros(*phi_q.shape[:-1], e, dtype=acc)
        den = phi_q.new_zeros(phi_q.shape[:-1], dtype=acc)
        if not return_state:
            return num, den, None
        n, z = key_state(phi_k.to(acc), v.to(acc), square=square)  # zeros, in the graph
        if initial is not None and continues:
            n, z = n + initial[0], z + initial[1]
        return num, den, (n, z)
    needs_grad = torch.is_grad_enabled() and any(
        x.requires_grad for x in (phi_q, phi_k, v, *(initial or ()))
    )
    kw = {"square": square, "chunk_size": chunk_size}

    def run(lo, hi, init, with_state):
        how = plan(algorithm, phi_q, phi_k, v, square=square, with_state=with_state,
                   needs_grad=needs_grad)  # fmt: skip
        q, k, c = (x[..., lo:hi, :].to(how.operand_dtype) for x in (phi_q, phi_k, v))
        return how.run(q, k, c, initial=init, return_state=with_state and return_state, **kw)

    *rest, (lo, hi) = segs
    first_init = initial if continues else None
    last_init = first_init if not rest else None
    num, den, state = run(lo, hi, last_init, return_state or last_init is not None)
    if rest:
        num_r, den_r = _run_batched(rest, phi_q, phi_k, v, algorithm=algorithm,
                                    needs_grad=needs_grad, **kw)  # fmt: skip
        if first_init is not None:  # the first document also reads the initial state
            s0 = rest[0][1]
            p0 = torch.cat([first_init[0], first_init[1].unsqueeze(-1)], dim=-1)
            q0 = phi_q[..., :s0, :].to(operand_dtype(phi_q.dtype, phi_q.device))
            r = read_state(q0, p0, square=square)
            num_r = torch.cat([num_r[..., :s0, :] + r[..., :e], num_r[..., s0:, :]], dim=-2)
            den_r = torch.cat([den_r[..., :s0] + r[..., e], den_r[..., s0:]], dim=-1)
        num, den = torch.cat([num_r, num], dim=-2), torch.cat([den_r, den], dim=-1)
    return num, den, state if return_state else None


def _run_batched(segs, phi_q, phi_k, v, *, square, chunk_size, algorithm, needs_grad):
    """(num, den) of the rows [0, end) of the documents ``segs`` (in order, end = the last
    one's end), without states: one backend call per batch of documents of similar length.

    Documents are sorted by length and cut into batches, each zero-padded to its longest
    document and stacked as a leading dim: (..., n, L, F). A batch holds as many documents as
    the dispatcher's group budget allows (``ops.blocks.group_blocks_for`` at the stacked
    leading size): the backends split long rows into groups of blocks, not a tall stack of
    short rows, so a batch beyond the budget would run its per-group temporaries out of cache.
    """
    how = plan(algorithm, phi_q, phi_k, v, square=square, with_state=False, needs_grad=needs_grad)
    f, e, dev = phi_q.shape[-1], v.shape[-1], phi_q.device
    lead = math.prod(phi_q.shape[:-2])
    itemsize = torch.empty((), dtype=how.accumulate_dtype).element_size()
    order = sorted(segs, key=lambda s: s[0] - s[1])  # longest first (stable)
    batches, i = [], 0
    while i < len(order):
        width = order[i][1] - order[i][0]
        blk = max(1, min(chunk_size, width))
        blocks = -(-width // blk)
        fit = len(order)
        if how.group_bytes is not None:
            fit = group_blocks_for(
                how.group_bytes,
                blocks=len(order) * blocks,
                blk=blk,
                f=f,
                e=e,
                d=f,
                square=square,
                lead=lead,
                itemsize=itemsize,
            )
            fit = max(1, fit // blocks)  # fmt: skip
        batches.append(order[i : i + fit])
        i += fit
    end = segs[-1][1]
    x_pad = [torch.cat([x[..., :end, :].to(how.operand_dtype),
                        x.new_zeros(*x.shape[:-2], 1, x.shape[-1], dtype=how.operand_dtype)],
                       dim=-2) for x in (phi_q, phi_k, v)]  # fmt: skip
    rows, slots, offset = [], torch.empty(end, dtype=torch.long, device=dev), 0
    for batch in batches:
        lengths = torch.tensor([b - a for a, b in batch], device=dev)
        begins = torch.tensor([a for a, _ in batch], device=dev)
        width = int(lengths.max())
        j = torch.arange(width, device=dev)
        valid = j < lengths.unsqueeze(-1)  # (n, L)
        rows.append(torch.where(valid, begins.unsqueeze(-1) + j, end))  # padding: the zero row
        slot = torch.arange(len(batch), device=dev).unsqueeze(-1) * width + j
        slots[rows[-1][valid]] = offset + slot[valid]
        offset += len(batch) * width
    # one gather for all batches, then views (a gather per batch would give each batch's
    # backward a full-length zero gradient: O(batches x T))
    index = torch.cat([r.flatten() for r in rows])
    sizes = [r.numel() for r in rows]
    parts = [x.index_select(-2, index).split(sizes, dim=-2) for x in x_pad]
    nums, dens = [], []
    for r, q, k, c in zip(rows, *parts, strict=True):
        q, k, c = (x.unflatten(-2, r.shape) for x in (q, k, c))
        num, den, _ = how.run(q, k, c, square=square, chunk_size=chunk_size, initial=None,
                              return_state=False)  # fmt: skip
        nums.append(num.flatten(-3, -2))
        dens.append(den.flatten(-2))
    num = nums[0] if len(nums) == 1 else torch.cat(nums, dim=-2)
    den = dens[0] if len(dens) == 1 else torch.cat(dens, dim=-1)
    return num.index_select(-2, slots), den.index_select(-1, slots)


def _check_packed(phi_q, phi_k, v, cu_seqlens, key_padding_mask, offset, eps):
    """Shared argument checks; returns (cu list, offset, eps)."""
    check_qkv(phi_q, phi_k, v, causal=True)
    if phi_q.shape[-2] != phi_k.shape[-2]:
        raise ValueError(
            f"packed sequences need phi_q and phi_k of the same length (the packed row), got "
            f"{tuple(phi_q.shape)} and {tuple(phi_k.shape)}"
        )
    check_key_padding_mask(key_padding_mask, phi_k)
    cu = check_cu_seqlens(cu_seqlens, phi_k.shape[-2])
    return (cu, *check_offset_eps(offset, eps))


def varlen_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens,
    *,
    square: bool = False,
    chunk_size: int = 256,
    normalize: bool = True,
    denominator_offset: float = 0.0,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    algorithm: str = "chunked",
    eps: float = DEFAULT_EPS,
):
    """Causal linear attention on packed documents (module docstring); also reached through
    ``linear_attention(..., cu_seqlens=...)``.

    Args:
        phi_q, phi_k: (..., T, F) query and key features of the packed row(s); v (..., T, E).
            All leading dims share one packing (pack B rows into one row of B·T tokens for
            different boundaries per row, as fla does).
        cu_seqlens: (n+1,) cumulative document lengths, 0 = c_0 <= c_1 <= ... <= c_n = T
            (integer tensor or sequence of ints; read to the host once).
        initial_state: a ``LinearAttentionState`` the FIRST document continues (``None``:
            it starts empty). return_state: also return the last document's state; its
            ``length`` counts that document's tokens (plus ``initial_state.length`` when it
            is the first).
        Others as ``linear_attention`` (``square``, ``chunk_size``, ``normalize``,
        ``denominator_offset``, ``key_padding_mask`` (..., T), ``algorithm``, ``eps``).

    Returns:
        out (..., T, E) in the input dtype, or ``(out, state)`` with ``return_state``.
    """
    for value, name in ((square, "square"), (normalize, "normalize"),
                        (return_state, "return_state")):  # fmt: skip
        check_bool(value, name)
    cu, offset, eps = _check_packed(phi_q, phi_k, v, cu_seqlens, key_padding_mask,
                                    denominator_offset, eps)  # fmt: skip
    chunk_size = check_chunk_size(chunk_size)
    check_choice(algorithm, "algorithm", ALGORITHMS)
    t, e, f = phi_q.shape[-2], v.shape[-1], phi_q.shape[-1]
    acc = compute_dtype(phi_q.dtype)
    init = unpack_state(initial_state, leading=tuple(phi_q.shape[:-2]), feature_dim=f,
                        value_dim=e, square=square, dtype=acc, device=phi_q.device)  # fmt: skip
    starts = document_starts(cu, 0, t)
    num, den, state = causal_parts(
        phi_q, phi_k, v, starts=starts, square=square, chunk_size=chunk_size,
        initial=None if initial_state is None else init, key_padding_mask=key_padding_mask,
        algorithm=algorithm, return_state=return_state,
    )  # fmt: skip
    if normalize and offset == 0.0:
        refuse_zero_normalizers(den, _sees_a_key(key_padding_mask, starts, t, initial_state))
    out = num / stabilize_denominator(den.unsqueeze(-1) + offset, eps) if normalize else num
    out = out.to(phi_q.dtype)
    if not return_state:
        return out
    last = t - (starts[-1] if starts else 0)
    if not starts and initial_state is not None:
        last += initial_state.length
    return out, LinearAttentionState(*state, last)


def naive_varlen_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens,
    *,
    square: bool = False,
    normalize: bool = True,
    denominator_offset: float = 0.0,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """Reference of ``varlen_linear_attention``: ``naive_linear_attention(causal=True)`` on
    each document [c_d, c_{d+1}) in a loop, concatenated. O(Σ_d L_d²); arguments as there."""
    cu, offset, eps = _check_packed(phi_q, phi_k, v, cu_seqlens, key_padding_mask,
                                    denominator_offset, eps)  # fmt: skip
    outs = []
    for a, b in zip(cu, cu[1:], strict=False):
        if b > a:
            kpm = None if key_padding_mask is None else key_padding_mask[..., a:b]
            outs.append(naive_linear_attention(
                phi_q[..., a:b, :], phi_k[..., a:b, :], v[..., a:b, :], causal=True,
                square=square, normalize=normalize, denominator_offset=offset,
                key_padding_mask=kpm, eps=eps,
            ))  # fmt: skip
    if not outs:
        return phi_q.new_zeros(*phi_q.shape[:-1], v.shape[-1])
    return torch.cat(outs, dim=-2)


def _sees_a_key(key_padding_mask, starts, t, initial_state) -> torch.Tensor | None:
    """Whether each packed query sees a real key of its document (the first document also
    sees ``initial_state``'s keys): (..., T) bool, or None when every query does."""
    if key_padding_mask is None:
        return None
    count = key_padding_mask.to(torch.int64).cumsum(-1)
    before = torch.nn.functional.pad(count, (1, 0))  # before[..., i] = real keys before i
    start = torch.zeros(t, dtype=torch.int64, device=count.device)
    for s in starts:  # each position's document start (``document_starts``: sorted host ints)
        start[s:] = s
    sees = (count - before[..., start]) > 0
    if initial_state is not None and initial_state.length > 0:
        first = torch.arange(t, device=count.device) < (starts[0] if starts else t)
        sees = sees | first
    return sees
