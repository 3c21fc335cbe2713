"""Backend ``"chunked_scan"``: block lower-triangular multiplication by a scan over groups of
blocks under a byte budget (PolySketchFormer §3, Theorem 3.1, Figure 4), the CPU layout.

Notation: A = φq (..., T, F), B = φk (..., T, F), C = values (..., T, E). lt(M) keeps the lower
triangle including the diagonal. Scores s_ij = A_i·B_j, or (A_i·B_j)² with ``square``, where
(A_i·B_j)² = Ψq(A_i)·Ψ(B_j) with the pair features Ψ = ψ, Ψq = ω ⊙ ψ of ``polysketch.ops.pairs``
(F' = F(⌊F/2⌋+1) per token, about half of F², never A⊗A); Ψ = Ψq = identity (F' = F) for
plain scores. With blocks A_n, B_n, C_n of b rows (T padded with zero rows up to a multiple of
b; zero keys add nothing, padded query rows are sliced off):

    num_n = lt(s(A_n, B_n)) C_n  +  Ψq(A_n) P_n,    P_n = N_0 + Σ_{m<n} Ψ(B_m)ᵀ C_m,
    den_n = lt(s(A_n, B_n)) 1    +  Ψq(A_n) z_n,    z_n = Z_0 + Σ_{m<n} Ψ(B_m)ᵀ 1.

The normalizer comes as row sums of the masked block scores plus the read of the running key
sums, beside the product, so every GEMM keeps the width E of C (an E+1 = 65 wide operand runs
~15% slower than 64 in CPU BLAS). Inside the scan the squared key sums are kept dense,
Z = Σ BᵀB (F, F), and read as the quadratic form rows A Z Aᵀ (a GEMM with inner dimension F,
not an elementwise pass over the T×F' features); they enter and leave in the pair layout
(``pairs.expand`` / ``compress``, exact for the symmetric Z).

The blocks are scanned in groups of G consecutive blocks, carrying the running state (the sum
over all EARLIER groups only): inside a group, the local products, the block states and the
reads are batched matmuls over the G blocks, and the exclusive prefix is P +
cumsum(S_g0..S_{g0+G-2}) shifted by one block (never a cumsum minus S, so a row never sees a
later token, even through rounding). G is the largest count whose temporaries fit
``group_bytes`` (the dispatcher's budget, ``polysketch.ops.dispatch``; at least 1 block), so
memory stays bounded and warm in cache whatever T is; a Python loop of ⌈N/G⌉ steps (autograd and
``torch.compile`` trace through it). The carried state after a group is one fused GEMM P +
Ψ(B_last)ᵀ C_last. O(T·b·F + T·F'·E) time.

The scan has no backward of its own (autograd through it stores every group's temporaries):
the dispatcher sends calls that need gradients to the recomputing ``ops.blocks`` function over
the same cache-sized groups.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as nnf

from .._checks import check_positive_int
from .pairs import PairFeatures

__all__ = ["lt_multiply", "scan"]


def _add_states(s: torch.Tensor, kt: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """S + Kᵀ C fused: S (..., F', E), Kᵀ (..., F', blk), C (..., blk, E) -> (..., F', E).

    One ``baddbmm``; for blk = 1 the outer product ``addcmul``, 2x faster.
    """
    fs, e, blk = s.shape[-2], s.shape[-1], kt.shape[-1]
    if blk == 1:
        return torch.addcmul(s, kt, c)
    kt = kt.reshape(-1, fs, blk)
    return torch.baddbmm(s.reshape(-1, fs, e), kt, c.reshape(-1, blk, e)).view(s.shape)


def _block_elements(blk: int, f: int, e: int, fs: int, *, square: bool, expand: bool) -> int:
    """Elements of the temporaries one block adds to a group (per leading slice); ``fs`` is
    the state features per token F' (F, or the F(⌊F/2⌋+1) pair products); ``expand``: the
    features Ψ are built explicitly (always, when ``square``)."""
    per = 2 * blk * blk + blk * e + 3 * fs * e  # scores, out, states + prefix
    if expand:
        per += 2 * blk * fs  # Ψ(A), Ψ(B)
    elif square:
        per += 2 * blk * f * e
    return per


def lt_multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    square: bool,
    chunk_size: int,
    initial: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_state: bool = False,
    group_bytes: int,
):
    """The backend contract (``polysketch.ops.dispatch``): (num, den, state) of the scan.

    Shapes: a, b (..., T, F), c (..., T, E), T >= 1; ``initial`` (N_0 (..., F', E),
    Z_0 (..., F')) in the state layout of ``polysketch.ops.state`` or ``None`` (zero) ->
    num = lt(s) C + Ψq(A) N_0 (..., T, E), den = lt(s) 1 + Ψq(A) Z_0 (..., T), and the final
    (N, Z) with ``return_state`` (else ``None``: the last block's state is never computed).
    Everything in the dtype of the operands (the dispatcher casts them).
    """
    n0, z0 = (None, None) if initial is None else initial
    num, den, n, z = scan(
        a, b, c, chunk_size=chunk_size, square=square, initial=n0, initial_sums=z0,
        final_state=return_state, group_bytes=group_bytes,
    )  # fmt: skip
    return num, den, (n, z) if return_state else None


def scan(a, b, c, *, chunk_size, square, initial, initial_sums, final_state, group_bytes):
    """The group scan of the module docstring; returns (num, den, N, Z) (N, Z ``None`` without
    ``final_state``). ``initial`` (..., F', E) and ``initial_sums`` (..., F') may be ``None``."""
    group_bytes = check_positive_int(group_bytes, "group_bytes")
    t, f, e = a.shape[-2], a.shape[-1], c.shape[-1]
    blk = max(1, min(chunk_size, t))
    n = -(-t // blk)
    pad = n * blk - t
    if pad:
        a, b, c = (nnf.pad(x, (0, 0, 0, pad)) for x in (a, b, c))
    a, b, c = (x.unflatten(-2, (n, blk)) for x in (a, b, c))  # (..., n, blk, ·)
    lead = a.shape[:-3]
    pairs = PairFeatures(f, a) if square else None
    fs = pairs.dim if square else f

    per_block = _block_elements(blk, f, e, fs, square=square, expand=square)
    per_block *= math.prod(lead) * a.element_size()
    group = max(1, min(n, group_bytes // max(1, per_block)))

    zero_state = initial is None and initial_sums is None
    state = a.new_zeros(*lead, fs, e) if initial is None else initial
    zshape = (f, f) if square else (f,)  # running key sums Σ BᵀB (dense) or Σ B
    zblocks = -1 - len(zshape)  # the block dim of per-block key sums (..., G, F[, F])
    if initial_sums is None:
        z = a.new_zeros(*lead, *zshape)
    elif square:  # pair layout -> the symmetric dense Σ BᵀB
        z = pairs.expand(initial_sums.unsqueeze(-1)).squeeze(-1).unflatten(-1, zshape)
    else:
        z = initial_sums
    if square:  # keys Ψ = ψ; queries read ψ(A) (ω ⊙ P): ω on the smaller operand
        features = pairs.features
        omega = pairs.omega.to(a.dtype).unsqueeze(-1)
    else:

        def features(x: torch.Tensor) -> torch.Tensor:
            return x

        omega = None

    tril = torch.ones(blk, blk, dtype=torch.bool, device=a.device).tril()
    zero = a.new_zeros(())
    outs, row_sums = [], []
    groups = list(zip(*(x.split(group, dim=-3) for x in (a, b, c)), strict=True))
    # split (not slicing in the loop): its backward is one concatenation, not a full-size
    # zero tensor per group
    for i, (ag, bg, cg) in enumerate(groups):
        # Within blocks: exact masked products lt(s(A_n, B_n)) C_n and their row sums.
        scores = ag @ bg.transpose(-1, -2)  # (..., G, blk, blk)
        if square:
            scores = scores * scores
        masked = torch.where(tril, scores, zero)
        out = masked @ cg
        rs = masked.sum(-1)  # (..., G, blk)
        # Across blocks: exclusive prefix P (..., G, F', E) = state + Σ of the EARLIER blocks'
        # states of the group (the last block's state only enters the carried state); the
        # key sums likewise.
        kf = None  # key features (..., G, blk, F'), built where they are used (cache locality)
        prefix = state.unsqueeze(-3)
        zprefix = z.unsqueeze(zblocks)  # (..., 1, F[, F])
        if bg.shape[-3] > 1:
            kf = features(bg)
            states = kf[..., :-1, :, :].transpose(-1, -2) @ cg[..., :-1, :, :]
            prefix = torch.cat([prefix, prefix + states.cumsum(-3)], dim=-3)
            zs = _key_sums(bg[..., :-1, :, :], square)  # (..., G-1, F[, F])
            zprefix = torch.cat([zprefix, zprefix + zs.cumsum(zblocks)], dim=zblocks)
        if not (zero_state and bg.shape[-3] == 1):  # the first block reads all-zero states
            qf = features(ag)  # (..., G, blk, F')
            out = out + qf @ (prefix if omega is None else prefix * omega)
            rs = rs + _read_sums(ag, zprefix, square)
        outs.append(out)
        row_sums.append(rs)
        zero_state = False
        if i + 1 == len(groups) and not final_state:
            state = z = None
            break
        k_last = kf[..., -1, :, :] if kf is not None else features(bg[..., -1, :, :])
        state = _add_states(prefix[..., -1, :, :], k_last.transpose(-1, -2), cg[..., -1, :, :])
        z = zprefix.select(zblocks, -1) + _key_sums(bg[..., -1, :, :], square)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-3)
    out = out.flatten(-3, -2)[..., :t, :]
    rs = row_sums[0] if len(row_sums) == 1 else torch.cat(row_sums, dim=-2)
    if square and z is not None:  # dense Σ BᵀB -> the pair layout
        z = pairs.compress(z.flatten(-2).unsqueeze(-1)).squeeze(-1)
    return out, rs.flatten(-2)[..., :t], state, z


def _key_sums(b: torch.Tensor, square: bool) -> torch.Tensor:
    """Σ_t B_t (..., F), or Σ_t B_tᵀB_t (..., F, F) when ``square``; B (..., blk, F)."""
    return b.transpose(-1, -2) @ b if square else b.sum(-2)


def _read_sums(a: torch.Tensor, z: torch.Tensor, square: bool) -> torch.Tensor:
    """A_i·z (plain, z (..., F)) or A_i Z A_iᵀ (square, Z (..., F, F)) for A (..., blk, F).

    Elementwise products and sums, not a matrix-vector ``bmm`` (several times slower on CPU).
    """
    if square:
        return ((a @ z) * a).sum(-1)
    return (a * z.unsqueeze(-2)).sum(-1)
