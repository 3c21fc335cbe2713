"""A surrogate that pulls queries towards keys and pushes them off less: issue 44 item 2.

The library's training-only surrogate λ·(o_lin − sg(o_lin)) (``AttentionCore``'s
``_gradient_surrogate``) is a far-block attention with the kernel w_ij = 1 + cos(q_i, k_j)
and detached values v, 0 in value. With a_ij = w_ij / Σ_l w_il, o_i = Σ_j a_ij v_j and
g_i the loss gradient at the layer's output, its gradient is

    ∂L/∂q_i = Σ_j (c_ij / Σ_l w_il) ∂w_ij/∂q_i,     ∂L/∂k_j = Σ_i (c_ij / Σ_l w_il) ∂w_ij/∂k_j,

    c_ij = λ g_i · (v_j − o_i),     ∂w_ij/∂q_i = (k̂_j − cos_ij q̂_i) / ‖q_i‖,
                                    ∂w_ij/∂k_j = (q̂_i − cos_ij k̂_j) / ‖k_j‖

(x̂ = x/‖x‖; j over the keys of the blocks before i's). A descent step raises w_ij where
c_ij < 0 (v_j would lower the loss: a pull) and lowers it where c_ij > 0 (a push). The grid's
d = 1024 diagnostics show the push turning the query away from the copy's source keys before
the copy is learned (``docs/results/long_context/grid/README.md``). This remedy scales the
pushes by s ∈ [0, 1]: c_ij ← min(c_ij, 0) + s·max(c_ij, 0); s = 1 is the library's gradient
(tested against it in fp64), s = 0 keeps only the pulls. It is no longer the gradient of a
function; like the library's term it is exactly 0 in value, so outputs, evaluations and
checkpoints are those of ``SPEC``. The c_ij of every (query, far key) pair are formed
explicitly: O(T²) time and memory per head, an experiment, not a library path.

The grid spells it ``SPEC@push=S`` (``SPEC`` must have a surrogate, λ > 0). Not on sequence
shards, not with padded keys (refused).
"""

from __future__ import annotations

import contextlib

import torch

from polysketch.nn.core import AttentionCore

from .grid_diagnostics import far_keys
from .surrogate_schedule import split_number

__all__ = ["split_push", "surrogate_push", "pushed_surrogate_grads"]


def split_push(attention: str) -> tuple[str, float | None]:
    """``"SPEC@push=S"`` -> (SPEC, s); any other spec -> (spec, None). ValueError naming the
    attention unless 0 <= s <= 1."""
    return split_number(attention, "push", 0.0, 1.0)


def pushed_surrogate_grads(q, k, v, g, chunk: int, push: float):
    """(∂L/∂q, ∂L/∂k) of the module docstring with the pushes scaled by ``push``; q, k
    (B, H, T, D), v and g (B, H, T, E) (g already holds λ), far keys by blocks of ``chunk``."""
    t = q.shape[-2]
    norm_q, norm_k = q.norm(dim=-1, keepdim=True), k.norm(dim=-1, keepdim=True)
    qn, kn = q / norm_q, k / norm_k
    cos = qn @ kn.transpose(-1, -2)  # (B, H, T, T)
    far = far_keys(t, chunk).to(q.device)
    w = torch.where(far, 1.0 + cos, 0.0)
    den = w.sum(-1, keepdim=True)
    rows = den > 0  # a query with no far key: no term, no gradient
    a = w / torch.where(rows, den, 1.0)
    o = a @ v
    c = g @ v.transpose(-1, -2) - (g * o).sum(-1, keepdim=True)  # g_i · (v_j − o_i)
    c = c.clamp(max=0.0) + push * c.clamp(min=0.0)
    m = torch.where(far & rows, c / torch.where(rows, den, 1.0), 0.0)
    mc = m * cos
    dq = (m @ kn - mc.sum(-1, keepdim=True) * qn) / norm_q
    dk = (m.transpose(-1, -2) @ qn - mc.sum(-2).unsqueeze(-1) * kn) / norm_k
    return dq, dk


class _PushScaled(torch.autograd.Function):
    """0 in value; the backward of ``pushed_surrogate_grads`` for q and k."""

    @staticmethod
    def forward(ctx, q, k, v, chunk, push):
        ctx.save_for_backward(q, k, v)
        ctx.chunk, ctx.push = chunk, push
        return v.new_zeros(v.shape)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        dq, dk = pushed_surrogate_grads(q, k, v, g, ctx.chunk, ctx.push)
        return dq, dk, None, None, None


@contextlib.contextmanager
def surrogate_push(push: float):
    """Within the block every ``AttentionCore``'s surrogate term has its pushes scaled by
    ``push`` (module docstring)."""
    original = AttentionCore._gradient_surrogate

    def pushed(self, q, k, v, keep, shard=None):
        if keep is not None or shard is not None or self.denominator_offset:
            raise ValueError("@push: padded keys, sequence shards and a denominator offset "
                             "are not supported")  # fmt: skip
        return self.gradient_surrogate * _PushScaled.apply(q, k, v.detach(), self.chunk_size,
                                                           push)  # fmt: skip

    AttentionCore._gradient_surrogate = pushed
    try:
        yield push
    finally:
        AttentionCore._gradient_surrogate = original
