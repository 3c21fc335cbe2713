"""What the global head sees before the copy starts (issue 44 item 2), per layer.

For a ``TransformerLM`` whose blocks have a soft-hash global branch beside a window
(``soft_hash_far_local``, ``soft_hash_local``), on repeat-probe windows (passages recurring
d tokens later) and the queries i of recurrences (``second_mask``), with q_i, k_j the global
branch's queries and keys as its core receives them (after the q/k LayerNorm and RoPE) and
φ = the map's bucket probabilities (``feature_map.query`` / ``key``):

* ``tau``: the map's temperature τ (mean over the branch's heads);
* ``q_buckets``, ``k_buckets``: exp of the mean entropy −Σ_f φ_f log φ_f of a query's / key's
  bucket distribution (the effective number of buckets one token sits on; F when uniform,
  1 when hard);
* ``k_usage``: exp of the entropy of the keys' mean distribution (how many buckets the keys
  fill together);
* ``source_weight``: the attention weight of query i on the two keys j ∈ {i − d, i + 1 − d}
  its copy comes from, w_i = Σ_src s_ij / Σ_{j far} s_ij with s_ij = φq(q_i)·φk(k_j) and
  "far" the keys the branch reads (``far_keys``: those of the completed blocks before i's,
  for ``soft_hash_far``; every j ≤ i otherwise), mean over queries;
  ``source_lift`` = mean of w_i · n_far(i) / 2: the weight on the source over a flat
  kernel's (1 = no retrieval); ``next_weight`` the part on j = i + 1 − d alone, the key whose
  own token is the one to predict (i − d holds the current token again: a match of content
  finds it, and only a later layer can turn it into the next token);
* ``source_weight_all``: ``source_weight`` with every feature of the map in s_ij, the weight
  the branch attends with (φ includes the linear term of ``linear_weight`` > 0, Eqs. 5–6 of
  ``features/soft_hash.py``; equal to ``source_weight`` without one);
* ``source_cos``, ``far_cos``: the mean of cos(q_i, k_j) over the two sources j, and over
  every far key j of i (the baseline): whether the query turns towards or away from the
  source's key in the direction the linear term and the buckets' logits read; ``next_cos``
  the same for j = i + 1 − d alone (so cos(q_i, k_{i−d}) = 2·source_cos − next_cos: the key
  of the query's own token);
* ``source_value``, ``next_value``: whether attending to the source would lower the loss, as
  the map's and the surrogate's gradients both see it. With g_i the gradient of the loss
  (every surrogate off) at query i's output of the branch's core (before its output
  projection) and v_j the core's values, moving attention weight ε from i's current
  distribution onto key j changes the loss by ε g_i·(v_j − o_i), the coefficient c_ij of
  every normalized attention's score gradient (``surrogate_push``). The column is the
  z-score over i's far keys of u_ij = −g_i·v_j at the source, (u_src − mean_far u) / std_far
  u (o_i drops out), mean over the two sources (``source_value``) or at j = i + 1 − d alone
  (``next_value``), mean over queries: > 0 when the source's value lowers the loss more than
  an average far key's (every gradient pulls q_i towards k_src), < 0 when it raises it (they
  push q_i off it, whatever the kernel). It reads the values and the loss, not the kernel:
  at step 0 it is set by the initialized value, output and unembedding projections and by
  the data;
* ``surrogate_ratio``, ``surrogate_cos``: with G the gradient of the training loss with
  respect to the q and k rows of the global branch's projection, G_map the same with the
  surrogate off (λ = 0: the map's own gradient; the surrogate is exactly 0 in value, so the
  forward pass is the same) and G_sur = G − G_map: ‖G_sur‖ / ‖G_map‖ and cos(G_sur, G_map);
  0 and '' without a surrogate. "Off" is every layer's surrogate (a later layer's surrogate
  gradient reaches an earlier layer's projection through the residual stream);
* ``global_rms``, ``window_rms``: the RMS over recurrence positions of the global branch's
  and the window branch's outputs (after their output projections; they are summed): how much
  of the attention output the global branch carries.

``diagnose(model, windows, distance)`` returns one dict per layer with a soft-hash global
branch ([] for any other model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from polysketch.features.soft_hash import SoftHashFeatureMap

__all__ = [
    "DIAG_COLUMNS", "diagnose", "global_branches", "branch_features", "far_keys", "source_weights",
    "source_cosines", "source_values",
]  # fmt: skip

DIAG_COLUMNS = (
    "layer", "tau", "q_buckets", "k_buckets", "k_usage", "source_weight", "source_lift",
    "next_weight", "surrogate_ratio", "surrogate_cos", "global_rms", "window_rms",
    "source_weight_all", "source_cos", "far_cos", "next_cos", "source_value", "next_value",
)  # fmt: skip


def global_branches(model) -> list[tuple[int, object]]:
    """(layer index, block) for each block whose global branch is a soft-hash attention
    beside a window (unshared projections)."""
    out = []
    for i, block in enumerate(getattr(model, "blocks", [])):
        attn = getattr(block, "attn", None)
        if (getattr(block, "local_attn", None) is not None and not block.shared
                and _soft_hash_heads(getattr(attn, "feature_map", None))):  # fmt: skip
            out.append((i, block))
    return out


def _soft_hash_heads(fm) -> list[SoftHashFeatureMap]:
    """The per-head soft-hash maps of a core's feature map ([] for another map)."""
    if isinstance(fm, SoftHashFeatureMap):
        return [fm]
    if getattr(fm, "name", None) == "soft_hash" and hasattr(fm, "head_map"):
        return [fm.head_map(h) for h in range(fm.num_heads)]
    return []


