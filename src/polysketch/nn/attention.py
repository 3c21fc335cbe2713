"""``KernelAttention``: multi-head self-attention with any kernel of polysketch.

For x (B, T, E) with H heads of size D = E/H (PolySketchFormer §4):

    [Q K V] = x W_qkv,   Q, K -> (B, H, T, D_qk), V -> (B, H, T, D)
    [Q K V] <- SiLU(causal depthwise conv_K([Q K V]))   (short_conv = K; ``nn.short_conv``)
    Q, K <- LayerNorm(Q), LayerNorm(K)            (qk_norm; per head, over D)
    Q, K <- RoPE(Q, t), RoPE(K, t)                 (rope; t the position: real tokens
                                                    counted, ``polysketch.nn.padding``)
    O    = attention(Q, K, V)                      (B, H, T, D)  ``AttentionCore``
    out  = concat_h(O) W_out                       (B, T, E)

with ``attention`` one of ``polysketch.nn.presets`` (a feature map φ, linear time by
``polysketch.ops.linear_attention``; ``psf_mixed`` or ``mixed=True``: exact (Q_i·K_j)^p inside
blocks and the map before them; ``polynomial``; ``softmax``; ``sliding_window``), computed by
the one attention core ``polysketch.nn.core.AttentionCore``, which this class extends with
the projections, the short convolution, the q/k norm and RoPE. The core owns the precision
policy (projections follow autocast; the attention runs with autocast off in the operand
dtype of ``ops.dispatch``: half stays half on accelerators, fp32 on CPU), the caches and
the rest (see there).

The q/k LayerNorm comes before RoPE (so RoPE(q)·RoPE(k) still depends on relative positions
only); the public PolySketchFormer code, and the transformers adapter, apply it after.
Padding: a row computes at its real tokens what it computes with its pads removed (pads
anywhere; ``polysketch.nn.padding``), decoding included.
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_int, check_positive_int, check_tensor, compute_dtype
from .core import AttentionCore, working_dtype
from .padding import real_positions
from .resolve import as_spec, split_options
from .rope import RotaryEmbedding
from .sharding import SequenceShard, check_core_on_shard, shard_short_conv
from .short_conv import ShortConv
from .spec import AttentionSpec

__all__ = ["KernelAttention"]


class KernelAttention(AttentionCore):
    """Batch-first multi-head self-attention (as torch.nn.MultiheadAttention): (B, T, E) -> same.

    Args:
        embed_dim: E, divisible by ``num_heads``. num_heads: H; head dim D = E / H.
        qk_dim: D_qk, the per-head size of queries and keys (default D): the feature maps'
            input dim. BASED projects q and k to 16 dims so that its degree-2 Taylor map
            stays small (1 + 16 + 256 features) while values keep D.
        value_dim: D_v, the per-head size of values (default D): the output projection reads
            H·D_v. A head's decode state is F′·(D_v + 1), so a wide feature map can keep a
            state budget with narrower values (``TransformerConfig.value_dim``).
        short_conv: K ≥ 2 puts a causal depthwise convolution of K taps + SiLU on the
            projected q, k, v (BASED / Zoology / fla; ``polysketch.nn.short_conv``); 0 = off.
        attention: a preset (``psf_random``, ``psf_learned``, ``psf_mixed``, ``polynomial``,
            ``softmax``, ``sliding_window``) or any ``polysketch.features.available()`` name
            (default ``"polysketch"``, i.e. the psf_random sketch), resolved here with the
            options (``polysketch.nn.resolve.resolve_attention``); or an ``AttentionSpec``
            resolved already (no option may then be given beside it).
        causal: causal mask (decoder). Mixed attention, the window and decoding need it.
        rope: rotary position embeddings on q and k.
        bias: biases in the q/k/v and output projections.
        seed: base seed of the per-head feature maps; head h of layer ``layer_index`` uses
            ``polysketch.nn.heads.head_seed(seed, layer_index, h)``.
        layer_index: index of this layer in the model (seed derivation only).
        checkpoint: recompute features and attention in the backward pass (PolySketchFormer
            §4 rematerialization): ``None`` (default) for the linear, mixed and window forms,
            True / False to force it (``AttentionCore``).
        projections: own the q/k/v and output projections (and the short convolution).
            ``False``: a branch that attends with another layer's projections
            (``attend_projected``; ``TransformerConfig.local_shared``); ``forward`` then
            raises.
        **options: the attention options (``polysketch.nn.ATTENTION_OPTIONS``, the option
            fields of ``AttentionSpec``; None = the attention's default): ``qk_norm``
            (LayerNorm with affine on q and k per head; on for polynomial maps and presets
            except softmax), ``chunk_size`` (block b of the block algorithm and of the mixed
            blocks, default 64), ``denominator_offset`` (1 for polynomial maps and presets:
            PolySketchFormer's 1 + Σ), ``mixed`` (exact local (q·k)^degree blocks and the map
            before them; ``psf_mixed`` is this with the psf_random sketch), ``learn_balance``
            (mixed: a learned per-head balance β_h), ``gradient_surrogate`` (λ of the
            training-only gradient of attention without in-block scores), ``window`` (w of
            ``sliding_window``), ``softmax_scale``; every other keyword goes to the feature
            map (overriding the preset's).

    ``hybrid_clustered`` needs its clusters first: ``layer.feature_map.fit_(q, k)`` with
    sample per-head queries/keys (B, H, T, D); until then its forward raises RuntimeError.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        attention: str | AttentionSpec = "polysketch",
        causal: bool = True,
        rope: bool = True,
        bias: bool = False,
        seed: int = 0,
        layer_index: int = 0,
        checkpoint: bool | None = None,
        qk_dim: int | None = None,
        value_dim: int | None = None,
        short_conv: int = 0,
        projections: bool = True,
        **options,
    ):
        embed_dim = check_positive_int(embed_dim, "embed_dim")
        num_heads = check_positive_int(num_heads, "num_heads")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        head_dim = embed_dim // num_heads
        qk_dim = head_dim if qk_dim is None else check_positive_int(qk_dim, "qk_dim")
        value_dim = head_dim if value_dim is None else check_positive_int(value_dim, "value_dim")
        short_conv = check_int(short_conv, "short_conv", minimum=0)
        if short_conv == 1:
            raise ValueError("short_conv must be 0 (off) or a kernel size >= 2, got 1")
        for name, value in (("rope", rope), ("bias", bias), ("projections", projections)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
        opts, _, map_kwargs = split_options(options)
        opts = {k: v for k, v in opts.items() if v is not None}  # None: not given
        spec = as_spec(attention, qk_dim, map_kwargs, opts)
        super().__init__(
            spec, qk_dim=qk_dim, num_heads=num_heads, value_dim=value_dim, causal=causal,
            seed=seed, layer_index=layer_index, checkpoint=checkpoint,
        )  # fmt: skip
        self.embed_dim, self.head_dim, self.short_conv = embed_dim, head_dim, short_conv
        e, h = self.embed_dim, self.num_heads
        self._split = (h * self.qk_dim, h * self.qk_dim, h * self.value_dim)  # q, k, v of qkv
        if not projections and short_conv:
            raise ValueError("short_conv needs projections=True (the convolution is part of "
                             "the projections a shared branch does not own)")  # fmt: skip
        self.qkv = nn.Linear(e, sum(self._split), bias=bias) if projections else None
        self.conv = ShortConv(sum(self._split), self.short_conv) if self.short_conv else None
        self.out_proj = nn.Linear(h * self.value_dim, e, bias=bias) if projections else None
        self.q_norm = nn.LayerNorm(self.qk_dim) if self.spec.qk_norm else None
        self.k_norm = nn.LayerNorm(self.qk_dim) if self.spec.qk_norm else None
        self.rotary = RotaryEmbedding(self.qk_dim) if rope else None

    def value_weight(self) -> torch.Tensor:
        """The value rows of ``qkv``'s weight, (H·D_v, E): a view (writes reach ``qkv``).
        ValueError for a layer without projections (a shared branch reads another's)."""
        if self.qkv is None:
            raise ValueError("this attention has no projections (projections=False)")
        return self.qkv.weight[self._split[0] + self._split[1] :]

    def decode_state_size(self, seq_len: int) -> int:
        """Floats this layer's cache holds per sequence after ``seq_len`` tokens: the core's
        (``AttentionCore.decode_state_size``) plus, with a short convolution of K taps, the
        last K - 1 projections (K - 1)·H·(2·D_qk + D_v)."""
        t = check_int(seq_len, "seq_len", minimum=0)
        conv = min(t, self.short_conv - 1) * sum(self._split) if self.short_conv else 0
        return super().decode_state_size(t) + conv

    # ----- forward ---------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        cache=None,
        shard: SequenceShard | None = None,
    ) -> torch.Tensor:
        """x (B, T, E) -> (B, T, E).

        ``key_padding_mask``: bool (B, T), True = keep (torch SDPA's boolean convention);
        padded tokens are removed (``polysketch.nn.padding``: anywhere in the row; positions
        count real tokens; their own outputs are meaningless).
        ``cache``: a ``new_cache()`` object; x are then the next T tokens after the
        ``cache.length`` already consumed (RoPE positions continue), the cache is updated in
        place, and the output equals that of the full sequence at those positions.
        ``shard``: x holds positions [start, start + T) of a longer sequence on a context-
        parallel rank and/or packed documents (``polysketch.nn.sharding.make_shard``): RoPE,
        the short convolution and the attention follow the whole sequence (and restart at
        each document); with a key padding mask (linear attentions on a cp shard) padding
        is removal across ranks as on one process; refused with a cache.
        """
        if self.qkv is None:
            raise RuntimeError("this branch has no projections of its own (projections="
                               "False): call attend_projected with its layer's q/k/v")  # fmt: skip
        x = check_tensor(x, "x", min_dim=3)
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must have shape (B, T, E={self.embed_dim}), got {tuple(x.shape)}")
        o = self._attend_qkv(self.qkv(x), key_padding_mask, cache, shard)
        return self.out_proj(self.merge_heads(o))

    def attend_projected(
        self,
        qkv: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        cache=None,
        shard: SequenceShard | None = None,
    ) -> torch.Tensor:
        """The attention of ``forward`` from its projection: qkv = x W_qkv (B, T, H·(2·D_qk +
        D_v)) -> the heads' outputs O (B, H, T, D_v), before the output projection (short
        convolution, q/k norm, RoPE and the core run here; the arguments as ``forward``'s).
        Two branches of one layer that share their projections call it on the same qkv
        (``TransformerConfig.local_shared``)."""
        qkv = check_tensor(qkv, "qkv", min_dim=3)
        if qkv.dim() != 3 or qkv.shape[-1] != sum(self._split):
            raise ValueError(f"qkv must have shape (B, T, {sum(self._split)}), got "
                             f"{tuple(qkv.shape)}")  # fmt: skip
        return self._attend_qkv(qkv, key_padding_mask, cache, shard)

    def _attend_qkv(self, qkv, key_padding_mask, cache, shard) -> torch.Tensor:
        """``attend_projected`` for a qkv of the right shape (``forward`` made it itself):
        short convolution -> heads -> q/k norm -> RoPE -> the core's one attention call, in
        every context (a cache, padding, a sequence shard)."""
        b, t, _ = qkv.shape
        keep = key_padding_mask
        if keep is not None:
            if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
                raise TypeError("key_padding_mask must be a bool tensor (True = keep)")
            if tuple(keep.shape) != (b, t):
                raise ValueError(
                    f"key_padding_mask must have shape (B, T) = {(b, t)}, got {tuple(keep.shape)}"
                )
        if cache is not None:
            if not self.causal:
                raise ValueError("cache needs causal=True")
            expected = self.cache_type
            if not isinstance(cache, expected):
                raise TypeError(f"cache must be a {expected.__name__} (from new_cache())")
        if shard is not None:
            self._check_shard(qkv, shard, keep, cache)
        if self.conv is not None:
            if shard is not None:
                qkv = shard_short_conv(self.conv, qkv, shard, keep)
            else:
                tail = None if cache is None or cache.length == 0 else cache.conv_tail
                qkv, new_tail = self.conv(qkv, keep=keep, tail=tail)
                if cache is not None:
                    cache.conv_tail = new_tail
        q, k, v = (self._heads(part) for part in qkv.split(self._split, dim=-1))
        work = working_dtype(q, v)  # before the norm and RoPE change q's dtype
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:  # rotated in the accumulation dtype
            acc = compute_dtype(torch.promote_types(q.dtype, v.dtype))
            q, k = self._rotate(q.to(acc), k.to(acc), keep, cache, shard)
        elif cache is not None:
            self._advance_positions(keep, cache, t)
        return self.attend(q, k, v, keep=keep, cache=cache, shard=shard, dtype=work)

    @staticmethod
    def merge_heads(o: torch.Tensor) -> torch.Tensor:
        """(B, H, T, D) -> (B, T, H·D), the output projection's input."""
        return o.transpose(1, 2).flatten(2)

    def _heads(self, part: torch.Tensor) -> torch.Tensor:
        """(B, T, H·D) -> (B, H, T, D), a view (plain torch: einops costs ~10 µs a call, which
        a one-token decoding step feels four times per layer)."""
        return part.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

    def _check_shard(self, qkv, shard: SequenceShard, keep, cache) -> None:
        """Refuse what a sequence shard cannot take (``polysketch.nn.sharding``)."""
        if not isinstance(shard, SequenceShard):
            raise TypeError(f"shard must be a SequenceShard (make_shard), got {type(shard)}")
        if cache is not None:
            raise ValueError("cache is not supported with a sequence shard (context "
                             "parallelism / packing)")  # fmt: skip
        if (keep is None) != (shard.real_before is None):
            raise ValueError("key_padding_mask: pass the same mask to make_shard(keep=)")
        if qkv.shape[1] != shard.length:
            raise ValueError(f"x holds {qkv.shape[1]} tokens, the shard {shard.length}")
        check_core_on_shard(self, shard)

    def _rotate(self, q, k, keep, cache, shard=None):
        """RoPE at each token's position: t (+ the tokens consumed), or per row counting real
        tokens only when there is padding (``nn.padding``); on a sequence shard, the global
        position (of real tokens, those of earlier shards included) or, packed, the position
        in the token's document."""
        if shard is not None:
            if keep is not None:
                before = torch.tensor(shard.real_before, device=q.device)
                return self.rotary.rotate(q, k, positions=real_positions(keep, before))
            if shard.cu_seqlens is None:
                return self.rotary.rotate(q, k, offset=shard.start)
            pos = shard.positions(q.device).expand(q.shape[0], -1)
            return self.rotary.rotate(q, k, positions=pos)
        start = 0 if cache is None else cache.length
        per_row = None if cache is None else cache.positions
        if keep is None and per_row is None:
            if cache is not None:
                self._advance_positions(keep, cache, q.shape[-2])
            return self.rotary.rotate(q, k, offset=start)
        if keep is None:
            pos = per_row[:, None] + torch.arange(q.shape[-2], device=q.device)
        else:
            pos = real_positions(keep, start if per_row is None else per_row)
        if cache is not None:
            self._advance_positions(keep, cache, q.shape[-2])
        return self.rotary.rotate(q, k, positions=pos)

    @staticmethod
    def _advance_positions(keep, cache, t: int) -> None:
        """The next token's position per row after these ``t`` (``cache.positions``)."""
        if keep is None:
            if cache.positions is not None:
                cache.positions = cache.positions + t
            return
        start = cache.positions if cache.positions is not None else cache.length
        cache.positions = start + keep.sum(-1)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"attention={self.attention!r}, causal={self.causal}, qk_dim={self.qk_dim}, "
            + (f"value_dim={self.value_dim}, " if self.value_dim != self.head_dim else "")
            + f"short_conv={self.short_conv}, "
            f"chunk_size={self.chunk_size}, denominator_offset={self.denominator_offset:g}, "
            f"layer_index={self.layer_index}"
            + (f", form={self.form!r}" if self.form == "mixed" else "")
            + (f", window={self.window}" if self.window is not None else "")
        )
