"""Feature maps in attention: stabilized queries, and refusing what cannot be computed exactly.

Linear attention computes, for query row i over the visible keys j,

    out_i = Σ_j s_ij v_j / stab(offset + Σ_j s_ij),    s_ij = φq(q_i)·φk(k_j) (squared if square),

with ``stab`` the denominator guard of ``polysketch.ops`` (|den| clamped to ≥ eps). The
softmax-kernel maps' features hold exponentials: at scale 1 and ‖x‖ ≈ 16 the kernel exp(x·y)
reaches e^256, beyond fp32, and their features over- or underflow long before (fp32 exp range
≈ e^±88). ``attention_features`` returns the features the attention path should use and
checks them; the rules, which are part of the ``FeatureMap`` contract (``features.base``):

1. **Stabilized queries, only where exact.** When ``normalize=True`` and
   ``denominator_offset == 0``, a positive factor c_i on query row i cancels between numerator
   and normalizer, so the map's ``query_stabilized`` (row scaled so its largest |feature| is
   about 1, computed in log space; ``stable_query`` maps) is used instead of ``query``. With an
   offset, or without normalization, c_i does not cancel and the plain ``query`` is used.
   Keys are never shifted: a per-key factor reweights keys, and a factor shared by all keys
   would have to look at other, later tokens (performer-pytorch's causal leak).
2. **Refuse overflow.** Query features (stabilized or not) and key features must be finite
   in the input dtype (fp16 holds at most 65504; bf16 and fp32 about 3.4e38). Keys masked by
   ``key_padding_mask`` are exempt (they never enter the state).
3. **Refuse a normalizer the guard would alter** (``stable_query`` maps, non-square, whose
   normalizer is computed here in O(T·F) beside the attention, as the ops do: causal
   prefix sums of the visible keys' features plus ``initial_sums``): it must be finite, and
   for non-negative maps on the stabilized path ≥ eps wherever the query sees a key. Below
   eps the guard would clamp it and silently shrink the output (all-zero outputs): after rule 1 that
   happens only when the KEY features are tiny, which no exact per-token shift can repair. Signed
   maps (trig, hybrids, complex A) keep the guard: their
   normalizers cross zero by design (DESIGN: ill-conditioned in low precision).

Refusals raise ValueError on the CPU. On accelerators, and inside ``torch.compile``,
``refuse_unless`` uses ``torch._assert_async`` instead (no host synchronization, no graph
break; on a GPU the failure surfaces as a device assertion at the next synchronization and
leaves the CUDA context unusable, as every device assert does; compiled CPU code raises
RuntimeError); pass ``asynchronous=False`` to force the synchronous ValueError.

For the attention core (``polysketch.nn``): call ``attention_features`` with the arguments you
give ``linear_attention`` (``initial_sums`` = ``initial_state.denominator`` for non-square
maps), then ``linear_attention`` on the returned features. A ``MultiHeadFeatureMap`` works as
well as a ``FeatureMap`` (it has ``query_stabilized``, ``stable_query``, ``nonnegative``,
``square``). For one decode step with a state, the same call with Tq = Tk = 1,
``causal=True`` and ``initial_sums`` = the state's key sums checks that step.
"""

from __future__ import annotations

import math

import torch

from .._checks import check_float, refuse_unless
from .._device import checks_on_host

__all__ = ["attention_features", "refuse_features", "refuse_unless", "range_advice"]


def range_advice(feature_map, dtype: torch.dtype) -> str:
    """What a user can change when a map's features or scores leave ``dtype``'s range."""
    fixes = []
    if dtype == torch.float16:
        fixes.append("use bfloat16 (the range of float32) or float32 instead of float16")
    scale = getattr(feature_map, "scale", None)
    if getattr(feature_map, "family", None) == "softmax" and scale is not None:
        fixes.append(f"lower scale (now {scale:.4g}; attention's usual 1/sqrt(D))")
    fixes.append("normalize q and k (e.g. LayerNorm, qk_norm=True) to bound their norms")
    if dtype != torch.float64:
        fixes.append("or compute in float64")
    return "; ".join(fixes)


def _label(feature_map) -> str:
    return repr(getattr(feature_map, "name", "") or type(feature_map).__name__)


