"""Block lower-triangular linear attention with a backward that recomputes (Theorem 3.1).

This is the backend ``"chunked_blocks"`` of ``linear_attention`` (the accelerator layout:
every block at once, no per-block Python loop, no host sync, ``torch.compile`` traces it), the
training path of ``"chunked_scan"`` on CPU (the same math over groups of blocks under a byte
budget) and the core of ``mixed_attention``. All are one ``torch.autograd.Function`` whose
backward recomputes the per-block scores and features instead of storing them. The group
budget is the dispatcher's (``polysketch.ops.dispatch``).

Notation (PolySketchFormer §3, Figure 4): blocks n of b rows, A = φq, B = φk (..., T, F),
C̃ = [C 1] (..., T, E+1) (the ones column gives the normalizer from the same GEMMs, §4), and
the local score inputs Â, B̂ (= A, B for linear attention; the raw q, k for mixed attention).

    out_n = lt((Â_n B̂_nᵀ)^{∘p}) C̃_n + Ψq(A_n) P_n,     P_n = P_0 + Σ_{m<n} Ψ(B_m)ᵀ C̃_m

(without the first term when ``in_block=False``: each row reads the earlier blocks only)
with p = 2 and the pair features Ψ = ψ, Ψq = ψ·ω of ``polysketch.ops.pairs`` for squared
scores ((x·y)² = Σ ω ψ(x) ψ(y), about F²/2 per token instead of F²), p = 1 and Ψ = Ψq = id
for plain scores. The exclusive prefix P_n is P_0 plus a cumsum of the earlier states (never a
cumsum minus the own state, so a row never sees a later token, not even through rounding).

Backward, with dÕ = [dout drow] per block (the normalizer's gradient rides in the last column):

    local:   dM = lt(dÕ C̃ᵀ),  dC̃ += Mᵀ dÕ,  dG = p G^{p-1} ∘ dM (G = Â B̂ᵀ),  dÂ = dG B̂,  dB̂ = dGᵀ Â
    read:    dΨq(A_n) = dÕ_n P_nᵀ,  dP_n = Ψq(A_n)ᵀ dÕ_n
    states:  dS_m = R + Σ_{n>m} dP_n (R: the final state's gradient),  dΨ(B_m) = C̃_m dS_mᵀ,
             dC̃_m += Ψ(B_m) dS_m,  dP_0 = R + Σ_n dP_n,

then back through Ψ (``PairFeatures.backward``). Stored for the backward: the inputs and the
per-block prefixes P_n (n·F'·(E+1)); the b×b scores and the T×F' features are recomputed.

The state P (..., F', E+1) is [N Z] of ``polysketch.ops.state``'s layout side by side, so
states go in and out of ``lt_multiply`` without conversion.

Precision: operands of every GEMM are in the operand dtype (``dispatch.operand_dtype``: half
on accelerators for bf16/fp16 inputs, so tensor cores run with fp32 accumulation); scores are
raised to p, masked and summed, states and prefixes accumulated, in the accumulation dtype
(fp32 for half inputs, else the input dtype). Outputs are in the accumulation dtype.

fp16 operands are multiplied in fp32 (``gemm_dtype``): every GEMM here has an operand or a
result of degree 2p in the features or summed over a block or a prefix, and fp16 stops at
65504. With LayerNorm'd q, k (|q|² = D = 64) and a degree-2 sketch, φ·φ ≈ (q·k)² is up to
4096, the squared scores (q·k)⁴ of one row reach 10⁶, a row's normalizer Σ_j (q·k_j)⁴ ≈ 10¹⁰
at T = 2048, the pair features ψ = φ_a φ_b ~ 10⁴ and their block sums Σ_t ψ(k_t) v_t ~ 10⁶:
an fp16 GEMM output or operand overflows to inf and the output is NaN. bf16 has fp32's range
(its products stay half: tensor cores, fp32 accumulation inside the GEMM). fp16 inputs are
kept in fp16 (saved for the backward as given) and cast per group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as nnf

from .._checks import compute_dtype
from ._constants import lower_triangle
from .pairs import PairFeatures, state_dim

__all__ = ["blocks_lt_multiply", "gemm_dtype", "lt_multiply", "state_dim", "group_blocks_for"]


class _StateSpace:
    """Ψ (keys) and Ψq (queries) of the block states: identity, or pair features ψ, ψ·ω."""

    def __init__(self, f: int, square: bool, like: torch.Tensor):
        self.pairs = PairFeatures(f, like) if square else None
        self.dim = self.pairs.dim if square else f

    def keys(self, b: torch.Tensor) -> torch.Tensor:
        return b if self.pairs is None else self.pairs.features(b)

    def queries(self, a: torch.Tensor) -> torch.Tensor:
        return a if self.pairs is None else self.pairs.features(a) * self.pairs.omega

    def keys_backward(self, b: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return grad if self.pairs is None else self.pairs.backward(b, grad)

    def queries_backward(self, a: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if self.pairs is None:
            return grad
        return self.pairs.backward(a, grad * self.pairs.omega.to(grad.dtype))


def group_blocks_for(
    budget_bytes: int | None, *, blocks: int, blk: int, f: int, e: int, d: int, square: bool,
    lead: int, itemsize: int,
) -> int:  # fmt: skip
    """Blocks per group so the per-group temporaries fit ``budget_bytes`` (None: all blocks).

    Per block: scores and their gradient (3·b²), features and their gradients (4·b·F'),
    states, prefixes and their gradients (4·F'·(E+1)), local inputs (2·b·D), all × ``lead``.
    """
    if budget_bytes is None:
        return blocks
    fs = state_dim(f, square)
    per = 3 * blk * blk + 4 * blk * fs + 4 * fs * (e + 1) + 2 * blk * d + 2 * blk * (e + 1)
    return max(1, min(blocks, budget_bytes // max(1, per * lead * itemsize)))


def gemm_dtype(operand: torch.dtype, accumulate: torch.dtype) -> torch.dtype:
    """The dtype the GEMMs of the block function multiply in: the operand dtype, except fp16,
    whose range (max 65504) cannot hold the degree-2p scores, pair features and block sums
    (module docstring): those multiply in the accumulation dtype (fp32)."""
    return accumulate if operand == torch.float16 else operand


def _to_blocks(x: torch.Tensor, n: int, blk: int) -> torch.Tensor:
    """(..., T, X) -> (..., n, blk, X), zero rows appended up to n·blk."""
    pad = n * blk - x.shape[-2]
    if pad:
        x = nnf.pad(x, (0, 0, 0, pad))
    return x.unflatten(-2, (n, blk))


def _mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x @ y for (..., M, K) and (..., K, N) of the same leading dims as one ``bmm`` (the same
    kernel and result as ``matmul``, whose broadcasting path dispatches two expands and three
    views more: host time per call on a GPU)."""
    lead = x.shape[:-2]
    if y.shape[:-2] != lead or len(lead) < 1:
        return x @ y
    out = torch.bmm(x.reshape(-1, *x.shape[-2:]), y.reshape(-1, *y.shape[-2:]))
    return out.view(*lead, *out.shape[-2:])


def _blocks_of(x: torch.Tensor, sl: slice, n: int) -> torch.Tensor:
    """The blocks ``sl`` of x (..., n, b, X): x itself when ``sl`` spans all n (the accelerator
    layout's one group: no slice dispatched, a host cost per op on a GPU)."""
    return x if sl.start == 0 and sl.stop == n else x[..., sl, :, :]


def _scores(la: torch.Tensor, lb: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """G = Â B̂ᵀ per block (..., G, b, b) in the accumulation dtype (operands as given)."""
    return _mm(la, lb.transpose(-1, -2)).to(acc)


def _exclusive_prefix(p0: torch.Tensor | None, s: torch.Tensor) -> torch.Tensor:
    """P_n = P_0 + Σ_{m<n} S_m for S (..., G, F', X), P_0 (..., F', X) or None (zero)
    -> (..., G, F', X)."""
    if p0 is None:  # 0 + x = x exactly: the same values as with a zero P_0, fewer launches
        if s.shape[-3] == 1:
            return torch.zeros_like(s)
        return nnf.pad(s[..., :-1, :, :].cumsum(-3), (0, 0, 0, 0, 1, 0))
    first = p0.unsqueeze(-3)
    if s.shape[-3] == 1:
        return first
    return torch.cat([first, first + s[..., :-1, :, :].cumsum(-3)], dim=-3)


class _BlockAttention(torch.autograd.Function):
    """Forward and recomputing backward of the module docstring (groups of ``group`` blocks)."""

    @staticmethod
    def forward(ctx, a, b, c, p0, la, lb, power, chunk_size, group, square, in_block, acc,
                want_state):  # fmt: skip
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        od = gemm_dtype(a.dtype, acc)
        t, f = a.shape[-2], a.shape[-1]
        blk = max(1, min(chunk_size, t))
        n = -(-t // blk)
        local_inputs = la is not None
        A, B, C = (_to_blocks(x, n, blk) for x in (a, b, c))
        LA, LB = (_to_blocks(x, n, blk) for x in (la, lb)) if local_inputs else (A, B)
        space = _StateSpace(f, square, a if a.dtype == od else a.new_empty((), dtype=od))
        tril = lower_triangle(blk, a.device)
        state, outs, prefixes = p0, [], []  # state None: zero (no initial state)
        for start in range(0, n, group):
            sl = slice(start, min(n, start + group))
            ag, bg, cg, lag, lbg = (_blocks_of(x, sl, n).to(od) for x in (A, B, C, LA, LB))
            s = _mm(space.keys(bg).transpose(-1, -2), cg).to(acc)  # (..., G, F', E+1)
            prefix = _exclusive_prefix(state, s)
            pod = prefix.to(od)
            out = _mm(space.queries(ag), pod).to(acc)
            if in_block:
                g = _scores(lag, lbg, acc)
                m = torch.where(tril, g**power if power != 1 else g, g.new_zeros(()))
                out = _mm(m.to(od), cg).to(acc) + out
            if want_state or sl.stop < n:  # carried to the next group, or returned
                state = prefix[..., -1, :, :] + s[..., -1, :, :]
            outs.append(out)
            prefixes.append(pod)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-3)
        pods = prefixes[0] if len(prefixes) == 1 else torch.cat(prefixes, dim=-3)
        ctx.save_for_backward(a, b, c, la, lb, pods)
        ctx.config = (power, blk, n, group, square, acc, in_block)
        return out.flatten(-3, -2)[..., :t, :], (state if want_state else None)

    @staticmethod
    def backward(ctx, d_out, d_state):
        a, b, c, la, lb, pods = ctx.saved_tensors
        power, blk, n, group, square, acc, in_block = ctx.config
        od, t, f = pods.dtype, a.shape[-2], a.shape[-1]  # the forward's gemm_dtype
        local_inputs = la is not None
        if d_out is None:  # only the final state was used
            d_out = torch.zeros(*a.shape[:-1], c.shape[-1], dtype=acc, device=a.device)
        A, B, C = (_to_blocks(x, n, blk) for x in (a, b, c))
        LA, LB = (_to_blocks(x, n, blk) for x in (la, lb)) if local_inputs else (A, B)
        dO = _to_blocks(d_out, n, blk)
        space = _StateSpace(f, square, a if a.dtype == od else a.new_empty((), dtype=od))
        tril = lower_triangle(blk, a.device)
        # R: the gradient of the state after the blocks processed so far (None: zero)
        r = None if d_state is None else d_state.to(acc)
        grads = {"a": [], "b": [], "c": [], "la": [], "lb": []}
        starts = list(range(0, n, group))
        for start in reversed(starts):
            carry = start > 0 or ctx.needs_input_grad[3]  # R is read again (or returned)
            sl = slice(start, min(n, start + group))
            ag, bg, cg, lag, lbg = (_blocks_of(x, sl, n).to(od) for x in (A, B, C, LA, LB))
            dog = _blocks_of(dO, sl, n).to(acc)
            dod = dog.to(od)
            # local: M = lt(G^p), out = M C̃ (none without in-block scores)
            dc = dla = dlb = None
            if in_block:
                g = _scores(lag, lbg, acc)
                m = torch.where(tril, g**power if power != 1 else g, g.new_zeros(()))
                dm = torch.where(tril, _mm(dod, cg.transpose(-1, -2)).to(acc), g.new_zeros(()))
                dc = _mm(m.to(od).transpose(-1, -2), dod).to(acc)
                dg = dm * (power * g ** (power - 1)) if power != 1 else dm
                dgo = dg.to(od)
                dla = _mm(dgo, lbg).to(acc)
                dlb = _mm(dgo.transpose(-1, -2), lag).to(acc)
            # read of the prefixes: out += Ψq(A) P
            pod = _blocks_of(pods, sl, n)
            qf = space.queries(ag)
            dqf = _mm(dod, pod.transpose(-1, -2)).to(acc)  # (..., G, b, F')
            dp = _mm(qf.transpose(-1, -2), dod).to(acc)  # (..., G, F', E+1)
            # states: dS_m = R + Σ_{n>m in group} dP_n (reverse inclusive sums, shifted)
            if dp.shape[-3] == 1:  # one block (wide maps on CPU): dS = R, no sums to form
                ds = torch.zeros_like(dp) if r is None else r.unsqueeze(-3)
                later = dp
            else:
                later = dp.flip(-3).cumsum(-3).flip(-3)  # Σ_{n>=m}
                ds = nnf.pad(later[..., 1:, :, :], (0, 0, 0, 0, 0, 1))  # Σ_{n>m}
                ds = ds if r is None else ds + r.unsqueeze(-3)
            if carry:
                r = later[..., 0, :, :] if r is None else r + later[..., 0, :, :]
            kf = space.keys(bg)
            dso = ds.to(od)
            dkf = _mm(cg, dso.transpose(-1, -2)).to(acc)  # (..., G, b, F')
            dck = _mm(kf, dso).to(acc)
            dc = dck if dc is None else dc + dck
            da = space.queries_backward(ag.to(acc), dqf)
            db = space.keys_backward(bg.to(acc), dkf)
            if local_inputs:
                grads["la"].append(dla if in_block else torch.zeros_like(lag, dtype=acc))
                grads["lb"].append(dlb if in_block else torch.zeros_like(lbg, dtype=acc))
            elif in_block:
                da, db = da + dla, db + dlb
            for name, value in (("a", da), ("b", db), ("c", dc)):
                grads[name].append(value)

        def merge(parts, like):
            if not parts:
                return None
            x = parts[0] if len(parts) == 1 else torch.cat(parts[::-1], dim=-3)
            return x.flatten(-3, -2)[..., :t, :].to(like.dtype)

        return (
            merge(grads["a"], a),
            merge(grads["b"], b),
            merge(grads["c"], c),
            r if ctx.needs_input_grad[3] else None,
            merge(grads["la"], la) if local_inputs else None,
            merge(grads["lb"], lb) if local_inputs else None,
            None, None, None, None, None, None, None,
        )  # fmt: skip


def blocks_lt_multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    square: bool,
    chunk_size: int = 256,
    initial: torch.Tensor | None = None,
    local_q: torch.Tensor | None = None,
    local_k: torch.Tensor | None = None,
    local_power: int | None = None,
    group_bytes: int | None = None,
    in_block: bool = True,
    return_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal lt(s) C̃ with s_ij = local score inside blocks, Ψq(a_i)·Ψ(b_j) across blocks.

    Shapes: a, b (..., T, F), c (..., T, X) (X = E+1 with the ones column in
    ``linear_attention``), ``initial`` P_0 (..., F', X) in the accumulation dtype (F' =
    ``state_dim(F, square)``: pair-feature space when ``square``), ``local_q``/``local_k``
    (..., T, D) the inputs of the exact local scores (q·k)^``local_power`` (default: the
    features themselves with power 2 if ``square`` else 1). Operands are used in the dtype
    given (the caller casts them to ``operand_dtype``); ``initial`` sets the accumulation dtype
    (default ``compute_dtype(a.dtype)``). ``group_bytes``: temporaries budget per group of
    blocks (``None``: all blocks at once, the accelerator layout). ``in_block=False`` leaves
    the in-block scores out (s_ij = 0 for j in i's block): each row reads the state of the
    earlier blocks only (mixed attention's ``local="none"``).

    Returns out (..., T, X) and the final state P_0 + Σ_m Ψ(B_m)ᵀ C̃_m (..., F', X) (None
    with ``return_state=False``: not formed), both in the accumulation dtype; differentiable
    in every tensor argument (recomputing backward).
    """
    if (local_q is None) != (local_k is None):
        raise ValueError("local_q and local_k must be given together")
    t, f, x = a.shape[-2], a.shape[-1], c.shape[-1]
    power = local_power if local_power is not None else (2 if square else 1)
    blk = max(1, min(chunk_size, t))
    n = -(-t // blk)
    lead = a.shape[:-2]
    acc = compute_dtype(a.dtype) if initial is None else initial.dtype  # None: a zero P_0
    numel = 1
    for size in lead:
        numel *= size
    d = f if local_q is None else local_q.shape[-1]
    group = group_blocks_for(
        group_bytes, blocks=n, blk=blk, f=f, e=x - 1, d=d, square=square, lead=numel,
        itemsize=acc.itemsize,
    )  # fmt: skip
    return _BlockAttention.apply(
        a, b, c, initial, local_q, local_k, power, chunk_size, group, square, in_block, acc,
        return_state,
    )  # fmt: skip


def lt_multiply(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    square: bool,
    chunk_size: int,
    initial: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_state: bool = False,
    group_bytes: int | None,
):
    """The backend contract (``polysketch.ops.dispatch``): (num, den, state) by the block function.

    Shapes: a, b (..., T, F), c (..., T, E) in the operand dtype, T >= 1; ``initial``
    (N_0 (..., F', E), Z_0 (..., F')) in the accumulation dtype (it sets it) or ``None`` ->
    num (..., T, E), den (..., T) in the accumulation dtype, and (N, Z) with ``return_state``.
    The normalizer is the ones column of C̃ = [C 1] (§4); N and Z are the columns of P.
    """
    e = c.shape[-1]
    c = torch.cat([c, c.new_ones(c.shape[:-1] + (1,))], dim=-1)
    p0 = None if initial is None else torch.cat([initial[0], initial[1].unsqueeze(-1)], dim=-1)
    out, state = blocks_lt_multiply(
        a, b, c, square=square, chunk_size=chunk_size, initial=p0, group_bytes=group_bytes,
        return_state=return_state,
    )  # fmt: skip
    final = (state[..., :e], state[..., e]) if return_state else None
    return out[..., :e], out[..., e], final
