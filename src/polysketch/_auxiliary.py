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
read at the forward and kept for the backward (a recomputed forward does not re-read it).

The auxiliary gradient flows only if x is on the path of the loss being back-propagated, and
once per backward through x.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = ["add_auxiliary_loss", "auxiliary_loss_scale"]

_SCALE: contextvars.ContextVar[float] = contextvars.ContextVar("auxiliary_loss_scale", default=1.0)


@contextlib.contextmanager
def auxiliary_loss_scale(scale: float) -> Iterator[None]:
    """Within the block, auxiliary losses are back-propagated with weight ``scale`` (> 0)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a number > 0, got {scale!r}")
    token = _SCALE.set(float(scale))
    try:
        yield
    finally:
        _SCALE.reset(token)


class _AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on x; the backward also gives ``loss`` the gradient ``scale``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.scale, ctx.loss_dtype = inputs[2], inputs[1].dtype

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=ctx.loss_dtype, device=grad.device), None


def add_auxiliary_loss(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """x itself (same value), with the scalar ``loss`` back-propagated beside it (module
    docstring). Returns x as is in no-grad mode (callers check ``torch.is_grad_enabled()``
    before computing a loss; inside ``torch.vmap`` ``requires_grad`` reads False even where
    autograd records, so it is not consulted)."""
    if loss.dim() != 0:
        raise ValueError(f"loss must be a scalar, got shape {tuple(loss.shape)}")
    if not torch.is_grad_enabled():
        return x
    return _AddAuxiliaryLoss.apply(x, loss, _SCALE.get())
