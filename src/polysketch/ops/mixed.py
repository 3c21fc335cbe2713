"""Mixed local + global causal attention: exact scores inside each block, features before it.

PolySketchFormer (§3, Fig. 4) computes ``lt_Δ(Ã K̃ᵀ) Ṽ`` with the block lower-triangular
algorithm: the sequence is cut into blocks of ``b = chunk_size`` rows; the diagonal blocks are
multiplied directly (``lt_Δ(A_i B_iᵀ) C_i``) and every earlier block reaches block ``i`` only
through the prefix sum of the states ``B_jᵀ C_j``. The paper notes (§1) that this
recontextualises the chunked attention of Hua et al. (2022) as "a causal mask on the simple
linear transformer plus a quadratic local attention". The *mixed* variant of its public code
does exactly that: in the diagonal blocks, whose cost ``O(T b D)`` is paid anyway, it uses the
EXACT score (e.g. the degree-p polynomial of Eq. 1) instead of the sketched one, and keeps the
sketched / feature-map score ``s_ij = φq_i·φk_j`` (squared when ``square``, Eq. 2) for all keys
of earlier blocks. One normaliser is shared by both parts::

    out_i = (Σ_{j ∈ blk(i), j ≤ i} κ(q_i, k_j) v_j + Σ_{j < start(i)} s_ij v_j)
            / (offset + Σ_{j ∈ blk(i), j ≤ i} κ(q_i, k_j) + Σ_{j < start(i)} s_ij)

where ``blk(i)`` is the block of row ``i`` and ``start(i)`` its first row. Local kernels κ
(all "softmax-free", i.e. unnormalised scores that are summed with the global ones):

* ``"polynomial"``: κ(q, k) = (scale · q·k)^degree (Eq. 1; even degree keeps it >= 0);
* ``"relu"``: κ(q, k) = relu(scale · q·k)^degree (degree 2 is the relu² of Hua et al. 2022);
* ``"none"``: κ ≡ 0, so row i reads the keys of the earlier blocks only, through the features,
  normalized by their scores alone: ``out_i = Σ_{j < start(i)} s_ij v_j / (offset + Σ_{j <
  start(i)} s_ij)`` (0 in the first block). Beside an exact sliding window of at least b keys
  (``polysketch.nn.transformer.Block``) every earlier key is seen by one of the two branches,
  and the linear part skips the b×b×F in-block scores, about half of its cost at F ≫ E.

When the features are exact (e.g. ``tensor_power`` of degree p with ``local="polynomial"``,
``degree=p``) the mixed output equals exact polynomial attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import (
    check_choice,
    check_float,
    check_positive_int,
    check_same_dtype_device,
    check_tensor,
    compute_dtype,
)
from ._constants import lower_triangle
from ._validate import check_bool, check_offset_eps
from .blocks import blocks_lt_multiply
from .dispatch import group_bytes_for, operand_dtype
from .naive import DEFAULT_EPS, stabilize_denominator
from .pairs import PairFeatures

__all__ = ["mixed_attention", "naive_mixed_attention", "LOCAL_KERNELS"]

LOCAL_KERNELS = ("polynomial", "relu", "none")


# ----- validation ----------------------------------------------------------------------------
def _validate(q, k, v, phi_q, phi_k, chunk_size, local, degree, square, offset, eps, scale):
    """Check the shared arguments of ``mixed_attention`` / ``naive_mixed_attention``."""
    q = check_tensor(q, "q", min_dim=2)
    k = check_tensor(k, "k", min_dim=2)
    v = check_tensor(v, "v", min_dim=2)
    phi_q = check_tensor(phi_q, "phi_q", min_dim=2)
    phi_k = check_tensor(phi_k, "phi_k", min_dim=2)
    for name, t in (("k", k), ("v", v), ("phi_q", phi_q), ("phi_k", phi_k)):
        check_same_dtype_device("q", q, name, t)
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"v must have shape (..., T, E) with (..., T) = {tuple(q.shape[:-1])}, "
            f"got {tuple(v.shape)}"
        )
    if phi_q.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"phi_q must have shape (..., T, F) with (..., T) = {tuple(q.shape[:-1])}, "
            f"got {tuple(phi_q.shape)}"
        )
    if phi_k.shape != phi_q.shape:
        raise ValueError(
            f"phi_k must have the shape of phi_q {tuple(phi_q.shape)}, got {tuple(phi_k.shape)}"
        )
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    local = check_choice(local, "local", LOCAL_KERNELS)
    degree = check_positive_int(degree, "degree")
    check_bool(square, "square")
    offset, eps = check_offset_eps(offset, eps)
    scale = 1.0 if scale is None else check_float(scale, "scale")
    if local == "none" and offset == 0.0 and eps == 0.0:
        raise ValueError(
            'local="none" leaves the first block without keys (its normalizer is '
            "denominator_offset alone): eps=0 with denominator_offset=0 would divide 0 by 0 "
            "there; keep eps > 0 (its rows are then 0) or set an offset"
        )
    return chunk_size, local, degree, offset, eps, scale


def _local_kernel(z: torch.Tensor, local: str, degree: int) -> torch.Tensor:
    """κ applied elementwise to the scaled dot products ``z = scale · q·k``."""
    if local == "none":
        return torch.zeros_like(z)
    if local == "relu":
        z = torch.relu(z)
    return z.pow(degree)


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    """Ṽ = [V 1] (§4): one extra value column carries the normaliser. (..., T, E+1)."""
    return torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)


# ----- fast path -----------------------------------------------------------------------------
def mixed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    *,
    chunk_size: int = 256,
    local: str = "polynomial",
    degree: int = 4,
    square: bool = False,
    denominator_offset: float = 0.0,
    scale: float | None = None,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """Causal mixed attention: exact κ inside each block of ``chunk_size``, φq·φk before it.

    out_i = (Σ_{j∈blk(i), j≤i} κ_ij v_j + Σ_{j<start(i)} s_ij v_j)
            / (offset + Σ_{j∈blk(i), j≤i} κ_ij + Σ_{j<start(i)} s_ij),
    κ_ij = κ(scale·q_i·k_j) (see module doc), s_ij = φq_i·φk_j, squared when ``square``.

    Block algorithm of PolySketchFormer Fig. 4 / Theorem 3.1 with the diagonal blocks replaced
    by exact scores, all blocks at once (no Python loop over blocks): with N = ⌈T/b⌉ blocks,
    the block states S_n = Σ_{j∈blk n} Ψ(φk_j)ᵀ Ṽ_j ((..., F', E+1), Ṽ = [V 1]; Ψ the
    identity, or the pair features ψ of ``polysketch.ops.pairs`` when ``square``, F' =
    F(⌊F/2⌋+1), never the F² features) are prefix-summed over n < m and read by the queries
    of block m through Ψq. Cost O(T b (D + E) + T F' E); memory O(N F' E + T b). Decoding:
    ``polysketch.ops.mixed_step``.

    Args:
        q, k: (..., T, D) queries and keys for the local exact scores.
        v: (..., T, E) values.
        phi_q, phi_k: (..., T, F) query / key features for the global scores.
        chunk_size: b, the block length (any T is accepted; the last block may be partial).
        local: ``"polynomial"``, ``"relu"`` or ``"none"`` (module doc).
        degree: p of the local kernel (unused by ``"none"``).
        square: the global score is (φq·φk)² (self-tensoring, §2.1), never materialising F².
        denominator_offset: added to the normaliser (any finite real, as ``linear_attention``).
        scale: multiplies q·k inside κ (default 1).
        eps: the denominator guard of ``polysketch.ops.naive``: the normaliser ``den`` is
            replaced by sign(den)·max(|den|, eps); ``eps=0`` disables it.

    Returns:
        (..., T, E), dtype of ``q``. ``local="polynomial"`` (the psf_mixed preset) and
        ``"none"`` (without the in-block scores) run the
        recomputing block function of ``polysketch.ops.blocks`` (Ψ pair features when
        ``square``; all blocks at once on accelerators, groups on CPU) under its precision
        policy (half GEMM operands on accelerators; scores, states and normaliser in fp32);
        ``"relu"`` runs the all-blocks code below in fp32.
    """
    chunk_size, local, degree, offset, eps, scale = _validate(
        q, k, v, phi_q, phi_k, chunk_size, local, degree, square, denominator_offset, eps, scale
    )
    out_dtype = q.dtype
    if local in ("polynomial", "none"):  # the recomputing block function (ops.blocks)
        od = operand_dtype(q.dtype, q.device)
        q, k, v, phi_q, phi_k = (t.to(od) for t in (q, k, v, phi_q, phi_k))
        local_inputs = {}
        if local == "polynomial":
            local_inputs = dict(local_q=q * scale if scale != 1.0 else q, local_k=k,
                                local_power=degree)  # fmt: skip
        num, _ = blocks_lt_multiply(
            phi_q, phi_k, _with_ones(v), square=square, chunk_size=chunk_size,
            group_bytes=group_bytes_for(q.device), in_block=local == "polynomial",
            return_state=False, **local_inputs,
        )  # fmt: skip
        out = num[..., :-1] / stabilize_denominator(num[..., -1:] + offset, eps)
        return out.to(out_dtype)
    dt = compute_dtype(q.dtype)
    q, k, v, phi_q, phi_k = (t.to(dt) for t in (q, k, v, phi_q, phi_k))
    T = q.shape[-2]
    b = min(chunk_size, T)  # one block when chunk_size >= T (same result, less padding)
    n_blocks = -(-T // b)
    pad = n_blocks * b - T
    vt = _with_ones(v)

    def blocks(x: torch.Tensor) -> torch.Tensor:  # (..., T, X) -> (..., N, b, X)
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        return x.unflatten(-2, (n_blocks, b))

    qb, kb, vb, fq, fk = (blocks(t) for t in (q, k, vt, phi_q, phi_k))

    # Local part: exact κ on the diagonal blocks, lt_Δ(κ(Q_n K_nᵀ)) Ṽ_n.
    z = (qb @ kb.transpose(-1, -2)) * scale if scale != 1.0 else qb @ kb.transpose(-1, -2)
    causal = lower_triangle(b, q.device)
    local_scores = torch.where(causal, _local_kernel(z, local, degree), 0.0)
    num = local_scores @ vb  # (..., N, b, E+1)

    # Global part: exclusive prefix sum over blocks of the states φk_nᵀ Ṽ_n (Fig. 4); block n
    # reads the sum of the states of blocks 0..n-1 (the last block's state is never needed).
    if n_blocks > 1:
        pairs = PairFeatures(fq.shape[-1], fq) if square else None
        fk_prev, vb_prev = fk[..., :-1, :, :], vb[..., :-1, :, :]
        if square:
            fk_prev = pairs.features(fk_prev)
        prefix = (fk_prev.transpose(-1, -2) @ vb_prev).cumsum(-3)  # (..., N-1, F', E+1)
        fq_next = pairs.queries(fq[..., 1:, :, :]) if square else fq[..., 1:, :, :]
        num_global = fq_next @ prefix  # (..., N-1, b, E+1)
        num = torch.cat([num[..., :1, :, :], num[..., 1:, :, :] + num_global], dim=-3)

    num = num.flatten(-3, -2)[..., :T, :]
    out = num[..., :-1] / stabilize_denominator(num[..., -1:] + offset, eps)
    return out.to(out_dtype)


# ----- naive reference -----------------------------------------------------------------------
def naive_mixed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    *,
    chunk_size: int = 256,
    local: str = "polynomial",
    degree: int = 4,
    square: bool = False,
    denominator_offset: float = 0.0,
    scale: float | None = None,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """Reference for ``mixed_attention`` materialising the T×T score matrix, O(T²) time/memory.

    A_ij = κ(scale·q_i·k_j) if blk(j) = blk(i) and j ≤ i; s_ij (squared when ``square``) if
    blk(j) < blk(i); 0 otherwise. out = (A V) / stab(offset + A 1). Same arguments and shapes
    as ``mixed_attention``.
    """
    chunk_size, local, degree, offset, eps, scale = _validate(
        q, k, v, phi_q, phi_k, chunk_size, local, degree, square, denominator_offset, eps, scale
    )
    out_dtype = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v, phi_q, phi_k = (t.to(dt) for t in (q, k, v, phi_q, phi_k))
    T = q.shape[-2]
    exact = _local_kernel(scale * (q @ k.transpose(-1, -2)), local, degree)
    feat = phi_q @ phi_k.transpose(-1, -2)
    if square:
        feat = feat * feat
    pos = torch.arange(T, device=q.device)
    blk = pos // chunk_size
    same_block = (blk[:, None] == blk[None, :]) & (pos[None, :] <= pos[:, None])
    earlier_block = blk[None, :] < blk[:, None]
    scores = torch.where(same_block, exact, torch.where(earlier_block, feat, 0.0))
    out = (scores @ v) / stabilize_denominator(scores.sum(-1, keepdim=True) + offset, eps)
    return out.to(out_dtype)