def far_keys(n: int, chunk: int | None) -> torch.Tensor:
    """(n, n) bool: key j is read by query i through the global branch (j < the start of i's
    block of ``chunk`` for a far-blocks-only branch; j ≤ i when ``chunk`` is None)."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    if chunk is None:
        return j <= i
    return j < (i // chunk) * chunk


def source_weights(phi_q, phi_k, queries, distance: int, chunk: int | None):
    """(w, lift, w_next) per query: w_i = Σ_{j ∈ {i−d, i+1−d}} s_ij / Σ_{j far} s_ij,
    w_i · n_far(i) / 2 and s_{i, i+1−d} / Σ_{j far} s_ij (module docstring). phi_q, phi_k
    (T, F) of one window and head; ``queries`` (Q,) positions with both sources among their
    far keys."""
    s = phi_q[queries] @ phi_k.T  # (Q, T)
    mask = far_keys(phi_k.shape[0], chunk)[queries]
    s = s.masked_fill(~mask, 0.0)
    rows = torch.arange(len(queries))
    total = s.sum(-1)
    nxt = s[rows, queries + 1 - distance] / total
    w = s[rows, queries - distance] / total + nxt
    return w, w * mask.sum(-1) / 2, nxt


def source_cosines(q, k, queries, distance: int, chunk: int | None):
    """(c_src, c_far, c_next) per query: the mean of cos(q_i, k_j) over j ∈ {i − d, i + 1 − d}
    and over the keys j far from i (``far_keys``), and cos(q_i, k_{i+1−d}). q, k (T, D) of one
    window and head; ``queries`` (Q,) positions with both sources among their far keys."""
    cos = (
        torch.nn.functional.normalize(q[queries], dim=-1)
        @ torch.nn.functional.normalize(k, dim=-1).T
    )  # (Q, T)
    mask = far_keys(k.shape[0], chunk)[queries]
    rows = torch.arange(len(queries))
    nxt = cos[rows, queries + 1 - distance]
    src = (cos[rows, queries - distance] + nxt) / 2
    far = cos.masked_fill(~mask, 0.0).sum(-1) / mask.sum(-1)
    return src, far, nxt


def source_values(g, v, queries, distance: int, chunk: int | None):
    """(z_src, z_next) per query: the z-scores over the far keys j of i of u_ij = −g_i·v_j at
    the two sources j ∈ {i − d, i + 1 − d} (mean of the two) and at j = i + 1 − d (module
    docstring: ``source_value``, ``next_value``). g (T, E) the loss gradient at the core's
    output, v (T, E) its values, of one window and head; ``queries`` (Q,) positions with both
    sources among their far keys. A query whose far keys' u all agree has z = 0."""
    u = -(g[queries] @ v.T)  # (Q, T)
    mask = far_keys(v.shape[0], chunk)[queries]
    n = mask.sum(-1)
    mean = u.masked_fill(~mask, 0.0).sum(-1) / n
    std = ((u - mean[:, None]).masked_fill(~mask, 0.0).pow(2).sum(-1) / n).sqrt()
    rows = torch.arange(len(queries))
    scale = torch.where(std > 0, std, 1.0)
    z_own = (u[rows, queries - distance] - mean) / scale
    z_next = (u[rows, queries + 1 - distance] - mean) / scale
    return (z_own + z_next) / 2, z_next


