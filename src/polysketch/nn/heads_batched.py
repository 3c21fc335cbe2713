"""All heads at once without ``torch.vmap``: batched-heads forms of the common feature maps.

``MultiHeadFeatureMap`` applies H independent maps by ``torch.vmap`` over
``torch.func.functional_call``. That is general, but its dispatch costs about 0.4 ms per call
on a CPU whatever the input size, which dominated one decoding step (two calls
per layer per token). For the maps used most, the same computation is
written here directly on the head-stacked tensors (leading head axis H), as batched matmuls
(``(..., H, T, D) @ (H, D, ·)``, broadcast over the heads), in the same order of operations as
the map's own code:

* ``polysketch`` with ``projection="gaussian"`` (the tree of Ahle et al., any degree; the
  psf presets) or ``"product"``: ``PolySketch._sketch`` with a head axis;
* ``hedgehog``: [softmax(x W_h + b_h), softmax(−(x W_h + b_h))] · output_scale;
* ``soft_hash``: softmax(x (τ_h W_h / √D)) · output_scale (or the product of ``factors``
  softmaxes, ``features.soft_hash.product_softmax``), W_h's columns rescaled to norm √D with
  ``unit_directions``, and the linear features √(α/(1 + c))(√c, x/‖x‖) appended with
  ``linear_weight`` (c = ``linear_offset``), and the training-only bucket balance of
  ``bucket_balance`` (Eqs. 7–8 of ``features.soft_hash``, each head's loss summed as the
  per-head maps would).

``batched_form(map)`` returns the function for a map instance (or None: vmap then), called
as ``fn(template, params, buffers, x, role, memo)`` with the stacked tensors by their names
in the map and a dict the owning ``MultiHeadFeatureMap`` keeps for derived tensors; x is
already in the compute dtype, the result is cast back by the caller. Tests compare
every form with the vmapped result (``tests/test_nn_heads.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .._auxiliary import add_auxiliary_loss, replaying
from .._checks import as_dtype
from ..features.base import FeatureMap
from ..features.hedgehog import HedgehogFeatureMap
from ..features.polysketch import PolySketch
from ..features.soft_hash import (
    BALANCE_FORMS,
    SoftHashFeatureMap,
    attach_usage_balance,
    product_softmax,
    unit_directions,
)

__all__ = ["batched_form"]


def _polysketch(template: PolySketch, params, buffers, x, role, memo):
    """``PolySketch._sketch`` (then × output_scale) for head-stacked buffers; x (..., H, T, D)."""
    p, r, leaves = template.degree, template.num_features, template.num_leaves
    scale = 1.0 / math.sqrt(r)
    if template.projection == "product":  # √(1/r) ∘_i (x G_i)
        g = as_dtype(buffers["map.product_gaussian"], x.dtype)  # (H, p, D, r)
        h, d = g.shape[0], g.shape[2]
        y = x @ g.transpose(1, 2).reshape(h, d, p * r)  # (..., H, T, D) @ (H, D, p·r)
        y = y.unflatten(-1, (p, r))
        z = y[..., 0, :] * scale
        for i in range(1, p):
            z = z * y[..., i, :]
    else:
        w_leaf = as_dtype(buffers["map.leaf_gaussian"], x.dtype)  # (H, L, D, r)
        w_node = as_dtype(buffers["map.node_gaussian"], x.dtype)  # (H, L - 1, 2, r, r)
        h, d = w_leaf.shape[0], w_leaf.shape[2]
        if leaves == 1:
            return (x @ w_leaf[:, 0]) * scale
        count = leaves // 2
        composed, real = _composed(memo, buffers, w_leaf, w_node, p, count)
        y = x @ real  # (..., H, T, p·r): the children that are leaves of x
        if leaves > p:  # e1 leaves: constant rows, the same for every x
            const = composed[:, p:, 0, :].reshape(h, 1, (leaves - p) * r)
            y = torch.cat([y, const.expand(*y.shape[:-1], -1)], dim=-1)
        y = y.unflatten(-1, (count, 2, r))
        z = y[..., 0, :] * y[..., 1, :] * scale**3  # (..., H, T, count, r): level 1
        offset = count
        while count > 1:  # one batched GEMM per further level
            count //= 2
            w = w_node[:, offset : offset + count].reshape(h, 2 * count, r, r)
            offset += count
            # Σ_r z[..., h, t, i, r] w[h, i, r, s]: a batched matmul over (h, i) (an einsum
            # costs ~10 µs more per call on a CPU, which one decoding step feels)
            y = (z.transpose(-3, -2) @ w).transpose(-3, -2).unflatten(-2, (count, 2))
            z = y[..., 0, :] * y[..., 1, :] * scale
        z = z[..., 0, :]
    return z if template.output_scale == 1.0 else z * template.output_scale


def _composed(memo, buffers, w_leaf, w_node, p, count):
    """(W_leaf G (H, L, D, r), its first p leaves as (H, D, p·r)); without gradients, kept in
    ``memo`` (the owning map's) for as long as the buffers are the same tensors at the same
    version (a redraw, ``load_state_dict`` or ``.to()`` makes them anew), so decoding does
    not recompose them at every token."""
    h, r, d = w_leaf.shape[0], w_leaf.shape[-1], w_leaf.shape[2]
    if torch.compiler.is_compiling() or torch.is_grad_enabled():  # nothing kept: compose
        composed = w_leaf @ w_node[:, :count].reshape(h, 2 * count, r, r)
        return composed, composed[:, :p].transpose(1, 2).reshape(h, d, p * r)
    leaf, node = buffers["map.leaf_gaussian"], buffers["map.node_gaussian"]
    key = (w_leaf.dtype, p, torch.is_inference_mode_enabled())
    hit = memo.get(key)
    if hit is not None:
        (a, va), (b, vb) = hit[0]
        if a is leaf and b is node and a._version == va and b._version == vb:
            return hit[1]
    composed = w_leaf @ w_node[:, :count].reshape(h, 2 * count, r, r)  # (H, L, D, r)
    real = composed[:, :p].transpose(1, 2).reshape(h, d, p * r)
    memo.clear()
    memo[key] = (((leaf, leaf._version), (node, node._version)), (composed, real))
    return composed, real


def _hedgehog(template: HedgehogFeatureMap, params, buffers, x, role, memo):
    """[softmax(u), softmax(−u)]·c with u = x W_h + b_h (the key weights for keys)."""
    which = "k" if role == "key" and not template.shared else "q"
    weight = as_dtype(params[f"map.weight_{which}"], x.dtype)  # (H, D, M)
    bias = as_dtype(params[f"map.bias_{which}"], x.dtype)  # (H, M)
    u = x @ weight + bias.unsqueeze(-2)  # (..., H, T, D) @ (H, D, M), batched over heads
    phi = torch.cat([u.softmax(-1), (-u).softmax(-1)], dim=-1)
    return phi if template.output_scale == 1.0 else phi * template.output_scale


def _soft_hash(template: SoftHashFeatureMap, params, buffers, x, role, memo):
    """softmax(x (τ_h W_h / √D)) · c (of each of the m factors, then their Kronecker product)
    with W_h = the key weights for keys (unless shared)."""
    which = "k" if role == "key" and not template.shared else "q"
    weight = params[f"map.weight_{which}"]  # (H, D, m·B)
    if template.unit_directions:  # each column of each head's W_h to norm √D
        weight = unit_directions(weight, template.dim)
    log_t = params.get("map.log_temperature")  # (H,): a parameter, or a buffer when fixed
    if log_t is None:
        log_t = buffers["map.log_temperature"]
    log_t = log_t * template.temperature_rate  # τ_h = exp(r·θ_h)
    scale = (log_t.exp() / math.sqrt(template.dim))[:, None, None]  # (H, 1, 1)
    if x.shape[-2] < weight.shape[-2]:  # T < D (decoding): scale the T × F logits
        logits = (x @ as_dtype(weight, x.dtype)) * as_dtype(scale, x.dtype)
    else:  # scale W first: D × F products, not T × F
        logits = x @ as_dtype(weight * scale, x.dtype)  # (..., H, T, D) @ (H, D, m·B)
    phi = product_softmax(logits, template.factors)
    if template.bucket_balance and x.shape[-2] > 1 and torch.is_grad_enabled():  # Eqs. 7–8
        if template.balance_reuses_features:  # Eq. 8's gradient from φ, attached to it
            if not replaying():  # a checkpoint's rerun: attached in the first run
                heads = phi.shape[-3]  # each head's, as H maps', averaged over the batch
                coef = template.bucket_balance * heads / math.prod(phi.shape[:-2])
                phi = attach_usage_balance(
                    phi, x, logits, weight, scale.reshape(-1), coef,
                    inputs=template.bucket_balance_inputs,
                    through_scale=template.bucket_balance_temperature,
                )  # fmt: skip
        else:
            if not (template.bucket_balance_temperature and template.bucket_balance_inputs):
                inputs = x if template.bucket_balance_inputs else x.detach()  # W_h learns
                held = scale if template.bucket_balance_temperature else scale.detach()  # τ_h
                logits = inputs @ as_dtype(weight * held, x.dtype)
            deficit = BALANCE_FORMS[template.bucket_balance_form](logits, template.factors)
            loss = template.bucket_balance * deficit.sum(-1).mean()  # each head's, as H maps'
            phi = add_auxiliary_loss(phi, loss)
    if template.linear_weight:  # Eqs. 5–6's √(α/(1 + c))(√c, x/‖x‖), the same for every head
        phi = torch.cat([phi, template.linear_features(x).to(phi.dtype)], dim=-1)
    return phi if template.output_scale == 1.0 else phi * template.output_scale


def batched_form(feature_map: FeatureMap) -> Callable | None:
    """The batched-heads function for ``feature_map``'s kind and settings, or None."""
    plain_query = type(feature_map)._query_stabilized is FeatureMap._query_stabilized
    if not plain_query:  # query_stabilized differs from query: keep the map's own code
        return None
    if type(feature_map) is PolySketch and feature_map.projection in ("gaussian", "product"):
        return _polysketch
    if type(feature_map) is HedgehogFeatureMap:
        return _hedgehog
    if type(feature_map) is SoftHashFeatureMap:
        return _soft_hash
    return None
