"""Training-only auxiliary losses that ride on a tensor's backward, without changing its value.

A module deep in a model (a feature map inside an attention core) may want a regularizer L_aux
added to the training loss, without every caller threading an extra return value up to the
loss. ``add_auxiliary_loss(x, loss)`` returns x unchanged; when the backward pass reaches x,
it also back-propagates ``loss`` with gradient s (the scale in force when x was made), so that
the parameters receive ∇(L + s·L_aux) for whatever loss L was back-propagated through x.
(DeepSeek-MoE's ``AddAuxiliaryLoss`` uses the same device for its expert balance.)

The scale s matches the main loss's own scaling: a training loop that back-propagates
L / n for each of n micro-batches (gradient accumulation) sets ``auxiliary_loss_scale(1 / n)``
around the forward, so the auxiliary loss is averaged over micro-batches as L is. The scale is
read at the forward, where the loss is multiplied by it (so the backward, a recomputed one
included, uses the forward's). It is a module-level float, not a ``ContextVar``:
``torch.compile`` cannot trace ``ContextVar.get`` (a graph break, an error under
``fullgraph=True``), while it reads a global float as a guarded constant or a symbolic one.

The auxiliary gradient flows only if x is on the path of the loss being back-propagated, and
once per backward through x.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["add_auxiliary_loss", "auxiliary_loss_scale"]

_scale = 1.0  # the scale in force (auxiliary_loss_scale sets it for a block)


@contextlib.contextmanager
def auxiliary_loss_scale(scale: float) -> Iterator[None]:
    """Within the block, auxiliary losses are back-propagated with weight ``scale`` (> 0)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a number > 0, got {scale!r}")
    global _scale
    previous, _scale = _scale, float(scale)
    try:
        yield
    finally:
        _scale = previous


class _AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on x; the backward also gives ``loss`` the gradient 1 (the caller has scaled
    it: a float held in the function's context is not traced by ``torch.compile``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.loss_dtype = inputs[1].dtype

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=grad.device)


def add_auxiliary_loss(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """x itself (same value), with the scalar ``loss`` back-propagated beside it (module
    docstring). Returns x as is in no-grad mode (callers check ``torch.is_grad_enabled()``
    before computing a loss; inside ``torch.vmap`` ``requires_grad`` reads False even where
    autograd records, so it is not consulted)."""
    if loss.dim() != 0:
        raise ValueError(f"loss must be a scalar, got shape {tuple(loss.shape)}")
    if not torch.is_grad_enabled():
        return x
    return _AddAuxiliaryLoss.apply(x, loss * _scale)
