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

**Known gradients** (``add_auxiliary_gradient``): where the caller has the regularizer's
gradient itself (g_x at x, g_i at tensors t_i the forward used, e.g. a feature map's weights),
it attaches them to x's backward directly, with no surrogate loss to differentiate: the same
gradients as ``add_auxiliary_loss(x, ⟨x, sg(g_x)⟩ + Σ_i ⟨t_i, sg(g_i)⟩)``, held as attributes
of one autograd node, so they are not saved tensors. That matters under
``torch.utils.checkpoint`` (non-reentrant): the backward reruns the forward to make its saved
tensors again, and matches them to the first run's in order, so a computation that saves none
may be left out of the rerun. ``recompute_contexts`` (the ``context_fn`` of a checkpoint) marks
the rerun, in the thread that runs it (a forward in another thread is not marked);
``replaying()`` tells a caller that the gradients it attached in the first run are
already in the graph, so it need not compute them again (the rerun's graph is discarded). Under
``torch.compile`` or a ``torch.func`` transform the attachment falls back to the surrogate loss
above (saved tensors and all) and ``replaying()`` stays False, so nothing is skipped there.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

__all__ = [
    "add_auxiliary_gradient", "add_auxiliary_loss", "auxiliary_loss_scale", "checkpoint",
    "recompute_contexts", "replaying",
]  # fmt: skip

_scale = 1.0  # the scale in force (auxiliary_loss_scale sets it for a block)
_rerun = threading.local()  # .active: this thread recomputes a checkpoint (recompute_contexts)


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


def _direct() -> bool:
    """Whether ``add_auxiliary_gradient`` attaches the gradients as node attributes (eager
    autograd), rather than through a surrogate loss (``torch.compile``, ``torch.func``)."""
    if torch.compiler.is_compiling():
        return False
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return not (active is not None and active())


@contextlib.contextmanager
def _recomputing() -> Iterator[None]:
    previous, _rerun.active = getattr(_rerun, "active", False), True
    try:
        yield
    finally:
        _rerun.active = previous


def recompute_contexts() -> tuple:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: no
    context around the first forward, ``replaying()`` true during the recomputation."""
    return contextlib.nullcontext(), _recomputing()


def checkpoint(fn, *args):
    """``fn(*args)`` recomputed in the backward pass (``torch.utils.checkpoint``,
    non-reentrant), its rerun marked (``recompute_contexts``) so that the auxiliary gradients
    attached in the first run are not computed again; plain under ``torch.compile``, which
    plans its own recomputation."""
    if torch.compiler.is_compiling():
        return torch_checkpoint(fn, *args, use_reentrant=False)
    return torch_checkpoint(fn, *args, use_reentrant=False, context_fn=recompute_contexts)


def replaying() -> bool:
    """True while a checkpoint recomputes a forward (``recompute_contexts``) whose
    ``add_auxiliary_gradient`` calls attached their gradients in the first run: the caller may
    skip computing and attaching them (module docstring). False under ``torch.compile`` and
    ``torch.func`` transforms, where the attachment saves tensors that the rerun must make."""
    return _direct() and getattr(_rerun, "active", False)  # per thread: a backward's rerun


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def add_auxiliary_gradient(
    x: torch.Tensor,
    own: torch.Tensor | None = None,
    others: tuple[tuple[torch.Tensor, torch.Tensor], ...] = (),
) -> torch.Tensor:
    """x itself (same value); when the backward reaches x, x's gradient also gains s·``own``
    (broadcast to x's shape) and each tensor t of the pairs (t, g) in ``others`` gains s·g
    (g of t's shape), s the scale in force now (``auxiliary_loss_scale``): the gradients of
    s·(⟨x, sg(own)⟩ + Σ ⟨t, sg(g)⟩), attached without saving a tensor (module docstring); a t
    that does not require grad takes none. Returns x as is in no-grad mode."""
    if not torch.is_grad_enabled():
        return x
    if own is not None and not _broadcasts_to(own.shape, x.shape):
        raise ValueError(f"own gradient of shape {tuple(own.shape)} does not broadcast to x's "
                         f"{tuple(x.shape)}")  # fmt: skip
    for t, g in others:
        if g.shape != t.shape:
            raise ValueError(f"gradient of shape {tuple(g.shape)} for a tensor of shape "
                             f"{tuple(t.shape)}")  # fmt: skip
    if not _direct():
        loss = x.new_zeros((), dtype=torch.float32)
        for t, g in others:
            loss = loss + (t * g.detach().to(t.dtype)).sum()
        if own is not None:
            loss = loss + (x * own.detach().to(x.dtype)).sum()
        return add_auxiliary_loss(x, loss)
    own = None if own is None else own.detach().to(x.dtype) * _scale
    scaled = tuple(g.detach().to(t.dtype) * _scale for t, g in others)
    return _AddAuxiliaryGradient.apply(x, own, scaled, *(t for t, _ in others))


class _AddAuxiliaryGradient(torch.autograd.Function):
    """Identity on x; the backward adds ``own`` to x's gradient and returns ``grads`` for the
    trailing tensors. The gradients are context attributes, not saved tensors (no saved-tensor
    hook sees them: a checkpoint's rerun may leave this node out)."""

    @staticmethod
    def forward(ctx, x, own, grads, *tensors):
        ctx.own, ctx.grads = own, grads
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.own is not None:
            grad = grad + ctx.own.to(grad.dtype)
        return grad, None, None, *ctx.grads
