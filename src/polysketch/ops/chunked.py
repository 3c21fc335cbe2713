"""Block lower-triangular multiplication (PolySketchFormer §3, Theorem 3.1, Figure 4).

These are the tensor cores of ``linear_attention``: they take features and (augmented) values
already validated, cast and masked, and return ``(out, state)``. They are also the stable
internals that ``polysketch.ops.mixed`` and the benchmark build on.

Notation: A = φq (..., T, F), B = φk (..., T, F), C = values (..., T, E) (in
``linear_attention`` C is [V 1], PolySketchFormer §4, so the normalizer comes out of the same
pass as the last column). lt(M) keeps the lower triangle including the diagonal.

Plain scores (``square=False``), s_ij = A_i·B_j, the state is S = Σ_j B_jᵀ C_j: (..., F, E).
Squared scores (``square=True``), s_ij = (A_i·B_j)² = (A_i⊗A_i)·(B_j⊗B_j), the state is
S = Σ_j B_j⊗B_j⊗C_j: (..., F, F, E) and a query reads it as Σ_ab A_ia A_ib S_abe
(google-research polysketchformer ``tensor_lt_multiply``).

Two ways to compute the square state, chosen by size: when F <= E the self-tensored features
A⊗A, B⊗B (F² per token) are no larger than the F·E intermediate of a one-factor-at-a-time
contraction, so ``chunked_lt_multiply`` builds them and uses two plain matmuls with inner
dimension F² (fast) — from T >= ``SYMMETRIC_MIN_LENGTH`` on, the F(⌊F/2⌋+1) cyclic pair
products ψ instead of the F² products (x⊗x is symmetric: about half the work, exact, see
``_PairFeatures``); when F > E it contracts one factor at a time (``square_state``,
``square_apply``), so the largest temporary per token is F·E (not F²). Either way the causal
product scans groups of blocks carrying the running state, so temporaries stay within a byte
budget (``GROUP_BYTES``) instead of growing with T.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as nnf

from .._checks import check_positive_int

__all__ = [
    "GROUP_BYTES",
    "ACCELERATOR_GROUP_BYTES",
    "SYMMETRIC_MIN_LENGTH",
    "square_state",
    "square_apply",
    "apply_state",
    "noncausal_multiply",
    "chunked_lt_multiply",
    "chunked_lt_multiply_with_sums",
    "key_sums",
]

GROUP_BYTES = 4 * 2**20
"""Default budget (bytes) of the per-group temporaries of ``chunked_lt_multiply``'s scan on
CPU. Measured on a 2-core EPYC (B·H = 1 and 4, b = 256): 1-8 MiB all within noise, 16-64 MiB
up to 1.6x slower (plain F = 256); the old all-blocks-at-once version was 1.3-5x slower."""

SYMMETRIC_MIN_LENGTH = 64
"""From this T on, the square path uses the F(⌊F/2⌋+1) pair features ψ (about half the
state work); shorter calls (decoding steps) skip the index conversions of the state."""

ACCELERATOR_GROUP_BYTES = 256 * 2**20
"""Default budget on other devices (fewer, larger batched kernels; not tuned)."""


def self_outer(x: torch.Tensor) -> torch.Tensor:
    """x⊗x flattened: (..., T, F) -> (..., T, F²), so (A_i⊗A_i)·(B_j⊗B_j) = (A_i·B_j)²."""
    return (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2)


class _PairFeatures:
    """ψ(x) of the F(⌊F/2⌋+1) products x_a x_(a+d mod F), a = 0..F-1, d = 0..⌊F/2⌋.

    Grouping (x·y)² = Σ_ab x_a x_b y_a y_b by the cyclic offset d = b - a mod F (offsets d and
    F - d give the same sum): (x·y)² = Σ_(a,d) ω_d ψ(x)_(a,d) ψ(y)_(a,d) with ω_d = 2 for
    0 < d < F/2, else 1 (d = 0, and d = F/2 for even F), exactly (ω is a power of two). About
    half the length of x⊗x, built from a strided view (no gather) and laid out (a, d) so the
    product is contiguous (no copy when flattened). A state S (F, F, E) is read only through
    its symmetric part, Σ_fg A_f A_g S_fge = Σ_(a,d) ω_d ψ(A)_(a,d) Ŝ_(a,d) with
    Ŝ_(a,d) = (S_(a,a+d) + S_(a+d,a)) / 2; for the keys' symmetric Σ B⊗B⊗C,
    Ŝ_(a,d) = S_(a,a+d) and ``expand`` maps it back exactly.
    """

    def __init__(self, f: int, like: torch.Tensor):
        kw = {"device": like.device}
        self.f, self.half = f, f // 2
        width = self.half + 1
        a = torch.arange(f, **kw).repeat_interleave(width)
        d = torch.arange(width, **kw).repeat(f)
        g = (a + d) % f
        single = (d == 0) | (2 * d == f)
        self.omega = torch.where(single, 1.0, torch.full(d.shape, 2.0, dtype=like.dtype, **kw))
        self.flat, self.flat_t = a * f + g, g * f + a  # (a, a+d) and (a+d, a) in F²
        rows = torch.arange(f, **kw).repeat_interleave(f)
        cols = torch.arange(f, **kw).repeat(f)
        fwd, back = (cols - rows) % f, (rows - cols) % f
        self.inverse = torch.where(fwd <= self.half, rows * width + fwd, cols * width + back)

    @property
    def dim(self) -> int:
        return self.omega.numel()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """ψ(x): (..., T, F) -> (..., T, F'), F' = F(⌊F/2⌋+1)."""
        ext = torch.cat([x, x[..., : self.half]], dim=-1)  # x_(a+d mod F) = ext_(a+d)
        windows = ext.unfold(-1, self.half + 1, 1)  # (..., T, F, ⌊F/2⌋+1), a view
        return (x.unsqueeze(-1) * windows).flatten(-2)

    def backward(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The vector-Jacobian product of ``features`` at x: grad (..., T, F') -> (..., T, F).

        ψ_(a,d) = x_a ext_(a+d) with ext = [x, x_(0..⌊F/2⌋-1)], so dx_a gets Σ_d g_(a,d)
        ext_(a+d) (the same windows as ``features``) and d ext_i = Σ_(a+d=i) g_(a,d) x_a (the
        transpose of the window view: ``unfold_backward``), whose tail folds back onto
        x_(0..⌊F/2⌋-1). No autograd inside a backward, no gather: ``torch.compile`` traces it.
        """
        width = self.half + 1
        g = grad.unflatten(-1, (self.f, width))  # (..., T, F, W)
        ext = torch.cat([x, x[..., : self.half]], dim=-1)
        first = (g * ext.unfold(-1, width, 1)).sum(-1)
        dext = torch.ops.aten.unfold_backward(
            g * x.unsqueeze(-1), list(ext.shape), ext.dim() - 1, width, 1
        )
        second = dext[..., : self.f] + nnf.pad(dext[..., self.f :], (0, self.f - self.half))
        return first + second

    def compress(self, s: torch.Tensor) -> torch.Tensor:
        """Ŝ from a flattened state (..., F², ·) -> (..., F', ·)."""
        return (s[..., self.flat, :] + s[..., self.flat_t, :]) / 2

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """The symmetric flattened state (..., F², ·) whose Ŝ is s (..., F', ·)."""
        return s[..., self.inverse, :]


def square_state(b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """S_fge = Σ_t B_tf B_tg C_te for B (..., T, F), C (..., T, E) -> (..., F, F, E)."""
    f, e = b.shape[-1], c.shape[-1]
    bc = (b.unsqueeze(-1) * c.unsqueeze(-2)).flatten(-2)  # (..., T, F·E), never F²
    return (b.transpose(-1, -2) @ bc).unflatten(-1, (f, e))


def square_apply(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """out_te = Σ_fg A_tf A_tg S_fge for A (..., T, F), S (..., F, F, E) -> (..., T, E)."""
    f, e = s.shape[-2], s.shape[-1]
    y = (a @ s.flatten(-2)).unflatten(-1, (f, e))  # (..., T, F, E): Σ_f A_tf S_fge
    return torch.einsum("...tg,...tge->...te", a, y)


def apply_state(a: torch.Tensor, s: torch.Tensor, *, square: bool) -> torch.Tensor:
    """A S (plain, S: (..., F, E)) or Σ_fg A_f A_g S_fge (square, S: (..., F, F, E))."""
    return square_apply(a, s) if square else a @ s


def noncausal_multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    square: bool = False,
    initial: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal (A Bᵀ)^{∘q} C by associativity: A (Bᵀ C), q = 2 if ``square``.

    A (..., Tq, F), B (..., Tk, F), C (..., Tk, E); ``initial`` (the state of earlier keys,
    (..., F[, F], E)) is added to S. Returns out (..., Tq, E) and S (..., F[, F], E).
    O((Tq + Tk)·F·E) time (F²·E when square), no Tq×Tk matrix.
    """
    s = square_state(b, c) if square else b.transpose(-1, -2) @ c
    if initial is not None:
        s = s + initial
    return apply_state(a, s, square=square), s


def _add_states(s: torch.Tensor, kt: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """S + Kᵀ C fused: S (..., F', E), Kᵀ (..., F', blk), C (..., blk, E) -> (..., F', E).

    One ``baddbmm``; for blk = 1 (a decoding step) the outer product ``addcmul``, 2x faster.
    """
    fs, e, blk = s.shape[-2], s.shape[-1], kt.shape[-1]
    if blk == 1:
        return torch.addcmul(s, kt, c)
    kt = kt.reshape(-1, fs, blk)
    return torch.baddbmm(s.reshape(-1, fs, e), kt, c.reshape(-1, blk, e)).view(s.shape)


def _block_elements(blk: int, f: int, e: int, fs: int, *, square: bool, expand: bool) -> int:
    """Elements of the temporaries one block adds to a group (per leading slice); ``fs`` is
    the state features per token F' (F, F², or the F(⌊F/2⌋+1) pair products)."""
    per = 2 * blk * blk + blk * e + 3 * fs * e  # scores, out, states + prefix
    if expand:
        per += 2 * blk * fs  # Φ(A), Φ(B)
    elif square:
        per += 2 * blk * f * e  # B⊗C and Σ_f A_f S_f·
    return per


def chunked_lt_multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    chunk_size: int = 256,
    square: bool = False,
    initial: torch.Tensor | None = None,
    group_bytes: int | None = None,
    final_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal lt((A Bᵀ)^{∘q}) C by blocks of ``chunk_size`` rows (Theorem 3.1, Figure 4).

    With blocks A_n, B_n, C_n of b rows (T padded with zero rows up to a multiple of b;
    zero keys add nothing, padded query rows are sliced off):

        out_n = lt((A_n B_nᵀ)^{∘q}) C_n  +  Φ(A_n) P_n,     P_n = initial + Σ_{m<n} S_m,

    with Φ(A) = A, S_m = B_mᵀ C_m (plain) or Φ(A) = A⊗A, S_m = Σ_{t∈m} B_t⊗B_t⊗C_t (square,
    kept flattened as (F², E)). The blocks are scanned in groups of G consecutive blocks,
    carrying the running state P (the sum over all EARLIER groups only): inside a group, the
    local products, the states S_m and the reads Φ(A_n) P_n are batched matmuls over the G
    blocks, and the exclusive prefix is P + cumsum(S_g0..S_{g0+G-2}) shifted by one block
    (never a cumsum minus S, so a row never sees a later token, even through rounding). G is
    the largest count whose temporaries fit ``group_bytes`` (default ``GROUP_BYTES`` on CPU,
    ``ACCELERATOR_GROUP_BYTES`` elsewhere; at least 1 block), so memory stays bounded and warm
    in cache whatever T is; a Python loop of ⌈N/G⌉ steps (autograd and ``torch.compile``
    trace through it). The carried state after a group is one fused GEMM P + K_lastᵀ C_last.
    O(T·b·F + T·F·E) time (T·F²·E when square).
    Shapes: A, B (..., T, F), C (..., T, E) with the same leading dims, ``initial``
    (..., F[, F], E) -> out (..., T, E) and the final state initial + Σ_all S_m, or ``None``
    with ``final_state=False`` (the last block's state is then never computed).
    """
    out, _, state, _ = _scan(
        a, b, c, chunk_size=chunk_size, square=square, initial=initial, initial_sums=None,
        sums=False, final_state=final_state, group_bytes=group_bytes,
    )  # fmt: skip
    return out, state


def chunked_lt_multiply_with_sums(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    chunk_size: int = 256,
    square: bool = False,
    initial: torch.Tensor | None = None,
    initial_sums: torch.Tensor | None = None,
    group_bytes: int | None = None,
    final_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``chunked_lt_multiply`` of C and of a ones column, without appending the column.

    The normalizer of linear attention is lt((A Bᵀ)^{∘q}) 1 (§4 appends 1 to V). Here it is
    computed beside the product, so every GEMM keeps the width E of C (an E+1 = 65 wide
    operand runs ~15% slower than 64 in CPU BLAS): row sums of the masked local scores plus
    the read of the running key sums of earlier blocks, z = Σ B_t (plain: A_i·z) or
    Z = Σ B_tᵀB_t (square: Σ_t (A_i·B_t)² = A_i Z A_iᵀ, a quadratic form in F, never F²).
    Shapes: A, B (..., T, F), C (..., T, E), ``initial`` (..., F[, F], E), ``initial_sums``
    (..., F[, F]) -> out (..., T, E), row_sums (..., T), state (..., F[, F], E) and key_sums
    (..., F[, F]) (both ``None`` with ``final_state=False``).
    """
    return _scan(
        a, b, c, chunk_size=chunk_size, square=square, initial=initial,
        initial_sums=initial_sums, sums=True, final_state=final_state, group_bytes=group_bytes,
    )  # fmt: skip


def key_sums(b: torch.Tensor, square: bool) -> torch.Tensor:
    """Σ_t B_t (..., F), or Σ_t B_tᵀB_t (..., F, F) when ``square``; B (..., blk, F)."""
    return b.transpose(-1, -2) @ b if square else b.sum(-2)


def _read_sums(a: torch.Tensor, z: torch.Tensor, square: bool) -> torch.Tensor:
    """A_i·z (plain, z (..., F)) or A_i Z A_iᵀ (square, Z (..., F, F)) for A (..., blk, F).

    Elementwise products and sums, not a matrix-vector ``bmm`` (several times slower on CPU).
    """
    if square:
        return ((a @ z) * a).sum(-1)
    return (a * z.unsqueeze(-2)).sum(-1)


def _scan(a, b, c, *, chunk_size, square, initial, initial_sums, sums, final_state, group_bytes):
    """The group scan behind both public functions; returns (out, row_sums, state, key_sums)."""
    if group_bytes is None:
        group_bytes = GROUP_BYTES if a.device.type == "cpu" else ACCELERATOR_GROUP_BYTES
    group_bytes = check_positive_int(group_bytes, "group_bytes")
    t, f, e = a.shape[-2], a.shape[-1], c.shape[-1]
    expand = square and f <= e  # F² per token <= F·E: build A⊗A, B⊗B (module docstring)
    mixed = square and not expand  # one factor at a time
    blk = max(1, min(chunk_size, t))
    n = -(-t // blk)
    pad = n * blk - t
    if pad:
        a, b, c = (nnf.pad(x, (0, 0, 0, pad)) for x in (a, b, c))
    a, b, c = (x.unflatten(-2, (n, blk)) for x in (a, b, c))  # (..., n, blk, ·)
    lead = a.shape[:-3]
    fs = f * f if square else f
    sym = _PairFeatures(f, a) if expand and t >= SYMMETRIC_MIN_LENGTH and f > 2 else None
    if sym is not None:
        fs = sym.dim

    per_block = _block_elements(blk, f, e, fs, square=square, expand=expand)
    per_block *= math.prod(lead) * a.element_size()
    group = max(1, min(n, group_bytes // max(1, per_block)))

    zero_state = initial is None and initial_sums is None
    state = a.new_zeros(*lead, fs, e) if initial is None else initial
    if square and initial is not None:
        state = state.flatten(-3, -2)  # (..., F², E)
    z = None
    zshape = (f, f) if square else (f,)  # running key sums ΣBᵀB or ΣB
    zblocks = -1 - len(zshape)  # the block dim of per-block key sums (..., G, F[, F])
    if sums:
        z = initial_sums if initial_sums is not None else a.new_zeros(*lead, *zshape)
    if sym is not None:  # key features ψ; queries read ψ(A) (ω ⊙ P)
        if initial is not None:
            state = sym.compress(state)
        feats = sym.features
        omega = sym.omega.unsqueeze(-1)
    elif expand:
        feats = self_outer
    else:
        feats = None

    def features(x: torch.Tensor) -> torch.Tensor:  # Φ(x) in state form (..., blk, F')
        return x if feats is None else feats(x)

    tril = torch.ones(blk, blk, dtype=torch.bool, device=a.device).tril()
    zero = a.new_zeros(())
    outs, row_sums = [], []
    groups = list(zip(*(x.split(group, dim=-3) for x in (a, b, c)), strict=True))
    # split (not slicing in the loop): its backward is one concatenation, not a full-size
    # zero tensor per group
    for i, (ag, bg, cg) in enumerate(groups):
        # Within blocks: exact masked products lt((A_n B_nᵀ)^{∘q}) C_n.
        scores = ag @ bg.transpose(-1, -2)  # (..., G, blk, blk)
        if square:
            scores = scores * scores
        masked = torch.where(tril, scores, zero)
        out = masked @ cg
        rs = masked.sum(-1) if sums else None  # (..., G, blk)
        # Across blocks: exclusive prefix P (..., G, F', E) = state + Σ of the EARLIER blocks'
        # states of the group (the last block's state only enters the carried state); the
        # key sums likewise.
        kf = None  # key features (..., G, blk, F'), built where they are used (cache locality)
        prefix = state.unsqueeze(-3)
        zprefix = z.unsqueeze(zblocks) if sums else None  # (..., 1, F[, F])
        if bg.shape[-3] > 1:
            if mixed:
                states = square_state(bg[..., :-1, :, :], cg[..., :-1, :, :]).flatten(-3, -2)
            else:
                kf = features(bg)
                states = kf[..., :-1, :, :].transpose(-1, -2) @ cg[..., :-1, :, :]
            prefix = torch.cat([prefix, prefix + states.cumsum(-3)], dim=-3)
            if sums:
                zs = key_sums(bg[..., :-1, :, :], square)  # (..., G-1, F[, F])
                zprefix = torch.cat([zprefix, zprefix + zs.cumsum(zblocks)], dim=zblocks)
        if zero_state and bg.shape[-3] == 1:
            pass  # the first block without an initial state reads all-zero states
        else:
            if mixed:
                out = out + square_apply(ag, prefix.unflatten(-2, (f, f)))
            else:
                qf = features(ag)  # (..., G, blk, F')
                out = out + qf @ (prefix if sym is None else prefix * omega)
            if sums:
                rs = rs + _read_sums(ag, zprefix, square)
        outs.append(out)
        if sums:
            row_sums.append(rs)
        zero_state = False
        if i + 1 == len(groups) and not final_state:
            state = z = None
            break
        last = prefix[..., -1, :, :]
        if mixed:
            state = last + square_state(bg[..., -1, :, :], cg[..., -1, :, :]).flatten(-3, -2)
        else:  # one fused GEMM: last + K_lastᵀ C_last
            k_last = kf[..., -1, :, :] if kf is not None else features(bg[..., -1, :, :])
            state = _add_states(last, k_last.transpose(-1, -2), cg[..., -1, :, :])
        if sums:
            z = zprefix.select(zblocks, -1) + key_sums(bg[..., -1, :, :], square)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-3)
    out = out.flatten(-3, -2)[..., :t, :]
    rs = None
    if sums:
        rs = row_sums[0] if len(row_sums) == 1 else torch.cat(row_sums, dim=-2)
        rs = rs.flatten(-2)[..., :t]
    if state is None:
        return out, rs, None, None
    if sym is not None:
        state = sym.expand(state)
        if initial is not None:  # Ŝ dropped the antisymmetric part of ``initial``; restore it
            state = state + (initial - initial.transpose(-2, -3)).flatten(-3, -2) / 2
    if square:
        state = state.unflatten(-2, (f, f))
    return out, rs, state, z
