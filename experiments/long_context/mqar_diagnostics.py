"""What a soft-hash far branch sees on long-range MQAR (issue 44 item 2), per layer.

An MQAR sequence (``polysketch.data.mqar``) opens with its ``n`` key–value pairs at
positions 0 … 2n − 1 (key at 2i, value at 2i + 1); each answer position p (target ≠
``IGNORE_INDEX``) holds a repeated key x_p = x_{2a}, and its target is the value x_{2a+1}. With
short convolutions the far branch can find it as the key at position 2a + 1 (whose window
covers the key before it): its *source*. For a ``TransformerLM`` whose blocks have a soft-hash
global branch beside a window (``grid_diagnostics.global_branches``), with q_p, k_j the branch's
queries and keys as its core receives them (after the q/k LayerNorm and RoPE), φ the map's
bucket probabilities and s_pj = φq(q_p)·φk(k_j) (the buckets only, no linear term), per
layer, mean over answers and heads (``head`` = "mean"), or per layer and head (``per_head``:
``head`` = h, each head with its own map, τ and keys):

* ``tau``: the map's temperature τ; ``q_buckets``, ``k_buckets``: exp of the entropy of an
  answer's query distribution and of a context value-key's (1 = one bucket, F = uniform);
* ``q_information``, ``k_information``: I(token; bucket) = H(ū) − mean_t H(φ(x_t)) in nats
  over all T queries (keys) of a sequence, ū their mean distribution (``features.soft_hash``
  Eq. 7; 0 when every token has the same distribution, whether one bucket or uniform; log F
  at most): the collapse onto one bucket shows as I near 0 with ``q_buckets`` near 1;
* ``source_weight``: s_p,src / Σ_{j far} s_pj, the weight the branch puts on the source among
  every key it reads (``grid_diagnostics.far_keys``: the completed blocks before p's);
  ``values_weight``: the same summed over the n context value positions (any value);
  ``source_top``: the fraction of answers whose source scores highest among those n
  (1 / n when the branch reads a value without telling which);
* ``source_cos``, ``other_cos``: cos(q_p, k_src) and the mean of cos(q_p, k_j) over the other
  n − 1 context value keys: whether the query turns towards its own pair;
  ``value_key_cos``: the mean cosine between two context value keys of one sequence (near 1:
  the keys say "a value follows a key" and not which key, so no bucket can tell them apart);
* ``accuracy``: the model's recall on the sequences diagnosed (the same on every layer's row).

Answers whose source is not among the branch's far keys are skipped (none in the MQAR
settings of ``long_context.py mqar``: every query lies past the first block).
"""

from __future__ import annotations

import contextlib

import torch

from polysketch.data.mqar import IGNORE_INDEX

from .grid_diagnostics import (
    _captured,
    _entropy,
    _far_chunk,
    branch_features,
    far_keys,
    global_branches,
)

__all__ = ["MQAR_DIAG_COLUMNS", "answers", "diagnose_mqar", "information", "pair_scores"]

MQAR_DIAG_COLUMNS = (
    "layer", "head", "tau", "q_buckets", "k_buckets", "q_information", "k_information",
    "source_weight", "values_weight", "source_top", "source_cos", "other_cos", "value_key_cos",
    "accuracy",
)  # fmt: skip


def answers(inputs: torch.Tensor, targets: torch.Tensor, num_kv_pairs: int) -> list[tuple]:
    """(row b, answer position p, pair index a) for every answer of ``inputs`` / ``targets``
    (N, T) whose key is one of the row's ``num_kv_pairs`` context keys x_{2a} (module
    docstring); the source is position 2a + 1."""
    out = []
    for b, p in torch.nonzero(targets != IGNORE_INDEX).tolist():
        keys = inputs[b, 0 : 2 * num_kv_pairs : 2]
        (hits,) = torch.nonzero(keys == inputs[b, p], as_tuple=True)
        if len(hits):
            out.append((b, p, int(hits[0])))
    return out


def pair_scores(phi_q, phi_k, p: int, a: int, num_kv_pairs: int, far: torch.Tensor) -> dict:
    """For one answer p of pair a and one head: ``source_weight``, ``values_weight`` and
    ``source_top`` (module docstring) from the bucket probabilities phi_q, phi_k (T, F) and
    ``far`` (T, T) bool, far[p, j] = the branch reads key j at query p."""
    s = (phi_k @ phi_q[p]).masked_fill(~far[p], 0.0)  # (T,) scores of the keys p reads
    total = s.sum().clamp_min(torch.finfo(s.dtype).tiny)
    values = torch.arange(num_kv_pairs) * 2 + 1
    src = 2 * a + 1
    top = bool(s[values].max() == s[src]) and int((s[values] == s[src]).sum()) == 1
    return {
        "source_weight": float(s[src] / total),
        "values_weight": float(s[values].sum() / total),
        "source_top": float(top),
    }