def _value_gradients(model, branches, inputs, targets) -> dict[int, tuple]:
    """Per layer, (v, g) of its global branch's core: the values it attends with and the
    gradient of the loss at its output (B, H, T, E), detached. Every surrogate is off: a later
    layer's surrogate, 0 in value, would add its training-only gradient to g."""
    stores = {layer: {} for layer, _ in branches}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_surrogates_off(branches))
        for layer, block in branches:
            stack.enter_context(_captured(block.attn, stores[layer], output=True))
        model.zero_grad(set_to_none=True)
        _, loss = model(inputs, targets)
        outs = [stores[layer]["out"] for layer, _ in branches]
        grads = torch.autograd.grad(loss, outs)
    model.zero_grad(set_to_none=True)
    return {layer: (stores[layer]["v"], g.detach())
            for (layer, _), g in zip(branches, grads, strict=True)}  # fmt: skip


@contextlib.contextmanager
def _captured(attn, store: dict, *, output: bool = False):
    """Within the block, ``attn``'s core records the q and k it attends with (and with
    ``output``, its values and its output, the latter in the graph)."""
    inner = attn.attend

    def attend(q, k, v, **kw):
        store["q"], store["k"] = q.detach(), k.detach()
        out = inner(q, k, v, **kw)
        if output:
            store["v"], store["out"] = v.detach(), out
        return out

    attn.attend = attend
    try:
        yield
    finally:
        del attn.attend


def branch_features(block, store: dict) -> tuple:
    """(heads, q, k, all_q, all_k, phi_q, phi_k) of a block's soft-hash global branch from the q
    and k its core attended with (``store`` as ``_captured`` filled it, (B, H, T, D)): its
    per-head maps, every feature of the map (``all_*``, the linear term included) and the
    bucket probabilities alone (``phi_*``)."""
    fm = block.attn.feature_map
    heads = _soft_hash_heads(fm)
    q, k = store["q"], store["k"]
    with torch.no_grad():
        all_q, all_k = fm.query(q), fm.key(k)
    f = heads[0].num_features
    return heads, q, k, all_q, all_k, all_q[..., :f], all_k[..., :f]


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * p.clamp_min(1e-30).log()).sum(-1)


def _qk_grads(model, branches, inputs, targets) -> dict[int, torch.Tensor]:
    """Per layer, the gradient of the training loss for the q and k rows of its global
    branch's projection ``block.attn.qkv``."""
    model.zero_grad(set_to_none=True)
    _, loss = model(inputs, targets)
    loss.backward()
    out = {}
    for layer, block in branches:
        attn = block.attn
        out[layer] = attn.qkv.weight.grad[: attn._split[0] + attn._split[1]].detach().clone()
    model.zero_grad(set_to_none=True)
    return out


@contextlib.contextmanager
def _surrogates_off(branches):
    """Within the block, every branch's surrogate weight is λ = 0 (the forward pass is the
    same: the surrogate is 0 in value)."""
    specs = {layer: block.attn.spec for layer, block in branches}
    for layer, block in branches:  # the spec is frozen: the same one with λ = 0
        block.attn.spec = dataclasses.replace(specs[layer], gradient_surrogate=0.0)
    try:
        yield
    finally:
        for layer, block in branches:
            block.attn.spec = specs[layer]


def _surrogate_share(model, branches, inputs, targets) -> dict[int, tuple[float, object]]:
    """Per layer (‖G_sur‖ / ‖G_map‖, cos(G_sur, G_map)), G_map with every surrogate of the
    model off (module docstring)."""
    lams = {layer: float(block.attn.gradient_surrogate or 0.0) for layer, block in branches}
    if not any(lams.values()):
        return {layer: (0.0, "") for layer in lams}
    total = _qk_grads(model, branches, inputs, targets)
    with _surrogates_off(branches):
        own = _qk_grads(model, branches, inputs, targets)
    out = {}
    for layer in lams:
        sur = total[layer] - own[layer]
        norm_own, norm_sur = float(own[layer].norm()), float(sur.norm())
        cos = float((sur * own[layer]).sum()) / max(norm_own * norm_sur, 1e-30)
        out[layer] = (norm_sur / max(norm_own, 1e-30), cos)
    return out