def _rows_ok(phi: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Whether features are finite, for ``refuse_unless`` (which reduces with ``all``): per
    element without ``keep``; with it per row, every feature finite or the row masked out
    (..., T). phi (..., T, F)."""
    if keep is None:  # one reduction fewer (one launch per check on a GPU)
        return torch.isfinite(phi)
    return torch.isfinite(phi).all(-1) | ~keep


def _all_finite(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` is finite (CPU, host read). The sum first, accumulated in
    float32 (float64 for float64 inputs): one vectorized reduction, several times cheaper than
    ``isfinite(x).all()``. A NaN or ±inf element makes the sum non-finite, so a finite sum
    proves every element finite; only a non-finite sum (or finite values whose sum overflows)
    tests every element."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.detach()  # a check: no autograd node for the sum
    total = x.sum() if x.dtype == acc else x.sum(dtype=acc)
    return math.isfinite(total.item()) or bool(torch.isfinite(x).all())


def _normalizers(phi_q, phi_k, *, causal, key_padding_mask, initial_sums):
    """(den (..., Tq), visible (..., Tq)): Σ over the keys query i sees of φq_i·φk_j, in the
    accumulation dtype, and whether it sees any key (non-square maps)."""
    acc = torch.promote_types(phi_q.dtype, torch.float32)
    q, k = phi_q.to(acc), phi_k.to(acc)
    tq, tk = q.shape[-2], k.shape[-2]
    count = None
    if key_padding_mask is not None:
        keep = key_padding_mask.unsqueeze(-1)
        k = torch.where(keep, k, k.new_zeros(()))
        count = key_padding_mask.to(torch.int64)
    if causal:  # query i sees keys j <= i + (Tk - Tq)
        sums = k.cumsum(-2)[..., tk - tq :, :]
        if count is not None:
            count = count.cumsum(-1)[..., tk - tq :]
    else:
        sums = k.sum(-2, keepdim=True)
        if count is not None:
            count = count.sum(-1, keepdim=True)
    if initial_sums is not None:
        sums = sums + initial_sums.to(acc).unsqueeze(-2)
    den = (q * sums).sum(-1)
    visible = torch.ones((), dtype=torch.bool, device=den.device) if count is None else count > 0
    if initial_sums is not None:  # earlier keys are visible to every query
        visible = visible | (initial_sums != 0).any(-1, keepdim=True)
    return den, visible


def _query_overflow(feature_map, dtype, stabilized) -> str:
    hint = ""
    if getattr(feature_map, "stable_query", False) and not stabilized:
        hint = (
            "with denominator_offset != 0 or normalize=False a query row cannot be rescaled "
            "exactly (denominator_offset=0 with normalize=True would stabilize them); "
        )
    return (
        f"query features of feature map {_label(feature_map)} overflow {dtype} (or q holds "
        f"NaN/Inf): {hint}{range_advice(feature_map, dtype)}"
    )


def _key_overflow(feature_map, dtype) -> str:
    return (
        f"key features of feature map {_label(feature_map)} overflow {dtype} (or k holds "
        "NaN/Inf); keys cannot be rescaled exactly (a per-key factor reweights them): "
        f"{range_advice(feature_map, dtype)}"
    )


def _joint_overflow(feature_map, dtype) -> str:
    return (
        f"query or key features of feature map {_label(feature_map)} overflow {dtype} (or q, k "
        f"hold NaN/Inf): {range_advice(feature_map, dtype)}"
    )


def refuse_features(feature_map, phi: torch.Tensor, role: str) -> torch.Tensor:
    """``phi`` (features of ``role`` "query", "query_stabilized" or "key"), refused unless
    every element is finite in its dtype: the public ``FeatureMap.query`` / ``key`` /
    ``query_stabilized`` return no inf or NaN (trig's exp(‖u‖²/2) factor, hybrid_angular's)
    without a word. One reduction; ``refuse_unless`` (no host sync on accelerators)."""
    asynchronous = not checks_on_host(phi)
    if not asynchronous and _all_finite(phi):
        return phi
    if role == "key":
        message = _key_overflow(feature_map, phi.dtype)
    else:
        hint = ""
        if role == "query" and getattr(feature_map, "stable_query", False):
            hint = ("query_stabilized(x) rescales each row exactly where the factor cancels "
                    "(normalized attention with denominator_offset=0); ")  # fmt: skip
        message = (
            f"{role} features of feature map {_label(feature_map)} overflow {phi.dtype} (or x "
            f"holds NaN/Inf): {hint}{range_advice(feature_map, phi.dtype)}"
        )
    refuse_unless(torch.isfinite(phi), message, asynchronous=asynchronous)
    return phi


def _check(feature_map, phi_q, phi_k, *, stabilized, causal, eps, key_padding_mask,
           initial_sums, asynchronous, joint=None) -> None:  # fmt: skip
    """Rules 2 and 3 of the module docstring. ``joint``: φq and φk concatenated along T (one
    decoding step of a symmetric map, no key mask), checked at once; the messages are built
    only on the way to a refusal (on the CPU)."""
    dtype = phi_q.dtype
    if asynchronous is None:
        asynchronous = not checks_on_host(phi_q)
    # On the CPU a finite sum proves rule 2 (``_all_finite``); the rows are tested only when it
    # does not, to name the culprit (a masked key row may still be non-finite).
    both = joint is not None and key_padding_mask is None
    if both and asynchronous:  # one device-side check of both rows (one launch, not two)
        refuse_unless(torch.isfinite(joint), _joint_overflow(feature_map, dtype),
                      asynchronous=True)  # fmt: skip
    elif not (both and _all_finite(joint)):
        if asynchronous or not _all_finite(phi_q):
            ok_q = _rows_ok(phi_q, None)
            refuse_unless(ok_q, _query_overflow(feature_map, dtype, stabilized),
                          asynchronous=asynchronous)  # fmt: skip
        if asynchronous or not _all_finite(phi_k):
            keep = None if key_padding_mask is None else key_padding_mask.expand(phi_k.shape[:-1])
            ok_k = _rows_ok(phi_k, keep)
            refuse_unless(ok_k, _key_overflow(feature_map, dtype), asynchronous=asynchronous)
    if not getattr(feature_map, "stable_query", False) or feature_map.square:
        return
    name, advice = _label(feature_map), range_advice(feature_map, dtype)
    with torch.no_grad():  # a check, not part of the computation
        den, visible = _normalizers(
            phi_q, phi_k, causal=causal, key_padding_mask=key_padding_mask,
            initial_sums=initial_sums,
        )  # fmt: skip
    refuse_unless(
        torch.isfinite(den) | ~visible,
        f"the attention scores of feature map {name} overflow (the normalizer Σ_j φq·φk is not "
        f"finite in {den.dtype}): {advice}",
        asynchronous=asynchronous,
    )
    if stabilized and feature_map.nonnegative:
        tiny = torch.finfo(den.dtype).tiny
        refuse_unless(
            (den >= max(eps, tiny)) | ~visible,
            f"the attention normalizer of feature map {name} underflows: Σ_j φq(q_i)·φk(k_j) "
            f"< eps={eps:g} for some query rows although their features are stabilized, "
            "because the KEY features are too small (exp(−‖k‖²·scale/2) factors), which no "
            f"exact per-token shift can repair; the guard would shrink those outputs: {advice}",
            asynchronous=asynchronous,
        )


def attention_features(
    feature_map,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool,
    eps: float,
    normalize: bool = True,
    denominator_offset: float = 0.0,
    key_padding_mask: torch.Tensor | None = None,
    initial_sums: torch.Tensor | None = None,
    asynchronous: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(φq, φk) for ``linear_attention``, stabilized where exact and checked (module docstring).

    Args:
        feature_map: a ``FeatureMap`` or ``MultiHeadFeatureMap``.
        q: (..., Tq, D), k: (..., Tk, D), as for ``linear_attention``.
        causal, eps, normalize, denominator_offset, key_padding_mask: the values that
            ``linear_attention`` gets (they decide whether queries may be rescaled and which
            keys each query sees).
        initial_sums: (..., F) key sums Σ φk of earlier keys (``LinearAttentionState.
            denominator`` of a non-square map), or None.
        asynchronous: see ``refuse_unless`` (None: by device).

    Returns:
        φq (..., Tq, F) (``query_stabilized`` when normalize and the offset is 0, else
        ``query``) and φk (..., Tk, F) = ``key(k)``, in the input dtype. Raises ValueError
        (CPU) when the rules of the module docstring refuse the inputs.
    """
    offset = check_float(denominator_offset, "denominator_offset")
    eps = check_float(eps, "eps", minimum=0.0)
    stabilized = bool(normalize) and offset == 0.0
    joint = None
    # a FeatureMap's unchecked features: _check below refuses what overflows (masked keys exempt)
    unchecked = getattr(feature_map, "unchecked", None)

    def compute(role, x):
        return unchecked(role, x) if unchecked is not None else getattr(feature_map, role)(x)

    if getattr(feature_map, "symmetric", False) and q.shape == k.shape and q.shape[-2] == 1:
        # one decoding step of a map with φq = φk: both rows in one call
        joint = compute("key", torch.cat([q, k], dim=-2))
        phi_q, phi_k = joint[..., :1, :], joint[..., 1:, :]
    else:
        phi_q = compute("query_stabilized" if stabilized else "query", q)
        phi_k = compute("key", k)
    _check(
        feature_map, phi_q, phi_k, stabilized=stabilized, causal=causal, eps=eps,
        key_padding_mask=key_padding_mask, initial_sums=initial_sums, asynchronous=asynchronous,
        joint=joint,
    )  # fmt: skip
    return phi_q, phi_k
