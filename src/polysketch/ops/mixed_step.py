"""Decoding mixed local + global attention (``polysketch.ops.mixed``) one token at a time.

The state after t tokens, with blocks of b = ``chunk_size`` rows aligned to position 0:

    summary = Σ_{j < b·⌊t/b⌋} Ψ(φk_j)⊗[v_j 1]     (..., F', E+1): N and Z of the completed
                                                   blocks side by side (PolySketchFormer §4's
                                                   [V 1]; layout of ``polysketch.ops.state``)
    k, φk, v of the current block's tokens (t mod b < b of them),

so a new token i (in the current block) reads

    out_i = (Σ_{j ∈ blk(i), j ≤ i} κ_ij v_j + Ψq(φq_i)·N) / stab(offset + Σ κ_ij + Ψq(φq_i)·Z),

κ_ij = κ(scale·q_i·k_j) the exact local kernel — one row of ``mixed_attention`` — and, when its
block completes, the block's Ψ(φk)⊗[v 1] is folded into ``summary``. Memory
F'·(E+1) + (t mod b)·(D + F + E) per sequence, bounded in t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import as_dtype, check_positive_int, compute_dtype
from .mixed import _local_kernel, _validate, _with_ones, mixed_attention
from .naive import DEFAULT_EPS, stabilize_denominator
from .pairs import PairFeatures, key_state, state_dim

__all__ = [
    "MixedAttentionState",
    "mixed_attention_state",
    "mixed_attention_step",
    "mixed_attention_token",
    "far_attention_token",
]


@dataclass
class MixedAttentionState:
    """Decode state of mixed attention (module docstring): ``summary`` [N Z] of the completed
    blocks (..., F', E+1) in the compute dtype or ``None`` (no block completed), the current
    block's ``k`` (..., n, D), ``phi_k`` (..., n, F), ``v`` (..., n, E) (n < b) or ``None``,
    and ``length``, the tokens consumed."""

    summary: torch.Tensor | None = None
    k: torch.Tensor | None = None
    phi_k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    length: int = 0


def _read_summary(phi_q, summary, square, acc):
    """Ψq(φq)·[N Z] (..., n, E+1) in the compute dtype ``acc``: the completed blocks' read."""
    fq = as_dtype(phi_q, acc)
    fq = PairFeatures.cached(fq.shape[-1], fq).queries(fq) if square else fq
    return fq @ summary


def _fold(summary, phi_k, v, *, square):
    """summary + Σ_j Ψ(φk_j)⊗[v_j 1] in the compute dtype."""
    acc = compute_dtype(phi_k.dtype)
    n, z = key_state(phi_k.to(acc), v.to(acc), square=square)
    s = torch.cat([n, z.unsqueeze(-1)], dim=-1)
    return s if summary is None else summary + s


def mixed_attention_state(
    k: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *, chunk_size: int, square: bool
) -> MixedAttentionState:
    """The state after the tokens k, φk (..., T, ·), v (..., T, E) from position 0: complete
    blocks folded into ``summary``, the rest kept (the state after a prefill)."""
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    t = k.shape[-2]
    full = (t // chunk_size) * chunk_size
    summary = _fold(None, phi_k[..., :full, :], v[..., :full, :], square=square) if full else None
    rest = slice(full, t)
    if full == t:
        return MixedAttentionState(summary, None, None, None, t)
    return MixedAttentionState(summary, k[..., rest, :], phi_k[..., rest, :], v[..., rest, :], t)


def mixed_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    state: MixedAttentionState | None,
    *,
    chunk_size: int = 256,
    local: str = "polynomial",
    degree: int = 4,
    square: bool = False,
    denominator_offset: float = 0.0,
    scale: float | None = None,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, MixedAttentionState]:
    """Consume n >= 1 new tokens after ``state``; return (out (..., n, E), new state).

    Arguments as ``mixed_attention`` (q, k (..., n, D), v (..., n, E), φq, φk (..., n, F)),
    ``state`` a ``MixedAttentionState`` or ``None`` (empty). From an empty state the tokens
    run as one ``mixed_attention`` call (a prefill); otherwise one token at a time (module
    docstring). Prefill then steps equals ``mixed_attention`` on the whole sequence. The
    output has the dtype of q; the summary is in the compute dtype (fp32 for bf16/fp16).
    """
    chunk_size, local, degree, offset, eps, scale = _validate(
        q, k, v, phi_q, phi_k, chunk_size, local, degree, square, denominator_offset, eps, scale
    )
    if state is not None and not isinstance(state, MixedAttentionState):
        raise TypeError(f"state must be a MixedAttentionState or None, got {type(state).__name__}")
    kw = dict(chunk_size=chunk_size, local=local, degree=degree, square=square,
              denominator_offset=offset, scale=scale, eps=eps)  # fmt: skip
    if state is None or state.length == 0:
        out = mixed_attention(q, k, v, phi_q, phi_k, **kw)
        return out, mixed_attention_state(k, phi_k, v, chunk_size=chunk_size, square=square)
    _check_state(state, q, v, phi_q, chunk_size=chunk_size, square=square)
    if q.shape[-2] == 1:
        return mixed_attention_token(q, k, v, phi_q, phi_k, state, **kw)
    outs = []
    for i in range(q.shape[-2]):
        one = (x[..., i : i + 1, :] for x in (q, k, v, phi_q, phi_k))
        out, state = mixed_attention_token(*one, state, **kw)
        outs.append(out)
    return torch.cat(outs, dim=-2), state


def mixed_attention_token(q, k, v, phi_q, phi_k, state, *, chunk_size, local, degree, square,
                          denominator_offset, scale, eps):  # fmt: skip
    """``mixed_attention_step`` for one token (all inputs (..., 1, ·)) after a non-empty
    ``state``, without its argument checks.

    Every keyword must be given, as plain values (``scale`` a float, ``local`` one of
    ``LOCAL_KERNELS``). For callers that built every argument themselves and decode token by
    token (``polysketch.nn.cache.MixedCache``): the checks of the public op cost about as much
    as the step's arithmetic on a CPU.
    ``mixed_attention_step`` validates its arguments and then calls this.
    """
    bk, bf, bv = (
        x if buf is None else torch.cat([buf, x], dim=-2)
        for buf, x in ((state.k, k), (state.phi_k, phi_k), (state.v, v))
    )
    acc = compute_dtype(q.dtype)
    z = (as_dtype(q, acc) @ as_dtype(bk, acc).transpose(-1, -2)) * scale  # (..., 1, n)
    num = _local_kernel(z, local, degree) @ _with_ones(as_dtype(bv, acc))  # (..., 1, E+1)
    if state.summary is not None:
        num = num + _read_summary(phi_q, state.summary, square, acc)
    out = num[..., :-1] / stabilize_denominator(num[..., -1:] + denominator_offset, eps)
    length = state.length + 1
    if bk.shape[-2] == chunk_size:  # the block is complete: fold it
        summary = _fold(state.summary, bf, bv, square=square)
        return as_dtype(out, q.dtype), MixedAttentionState(summary, None, None, None, length)
    return as_dtype(out, q.dtype), MixedAttentionState(state.summary, bk, bf, bv, length)


def far_attention_token(phi_q, k, v, state, *, chunk_size, square, denominator_offset, eps,
                        key_features):  # fmt: skip
    """One token of mixed attention without in-block scores (``local="none"``) whose state
    keeps the current block's raw keys instead of their features: (out (..., 1, E), state).

    out = Ψq(φq)·N / stab(offset + Ψq(φq)·Z) over the completed blocks' ``summary`` (0 before
    the first completes); k (..., 1, D) and v join the current block (``state.k``, ``state.v``;
    ``state.phi_k`` stays None), and when it completes its features ``key_features(k_block)``
    (..., b, F) are folded into the summary. So the state between block boundaries holds
    (t mod b)·(D + E) floats per head instead of (t mod b)·(D + E + F), and the result equals
    ``mixed_attention_token(..., local="none")`` when ``key_features`` is the map that made φk.
    For callers that validated everything (``polysketch.nn.cache.MixedCache``).
    """
    acc = compute_dtype(phi_q.dtype)
    bk, bv = (x if buf is None else torch.cat([buf, x], dim=-2)
              for buf, x in ((state.k, k), (state.v, v)))  # fmt: skip
    e = v.shape[-1]
    if state.summary is None:
        out = torch.zeros(*phi_q.shape[:-1], e, dtype=acc, device=phi_q.device)
    else:
        num = _read_summary(phi_q, state.summary, square, acc)
        out = num[..., :-1] / stabilize_denominator(num[..., -1:] + denominator_offset, eps)
    length = state.length + 1
    if bk.shape[-2] == chunk_size:  # the block is complete: its features, folded
        summary = _fold(state.summary, key_features(bk), bv, square=square)
        return as_dtype(out, phi_q.dtype), MixedAttentionState(summary, None, None, None, length)
    return as_dtype(out, phi_q.dtype), MixedAttentionState(state.summary, bk, None, bv, length)


def _check_state(state, q, v, phi_q, *, chunk_size, square):
    """Refuse a state that does not fit the new tokens (shapes, block position)."""
    lead, f, e = tuple(q.shape[:-2]), phi_q.shape[-1], v.shape[-1]
    n = 0 if state.k is None else state.k.shape[-2]
    if n != state.length % chunk_size:
        raise ValueError(
            f"state holds {n} tokens of the current block but length {state.length} with "
            f"chunk_size={chunk_size} needs {state.length % chunk_size}: was it made with "
            "another chunk_size?"
        )
    if state.summary is not None:
        want = (*lead, state_dim(f, square), e + 1)
        if tuple(state.summary.shape) != want:
            raise ValueError(
                f"state.summary must have shape {want} (square={square}), got "
                f"{tuple(state.summary.shape)}"
            )
    for name, buf, width in (("k", state.k, q.shape[-1]), ("phi_k", state.phi_k, f),
                             ("v", state.v, e)):  # fmt: skip
        if buf is not None and (tuple(buf.shape[:-2]) != lead or buf.shape[-1] != width):
            raise ValueError(
                f"state.{name} must have shape (..., n, {width}) with leading dims {lead}, "
                f"got {tuple(buf.shape)}"
            )