def diagnose(model, windows, distance: int, *, num_windows: int = 2, queries: int = 256,
             seed: int = 0) -> list[dict]:  # fmt: skip
    """One dict of ``DIAG_COLUMNS`` per layer with a soft-hash global branch (module
    docstring), on the first ``num_windows`` of ``windows`` (a ``RepeatSet``) and up to
    ``queries`` recurrence positions per window (a seeded sample, the same for every layer).
    The model's train/eval mode and gradients are left as found."""
    branches = global_branches(model)
    if not branches:
        return []
    if distance < 1:
        raise ValueError(f"distance must be >= 1, got {distance}")
    inputs = windows.inputs[:num_windows]
    targets = windows.targets[:num_windows]
    positions = torch.nonzero(windows.second_mask).flatten()
    positions = positions[positions - distance >= 0]
    chunk = {layer: _far_chunk(block.attn) for layer, block in branches}
    if len(positions) == 0:
        raise ValueError("windows hold no recurrence with its source inside the window")
    gen = torch.Generator().manual_seed(seed)
    if len(positions) > queries:
        positions = positions[torch.randperm(len(positions), generator=gen)[:queries]]
    was_training = model.training
    model.eval()  # no dropout: the two gradients differ by the surrogate only
    try:
        shares = _surrogate_share(model, branches, inputs, targets)
        values = _value_gradients(model, branches, inputs, targets)
        stores = {layer: {} for layer, _ in branches}
        outs = {layer: {} for layer, _ in branches}
        hooks = []
        for layer, block in branches:
            for name, module in (("global", block.attn), ("window", block.local_attn)):

                def keep(mod, inp, out, into=outs[layer], name=name):
                    into[name] = out.detach()

                hooks.append(module.register_forward_hook(keep))
        with contextlib.ExitStack() as stack, torch.no_grad():
            for layer, block in branches:
                stack.enter_context(_captured(block.attn, stores[layer]))
            model(inputs)
        for h in hooks:
            h.remove()
    finally:
        model.train(was_training)
    rows = []
    for layer, block in branches:
        heads, q, k, all_q, all_k, phi_q, phi_k = branch_features(block, stores[layer])
        far = far_keys(windows.inputs.shape[1], chunk[layer])
        src = positions - distance
        qs = positions[far[positions, src] & far[positions, src + 1]]
        if len(qs) == 0:
            raise ValueError(f"no recurrence has its source among layer {layer}'s far keys")
        v, grad = values[layer]
        ws, lifts, nexts, alls, srcs, fars, ncos, zs, znext = ([] for _ in range(9))
        for b in range(phi_q.shape[0]):
            for h in range(phi_q.shape[1]):
                w, lift, nxt = source_weights(phi_q[b, h], phi_k[b, h], qs, distance,
                                              chunk[layer])  # fmt: skip
                ws.append(w)
                lifts.append(lift)
                nexts.append(nxt)
                alls.append(source_weights(all_q[b, h], all_k[b, h], qs, distance,
                                           chunk[layer])[0])  # fmt: skip
                c_src, c_far, c_next = source_cosines(q[b, h], k[b, h], qs, distance,
                                                      chunk[layer])  # fmt: skip
                srcs.append(c_src)
                fars.append(c_far)
                ncos.append(c_next)
                z_src, z_next = source_values(grad[b, h], v[b, h], qs, distance, chunk[layer])
                zs.append(z_src)
                znext.append(z_next)
        mask = windows.second_mask
        g, wdw = outs[layer]["global"][:, mask], outs[layer]["window"][:, mask]
        ratio, cos = shares[layer]
        rows.append({
            "layer": layer,
            "tau": sum(m.temperature for m in heads) / len(heads),
            "q_buckets": math.exp(float(_entropy(phi_q).mean())),
            "k_buckets": math.exp(float(_entropy(phi_k).mean())),
            "k_usage": math.exp(float(_entropy(phi_k.mean(dim=(0, 1, 2))))),
            "source_weight": float(torch.cat(ws).mean()),
            "source_lift": float(torch.cat(lifts).mean()),
            "next_weight": float(torch.cat(nexts).mean()),
            "surrogate_ratio": ratio,
            "surrogate_cos": cos,
            "global_rms": float(g.pow(2).mean().sqrt()),
            "window_rms": float(wdw.pow(2).mean().sqrt()),
            "source_weight_all": float(torch.cat(alls).mean()),
            "source_cos": float(torch.cat(srcs).mean()),
            "far_cos": float(torch.cat(fars).mean()),
            "next_cos": float(torch.cat(ncos).mean()),
            "source_value": float(torch.cat(zs).mean()),
            "next_value": float(torch.cat(znext).mean()),
        })  # fmt: skip
    return rows


def _far_chunk(attn) -> int | None:
    """The block length of a far-blocks-only (``local='none'``) global core, else None."""
    spec = getattr(attn, "spec", None)
    if spec is not None and spec.form == "mixed" and spec.local == "none":
        return int(attn.chunk_size)
    return None
