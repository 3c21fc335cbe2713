"""``AttentionCore``: the one attention core of ``polysketch.nn`` and of converted HF models.

(B, H, T, D) queries and keys, (B, H, T, E) values, a key mask and a decode cache in,
(B, H, T, E) out:

    O_i = Σ_{j visible to i} s_ij v_j / (offset + Σ_{j visible to i} s_ij)

with s_ij one of (``polysketch.nn.spec``'s forms): a feature map's φq(q_i)·φk(k_j) (squared when
the map is ``square``, PolySketchFormer Eq. 2; ``"linear"``, ``ops.linear_attention``);
exact (q_i·k_j)^p inside blocks and the map before them (``"mixed"``, ``ops.mixed_attention``);
exact (q_i·k_j)^p (``"polynomial"``, Eq. 1); softmax (``"softmax"``, offset 0, exp scores
normalized); or either exact kernel over the last w keys only (``"window"``,
``ops.window_attention``). ``KernelAttention`` (projections, short convolution, q/k norm,
RoPE) and the transformers adapter ``PolysketchAttention`` (mask translation, GQA, q/k norm
after the model's RoPE) are subclasses: what differs between them lives there, everything
below is shared. The core owns

* the spec (an ``AttentionSpec``, resolved at the wrappers' edge by ``polysketch.nn.resolve``)
  and the per-head feature maps (``MultiHeadFeatureMap``);
* the precision policy: autocast off inside, q, k, v cast to the operand dtype that
  ``ops.dispatch.operand_dtype`` decides for the working dtype (the autocast dtype when
  autocast is on, else the inputs'; half stays half on accelerators, fp32 on CPU), the output
  cast back to v's dtype;
* the features: ``features.stability.attention_features`` (stabilized queries where exact,
  overflow refusals), never ``feature_map.query`` / ``key`` directly;
* padding (``nn.padding``): padded tokens are removed, so mixed attention's block grid and
  the window start at each row's first real token;
* decoding: ``new_cache`` and ``decode_state_size`` (``nn.cache``); one token of linear
  attention is one fused ``ops.recurrent.linear_attention_token`` (``linear_attention_step``
  without its argument checks), of mixed attention one
  ``ops.mixed_attention_step``;
* mixed attention's learned per-head balance ``log_balance`` (β_h: far-block scores ×
  exp(β_h), i.e. φq × exp(β_h) for plain maps, × exp(β_h/2) for square ones).

``_attend(q, k, v, keep, cache, shard)`` is the single call that receives the post-norm,
post-RoPE q, k, v in the operand dtype. Experiments change what a layer computes by wrapping
it (or ``_global_queries``) on the instance, never through fields of the core: the warm
start's exact attention (``nn.warm_start``), the global-part ablation (``nn.ablate``), the
capture and diagnosis tools. A wrapper without a sequence-shard form carries the reason as
its ``shard_refusal`` attribute (a str), which ``sharding.check_core_on_shard`` raises.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from .._auxiliary import checkpoint as _checkpoint
from .._checks import as_dtype, check_int, check_positive_int
from ..distributed import cp_linear_attention, cp_mixed_attention
from ..features import get_class
from ..features.stability import attention_features
from ..ops import (
    dispatch,
    linear_attention,
    polynomial_attention,
    softmax_attention,
    window_attention,
)
from ..ops.mixed import mixed_attention
from ..ops.naive import DEFAULT_EPS
from ..ops.recurrent import linear_attention_token
from .cache import KVCache, MixedCache, RecurrentCache, WindowCache
from .heads import MultiHeadFeatureMap
from .padding import compaction, gather_time
from .sharding import SequenceShard, check_core_on_shard, window_on_shard
from .spec import AttentionSpec

__all__ = ["AttentionCore", "RECOMPUTED_FORMS", "working_dtype"]


class AttentionCore(nn.Module):
    """The attention core (module docstring): ``attend(q, k, v, keep=, cache=)``.

    Args:
        spec: what it computes, an ``AttentionSpec`` (``polysketch.nn.resolve``: the wrappers
            resolve the user's names at their edge; the core reads the spec only).
        qk_dim: D, the size of queries and keys (the maps' input). num_heads: H.
        value_dim: E (default D); only ``decode_state_size`` needs it.
        causal: causal mask. Mixed, window and decoding need it.
        seed, layer_index: head h's map is seeded with ``head_seed(seed, layer_index, h)``.
        checkpoint: recompute the features and the attention in the backward pass instead of
            keeping them for it (``torch.utils.checkpoint``; PolySketchFormer §4
            rematerialization, as FlashAttention recomputes its scores). ``None`` (default):
            on for the forms that would keep more than their inputs (``RECOMPUTED_FORMS``:
            a map's per-token features, soft_hash's F = 1,920 buckets among them, and the
            window's score band), off for softmax (SDPA keeps O(T)) and polynomial (quadratic
            either way). Values and gradients are the same either way; the memory a training
            step keeps for backward drops to the layer's inputs and outputs
            (``tests/test_nn_memory.py``). Not on a sequence shard (``nn.sharding``).

    With ``spec.learn_balance`` (mixed only) a trainable β_h per head weighs the far blocks,
    initialised so that the layer starts as without it: the map's ``output_scale`` c
    (psf_mixed: 1/√r) moves into β = log(c²) (plain maps) or log(c⁴) (square maps).
    With ``spec.gradient_surrogate`` = λ > 0 (mixed attention without in-block scores,
    ``local="none"``, only): in training, λ·(o_lin − sg(o_lin)) is added to the output, o_lin
    the same attention with the linear kernel 1 + cos(q, k) (features (1, q/‖q‖), values
    detached; ``_gradient_surrogate``). Its value is exactly 0, so the layer computes what it
    computes without it, and decoding, the state and every output are unchanged; its gradient
    reaches q and k from every earlier key, as softmax's does near init (≈ 1 + q·k/√D), where
    a sharp map passes none between a query and a key that share no bucket.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        *,
        qk_dim: int,
        num_heads: int,
        value_dim: int | None = None,
        causal: bool = True,
        seed: int = 0,
        layer_index: int = 0,
        checkpoint: bool | None = None,
    ):
        super().__init__()
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
        self.qk_dim = check_positive_int(qk_dim, "qk_dim")
        self.num_heads = check_positive_int(num_heads, "num_heads")
        value_dim = self.qk_dim if value_dim is None else value_dim
        self.value_dim = check_positive_int(value_dim, "value_dim")
        self.causal = _check_bool(causal, "causal")
        self.checkpoint = None if checkpoint is None else _check_bool(checkpoint, "checkpoint")
        self.seed = check_int(seed, "seed", minimum=0)
        self.layer_index = check_int(layer_index, "layer_index", minimum=0)
        if spec.needs_causal and not self.causal:
            raise ValueError(f"attention={spec.name!r} ({spec.form} attention) needs causal=True")
        self.spec = spec
        # the q/k LayerNorms (spec.qk_norm) are built and applied by the subclasses, where
        # their architecture puts them; their slots come first (state_dict order)
        self.register_module("q_norm", None)
        self.register_module("k_norm", None)
        self.feature_map = None
        self.log_balance = None
        kwargs, c = dict(spec.map_kwargs), 1.0
        if spec.learn_balance and get_class(spec.feature_map).takes("output_scale"):
            c = float(kwargs.pop("output_scale", 1.0))  # moves into the balance
        if spec.feature_map is not None:
            self.feature_map = MultiHeadFeatureMap(
                spec.feature_map, self.qk_dim, self.num_heads, seed=self.seed,
                layer_index=self.layer_index, **kwargs,
            )  # fmt: skip
        if spec.learn_balance:
            beta = math.log(c) * (4 if self.feature_map.square else 2)
            self.log_balance = nn.Parameter(torch.full((self.num_heads,), beta))

    # ----- the spec, read ----------------------------------------------------------------------
    @property
    def attention(self) -> str:
        """The name the spec was resolved from (a preset or a feature map)."""
        return self.spec.name

    @property
    def form(self) -> str:
        """``spec.form``: "linear", "mixed", "window", "softmax" or "polynomial"."""
        return self.spec.form

    @property
    def degree(self) -> int:
        return self.spec.degree

    @property
    def chunk_size(self) -> int:
        """``spec.chunk_size``: block b of the block algorithm and of the mixed blocks."""
        return self.spec.chunk_size

    @property
    def denominator_offset(self) -> float:
        return self.spec.denominator_offset

    @property
    def window(self) -> int | None:
        return self.spec.window

    @property
    def softmax_scale(self) -> float | None:
        return self.spec.softmax_scale

    @property
    def gradient_surrogate(self) -> float:
        return self.spec.gradient_surrogate

    def recomputes(self, shard=None) -> bool:
        """Whether this call recomputes its attention in the backward pass (``checkpoint``):
        only while autograd records, not on a sequence shard (the recomputation would repeat
        the collectives), and by default for ``RECOMPUTED_FORMS``."""
        if not torch.is_grad_enabled() or shard is not None:
            return False
        return self.form in RECOMPUTED_FORMS if self.checkpoint is None else self.checkpoint

    # ----- decoding state --------------------------------------------------------------------
    @property
    def cache_type(self) -> type:
        """The class of ``new_cache()``'s caches."""
        return _CACHE_TYPES[self.form]

    def new_cache(self) -> RecurrentCache | KVCache | MixedCache | WindowCache:
        """An empty decode cache for this core (see ``polysketch.nn.cache``)."""
        if not self.causal:
            raise ValueError("decoding caches need causal=True")
        if self.form == "linear":
            return RecurrentCache()
        if self.form == "mixed":
            far = self.spec.local == "none"  # the current block keeps raw keys (D, not F)
            return MixedCache(self.chunk_size, self.feature_map.square, local=self.spec.local,
                              key_features=self._key_features if far else None)  # fmt: skip
        if self.form == "window":
            return WindowCache(self.window)
        return KVCache()

    def decode_state_size(self, seq_len: int) -> int:
        """Floats this core's cache holds per sequence after ``seq_len`` tokens.

        Linear: H·F'·(E + 1) with F' = F(⌊F/2⌋+1) (square: the pair layout of ``ops.state``)
        or F, constant; KV cache: H·(D + E)·t; window: H·(D + E)·min(t, w);
        mixed: H·F'·(E + 1) once a block is complete + H·(t mod b)·(D + E + F), or
        H·(t mod b)·(D + E) without in-block scores (the current block's raw keys, featurized
        when it completes: ``ops.mixed_step.far_attention_token``).
        """
        t = check_int(seq_len, "seq_len", minimum=0)
        h, d, e = self.num_heads, self.qk_dim, self.value_dim
        if self.form in ("softmax", "polynomial"):
            return h * (d + e) * t
        if self.form == "window":
            return h * (d + e) * min(t, self.window)
        state = h * self.feature_map.state_dim * (e + 1)
        if self.form == "linear":
            return state if t else 0
        per_token = d + e + (0 if self.spec.local == "none" else self.feature_map.feature_dim)
        local = h * (t % self.chunk_size) * per_token
        return (state if t >= self.chunk_size else 0) + local

    @torch.no_grad()
    def redraw_feature_map_(self, generator: torch.Generator | None = None) -> None:
        """Redraw the per-head random feature maps (no-op without one)."""
        if self.feature_map is not None:
            self.feature_map.redraw_(generator)

    # ----- the computation -------------------------------------------------------------------
    def forward(self, q, k, v, *, keep=None, cache=None, shard=None) -> torch.Tensor:
        """Alias of ``attend``."""
        return self.attend(q, k, v, keep=keep, cache=cache, shard=shard)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        keep: torch.Tensor | None = None,
        cache=None,
        shard: SequenceShard | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """q (B, H, Tq, D), k (B, H, Tk, D), v (B, H, Tk, E) -> (B, H, Tq, E), v's dtype: the
        one attention call of every context.

        ``keep``: bool (B, Tk), True = real token (padded keys are removed, ``nn.padding``).
        ``cache``: a ``new_cache()`` object (q, k, v are then the next tokens, Tq = Tk, and
        the cache is updated in place) or None (queries aligned with the last keys).
        ``shard``: q, k, v are this rank's positions of a longer sequence and/or packed
        documents (``nn.sharding.SequenceShard``; the context-parallel and packed ops of
        ``polysketch.distributed`` / ``ops.varlen``); not with a cache.
        ``dtype``: the working dtype (default ``working_dtype(q, v)``), from which
        ``ops.dispatch.operand_dtype`` decides the operands.
        """
        if keep is not None and (keep.dtype != torch.bool or keep.dim() != 2
                                 or tuple(keep.shape) != (k.shape[0], k.shape[-2])):  # fmt: skip
            raise ValueError(
                f"keep must be a bool (B, Tk) = {(k.shape[0], k.shape[-2])} key mask, got "
                f"{getattr(keep, 'dtype', type(keep).__name__)} {tuple(getattr(keep, 'shape', ()))}"
            )
        if shard is not None:
            if cache is not None:
                raise ValueError("cache is not supported with a sequence shard (context "
                                 "parallelism / packing)")  # fmt: skip
            check_core_on_shard(self, shard)
        device = q.device.type
        work = working_dtype(q, v) if dtype is None else dtype
        out_dtype = v.dtype
        autocast = torch.is_autocast_enabled(device)
        with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
            od = dispatch.operand_dtype(work, q.device)  # half stays half on accelerators
            q, k, v = as_dtype(q, od), as_dtype(k, od), as_dtype(v, od)
            o = self._attend(q, k, v, keep, cache, shard)
        return as_dtype(o, out_dtype)

    def _attend(self, q, k, v, keep, cache, shard=None) -> torch.Tensor:
        """The form on (B, H, T, ·) tensors in the operand dtype (module docstring)."""
        if self.form == "linear":
            return self._linear(q, k, v, keep, cache, shard)
        if self.form == "mixed":
            return self._mixed(q, k, v, keep, cache, shard)
        if self.form == "window":
            return self._window(q, k, v, keep, cache, shard)
        return self._exact(q, k, v, keep, cache)

    def _exact(self, q, k, v, keep, cache) -> torch.Tensor:
        """softmax / polynomial over every visible key (KV cache when decoding)."""
        if cache is not None:
            k, v, keep = cache.append(k, v, keep)
        kpm = None if keep is None else keep.unsqueeze(1)  # (B, 1, Tk) against (B, H, Tk, .)
        if self.form == "polynomial":
            return polynomial_attention(q, k, v, degree=self.degree, causal=self.causal,
                denominator_offset=self.denominator_offset, key_padding_mask=kpm)  # fmt: skip
        scale = self.softmax_scale
        if kpm is None and (q.shape[-2] == k.shape[-2] or q.shape[-2] == 1):
            if self.causal and q.shape[-2] > 1:  # a branch (a guard under compile), so a bool
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        return softmax_attention(q, k, v, causal=self.causal, scale=scale, key_padding_mask=kpm)

    def _key_features(self, k: torch.Tensor) -> torch.Tensor:
        """φk of keys (B, H, n, D) as mixed attention makes them (no query rescaling)."""
        return self._features(k, k, None, normalize=False)[1]

    def _features(self, q, k, kpm, *, normalize=True, initial_sums=None):
        """(φq, φk) by ``attention_features`` (stabilized queries only where exact)."""
        return attention_features(
            self.feature_map, q, k, causal=self.causal, eps=DEFAULT_EPS, normalize=normalize,
            denominator_offset=self.denominator_offset, key_padding_mask=kpm,
            initial_sums=None if self.feature_map.square else initial_sums,
        )  # fmt: skip

    def _linear(self, q, k, v, keep, cache, shard=None) -> torch.Tensor:
        fm, kpm = self.feature_map, None if keep is None else keep.unsqueeze(1)
        kw = dict(square=fm.square, denominator_offset=self.denominator_offset,
                  key_padding_mask=kpm)  # fmt: skip
        if shard is not None:  # the rank's shard and/or packed documents
            phi_q, phi_k = self._features(q, k, kpm)
            cu = None if shard.cu_seqlens is None else list(shard.cu_seqlens)
            kw |= dict(chunk_size=self.chunk_size, cu_seqlens=cu)
            if shard.group is None:
                return linear_attention(phi_q, phi_k, v, causal=True, **kw)
            return cp_linear_attention(phi_q, phi_k, v, group=shard.group, **kw)
        state = None if cache is None else cache.state
        if state is not None and q.shape[-2] == 1:  # one token: one fused update and read
            phi_q, phi_k = self._features(q, k, kpm, initial_sums=state.denominator)
            out, cache.state = linear_attention_token(phi_q, phi_k, v, state, **kw)
            cache.length += 1
            return out

        def run(q, k, v):
            sums = None if state is None else state.denominator
            phi_q, phi_k = self._features(q, k, kpm, initial_sums=sums)
            return linear_attention(phi_q, phi_k, v, causal=self.causal, chunk_size=self.chunk_size,
                                    initial_state=state, return_state=cache is not None,
                                    **kw)  # fmt: skip

        if cache is not None:
            out, cache.state = run(q, k, v)
            cache.length += q.shape[-2]
            return out
        if self.recomputes():
            return _checkpoint(run, q, k, v)
        return run(q, k, v)

    def _mixed_op(self, q, k, v, phi_q, phi_k, *, local, square, shard=None) -> torch.Tensor:
        """``ops.mixed_attention`` of this core's blocks, or ``cp_mixed_attention`` over the
        ranks of ``shard``'s group."""
        kw = dict(chunk_size=self.chunk_size, local=local, degree=self.degree, square=square,
                  denominator_offset=self.denominator_offset)  # fmt: skip
        if shard is None:
            return mixed_attention(q, k, v, phi_q, phi_k, **kw)
        return cp_mixed_attention(q, k, v, phi_q, phi_k, group=shard.group, **kw)

    def _global_queries(self, phi_q: torch.Tensor) -> torch.Tensor:
        """φq of the far blocks: × exp(β_h) (exp(β_h/2) for square maps)."""
        if self.log_balance is None:
            return phi_q
        power = 0.5 if self.feature_map.square else 1.0
        beta = self.log_balance
        factor = (beta.to(torch.promote_types(beta.dtype, torch.float32)) * power).exp()
        factor = factor.to(phi_q.dtype)
        return phi_q * factor.view(self.num_heads, 1, 1)

    def _mixed(self, q, k, v, keep, cache, shard=None) -> torch.Tensor:
        fm = self.feature_map
        if cache is None and q.shape[-2] != k.shape[-2]:
            raise ValueError(
                "mixed attention needs as many queries as keys without its own cache (decode "
                "with new_cache(), or PolysketchCache in a converted transformers model)"
            )

        def features(q, k, v, keep):
            kpm = None if keep is None else keep.unsqueeze(1)
            phi_q, phi_k = self._features(q, k, kpm, normalize=False)  # no query rescaling:
            phi_q = self._global_queries(phi_q)  # the local scores share the normalizer
            if keep is not None:  # a zero key has κ = 0 and no features: it drops out
                m = keep[:, None, :, None]
                k, phi_k, v = (torch.where(m, x, x.new_zeros(())) for x in (k, phi_k, v))
            return phi_q, k, phi_k, v

        if cache is not None and cache.length > 0:
            phi_q, k, phi_k, v = features(q, k, v, keep)
            return cache.steps(q, k, v, phi_q, phi_k, keep, degree=self.degree,
                               offset=self.denominator_offset, eps=DEFAULT_EPS)  # fmt: skip
        perm = inverse = None
        if keep is not None:  # each row's block grid starts at its first real token
            perm, inverse = compaction(keep)
            q, k, v = (gather_time(x, perm, dim=-2) for x in (q, k, v))
            keep = keep.gather(-1, perm)

        def run(q, k, v):
            surrogate = self.gradient_surrogate and torch.is_grad_enabled() and cache is None
            q_in, k_in, v_in = q, k, v
            phi_q, k, phi_k, v = features(q, k, v, keep)
            out = self._mixed_op(q, k, v, phi_q, phi_k, local=self.spec.local,
                                 square=fm.square, shard=shard)  # fmt: skip
            if surrogate:
                out = out + self._gradient_surrogate(q_in, k_in, v_in, keep, shard)
            return out, k, phi_k, v

        if shard is not None:  # a rank's shard: no padding, no cache (check_core_on_shard)
            return run(q, k, v)[0]
        if cache is None and self.recomputes():
            out = _checkpoint(lambda *x: run(*x)[0], q, k, v)
        else:
            out, k, phi_k, v = run(q, k, v)
        if cache is not None:  # prefill: keep the completed blocks' state and the rest
            lengths = None if keep is None else keep.sum(-1).tolist()
            cache.prefill(k, phi_k, v, lengths)
        return out if inverse is None else gather_time(out, inverse, dim=-2)

    def surrogate_features(self, q: torch.Tensor, k: torch.Tensor) -> tuple:
        """The features (1, x/‖x‖) of the gradient surrogate's kernel 1 + cos(q, k):
        (B, H, T, D) -> (B, H, T, D + 1) each (``__init__``)."""

        def unit(x):
            return torch.cat([torch.ones_like(x[..., :1]), F.normalize(x, dim=-1)], dim=-1)

        return unit(q), unit(k)

    def _gradient_surrogate(self, q, k, v, keep, shard=None) -> torch.Tensor:
        """λ·(o_lin − sg(o_lin)): 0 in value; the gradient of the same far-block attention with
        the kernel 1 + cos(q, k), values detached (``__init__``). q, k (B, H, T, D), v (B, H,
        T, E), keep (B, T) or None -> (B, H, T, E)."""
        lin_q, lin_k = self.surrogate_features(q, k)
        v = v.detach()
        if keep is not None:  # padded keys drop out, as in the attention itself
            m = keep[:, None, :, None]
            lin_k, v = (torch.where(m, x, x.new_zeros(())) for x in (lin_k, v))
        o = self._mixed_op(q, k, v, lin_q, lin_k, local="none", square=False, shard=shard)
        return self.gradient_surrogate * (o - o.detach())

    def window_options(self) -> dict:
        """The keywords of ``ops.window_attention`` for this (window) core: kernel, scale,
        degree, denominator_offset (also used on sequence shards, ``nn.sharding``)."""
        kernel = self.spec.window_kernel
        return dict(kernel=kernel, scale=self.softmax_scale if kernel == "softmax" else None,
                    degree=self.degree, denominator_offset=self.denominator_offset)  # fmt: skip

    def _window(self, q, k, v, keep, cache, shard=None) -> torch.Tensor:
        if shard is not None:  # the w - 1 keys before the shard come from the previous rank
            return window_on_shard(self, q, k, v, shard)
        kw = self.window_options()
        kernel, scale = kw["kernel"], kw["scale"]
        if cache is not None and cache.length > 0:  # one token at a time
            outs = []
            for i in range(q.shape[-2]):
                one = (x[..., i : i + 1, :] for x in (q, k, v))
                step_keep = None if keep is None else keep[:, i : i + 1]
                outs.append(self._window_step(*one, step_keep, cache, kernel, scale))
            return torch.cat(outs, dim=-2)
        inverse = None
        if keep is not None:  # the window counts real tokens only
            perm, inverse = compaction(keep)
            q, k, v = (gather_time(x, perm, dim=-2) for x in (q, k, v))
            keep = keep.gather(-1, perm)
        kpm = None if keep is None else keep.unsqueeze(1)

        def run(q, k, v):
            return window_attention(q, k, v, window=self.window, key_padding_mask=kpm, **kw)

        out = _checkpoint(run, q, k, v) if self.recomputes() else run(q, k, v)
        if cache is not None:
            cache.prefill(k, v, None if keep is None else keep.sum(-1))
        return out if inverse is None else gather_time(out, inverse, dim=-2)

    def _window_step(self, q, k, v, keep, cache, kernel, scale) -> torch.Tensor:
        """One new token against the window cache (the new key included)."""
        ks, vs, visible = cache.append(k, v, keep)
        kpm = None if visible is None else visible.unsqueeze(1)
        if kernel == "softmax":
            if kpm is None:  # one query, every key visible: one SDPA call
                return F.scaled_dot_product_attention(q, ks, vs, scale=scale)
            return softmax_attention(q, ks, vs, causal=False, scale=scale, key_padding_mask=kpm)
        return polynomial_attention(q, ks, vs, degree=self.degree, causal=False,
                                    denominator_offset=self.denominator_offset,
                                    key_padding_mask=kpm)  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"attention={self.attention!r}, form={self.form!r}, "
            f"num_heads={self.num_heads}, qk_dim={self.qk_dim}, causal={self.causal}, "
            f"chunk_size={self.chunk_size}, denominator_offset={self.denominator_offset:g}, "
            f"layer_index={self.layer_index}"
            + (f", window={self.window}" if self.window is not None else "")
        )


RECOMPUTED_FORMS = frozenset({"linear", "mixed", "window"})
"""Forms whose attention keeps more than its inputs for backward: recomputed by default."""

_CACHE_TYPES = {"linear": RecurrentCache, "mixed": MixedCache, "window": WindowCache,
                "softmax": KVCache, "polynomial": KVCache}  # fmt: skip


def working_dtype(q: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The dtype attention is meant to run in: autocast's when it is on for q's device (a
    LayerNorm under autocast returns fp32, which must not decide), else that of q and v."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(q.dtype, v.dtype)


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value