def _entropy_exp(p: torch.Tensor) -> torch.Tensor:
    return _entropy(p).exp()


def information(phi: torch.Tensor) -> torch.Tensor:
    """I(token; bucket) of bucket distributions phi (..., T, F) over their T tokens: (...,)."""
    return _entropy(phi.mean(-2)) - _entropy(phi).mean(-1)


def diagnose_mqar(model, inputs, targets, num_kv_pairs: int, per_head: bool = False) -> list[dict]:
    """One dict of ``MQAR_DIAG_COLUMNS`` per layer with a soft-hash global branch, or per layer
    and head with ``per_head`` (module docstring), on MQAR ``inputs`` / ``targets`` (N, T); []
    for any other model. The model's train/eval mode is left as found."""
    branches = global_branches(model)
    if not branches:
        return []
    found = answers(inputs, targets, num_kv_pairs)
    if not found:
        raise ValueError("inputs hold no answer whose key is among the context's pairs")
    stores = {layer: {} for layer, _ in branches}
    was_training = model.training
    model.eval()
    try:
        with contextlib.ExitStack() as stack, torch.no_grad():
            for layer, block in branches:
                stack.enter_context(_captured(block.attn, stores[layer]))
            logits, _ = model(inputs)
    finally:
        model.train(was_training)
    mask = targets != IGNORE_INDEX
    accuracy = float((logits.argmax(-1)[mask] == targets[mask]).float().mean())
    values = torch.arange(num_kv_pairs) * 2 + 1
    off = ~torch.eye(num_kv_pairs, dtype=torch.bool)
    rows = []
    for layer, block in branches:
        heads, q, k, _, _, phi_q, phi_k = branch_features(block, stores[layer])
        far = far_keys(inputs.shape[1], _far_chunk(block.attn))
        qn, kn = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
        n_heads = q.shape[1]
        skip = ("k_buckets", "q_information", "k_information", "value_key_cos")  # per sequence
        acc = [{c: [] for c in MQAR_DIAG_COLUMNS[3:-1] if c not in skip} for _ in range(n_heads)]
        for b, p, a in found:
            if not bool(far[p, values].all()):
                continue
            for h in range(n_heads):
                for name, v in pair_scores(phi_q[b, h], phi_k[b, h], p, a, num_kv_pairs,
                                           far).items():  # fmt: skip
                    acc[h][name].append(v)
                cos = kn[b, h, values] @ qn[b, h, p]
                acc[h]["source_cos"].append(float(cos[a]))
                acc[h]["other_cos"].append(float((cos.sum() - cos[a]) / max(num_kv_pairs - 1, 1)))
                acc[h]["q_buckets"].append(float(_entropy_exp(phi_q[b, h, p])))
        if not acc[0]["source_weight"]:
            raise ValueError(f"no answer has its source among layer {layer}'s far keys")
        kv = kn[:, :, values]  # (B, H, n, D): the context's value keys
        gram = (kv @ kv.transpose(-1, -2))[..., off]  # (B, H, n(n - 1))
        k_buckets = _entropy_exp(phi_k[:, :, values])  # (B, H, n)
        q_info, k_info = information(phi_q), information(phi_k)  # (B, H)
        taus = [m.temperature for m in heads]
        groups = [(h, [h]) for h in range(n_heads)] if per_head else [("mean", range(n_heads))]
        for head, hs in groups:
            merged = {name: [v for h in hs for v in acc[h][name]] for name in acc[0]}
            rows.append({
                "layer": layer,
                "head": head,
                # one map for every head, or one per head (``_soft_hash_heads``)
                "tau": taus[head] if per_head and len(taus) == n_heads else sum(taus) / len(taus),
                **{name: sum(v) / len(v) for name, v in merged.items() if v},
                "k_buckets": float(k_buckets[:, list(hs)].mean()),
                "q_information": float(q_info[:, list(hs)].mean()),
                "k_information": float(k_info[:, list(hs)].mean()),
                "value_key_cos": float(gram[:, list(hs)].mean()) if num_kv_pairs > 1 else 1.0,
                "accuracy": accuracy,
            })  # fmt: skip
    return rows
