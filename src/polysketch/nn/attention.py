"""``KernelAttention``: multi-head self-attention with any kernel of polysketch.

For x (B, T, E) with H heads of size D = E/H (PolySketchFormer §4):

    [Q K V] = x W_qkv,   Q, K -> (B, H, T, D_qk), V -> (B, H, T, D)
    [Q K V] <- SiLU(causal depthwise conv_K([Q K V]))   (short_conv = K; ``nn.short_conv``)
    Q, K <- LayerNorm(Q), LayerNorm(K)            (qk_norm; per head, over D)
    Q, K <- RoPE(Q, t), RoPE(K, t)                 (rope; t the absolute position)
    O    = attention(Q, K, V)                      (B, H, T, D)
    out  = concat_h(O) W_out                       (B, T, E)

with ``attention`` one of (see ``polysketch.nn.presets``):

* a feature map φ (per-head independent maps, ``MultiHeadFeatureMap``):
  O_i = Σ_{j≤i} s_ij V_j / (offset + Σ_{j≤i} s_ij), s_ij = φq(Q_i)·φk(K_j) (squared when the
  map is ``square``, Eq. 2), linear time by ``polysketch.ops.linear_attention``;
* ``"psf_mixed"``: exact (Q_i·K_j)^4 inside blocks, sketch scores before (``ops.mixed``);
* ``"polynomial"``: exact (Q_i·K_j)^4 (Eq. 1), ``"softmax"``: softmax(QKᵀ/√D) (quadratic).

The q/k LayerNorm comes before RoPE (so RoPE(q)·RoPE(k) still depends on relative positions
only); the public PolySketchFormer code applies it after. Precision: projections follow
autocast; the attention core runs with autocast disabled on q, k, v in the operand dtype
(``ops.dispatch.operand_dtype``): on accelerators bf16/fp16 stay half, so softmax runs
FlashAttention through SDPA and the linear ops use tensor cores while keeping states and
normalizers in fp32; on CPU half inputs are computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from .._checks import check_float, check_int, check_positive_int, check_tensor
from .._checks import compute_dtype as _compute_dtype
from ..ops import linear_attention, polynomial_attention, softmax_attention
from ..ops.dispatch import operand_dtype
from ..ops.mixed import mixed_attention
from ..ops.naive import DEFAULT_EPS
from .cache import KVCache, MixedCache, RecurrentCache
from .heads import MultiHeadFeatureMap
from .presets import resolve_attention
from .rope import RotaryEmbedding
from .short_conv import ShortConv

__all__ = ["KernelAttention"]


class KernelAttention(nn.Module):
    """Batch-first multi-head self-attention (as torch.nn.MultiheadAttention): (B, T, E) -> same.

    Args:
        embed_dim: E, divisible by ``num_heads``. num_heads: H; head dim D = E / H.
        qk_dim: D_qk, the per-head size of queries and keys (default D): the feature maps'
            input dim. BASED projects q and k to 16 dims so that its degree-2 Taylor map
            stays small (1 + 16 + 256 features) while values keep D.
        short_conv: K ≥ 2 puts a causal depthwise convolution of K taps + SiLU on the
            projected q, k, v (BASED / Zoology / fla; ``polysketch.nn.short_conv``); 0 = off.
        attention: a preset (``psf_random``, ``psf_learned``, ``psf_mixed``, ``polynomial``,
            ``softmax``) or any ``polysketch.features.available()`` name (default
            ``"polysketch"``, i.e. the psf_random sketch).
        causal: causal mask (decoder). ``psf_mixed`` and decoding need it.
        rope: rotary position embeddings on q and k.
        qk_norm: LayerNorm (with affine) on q and k per head. ``None``: on for polynomial maps
            and presets except softmax, off otherwise.
        chunk_size: block b of the block lower-triangular algorithm / the mixed local blocks.
        denominator_offset: added to the normalizer. ``None``: 1.0 for polynomial maps and
            presets (PolySketchFormer's 1 + Σ), 0 otherwise.
        bias: biases in the q/k/v and output projections.
        seed: base seed of the per-head feature maps; head h of layer ``layer_index`` uses
            ``polysketch.nn.heads.head_seed(seed, layer_index, h)``.
        layer_index: index of this layer in the model (seed derivation only).
        checkpoint: recompute features and attention in the backward pass (PolySketchFormer
            §4 rematerialization; linear and mixed attention only).
        **map_kwargs: keywords of the feature map (override the preset / defaults).

    ``hybrid_clustered`` needs its clusters first: ``layer.feature_map.fit_(q, k)`` with
    sample per-head queries/keys (B, H, T, D); until then its forward raises RuntimeError.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        attention: str = "polysketch",
        causal: bool = True,
        rope: bool = True,
        qk_norm: bool | None = None,
        chunk_size: int = 64,
        denominator_offset: float | None = None,
        bias: bool = False,
        seed: int = 0,
        layer_index: int = 0,
        checkpoint: bool = False,
        qk_dim: int | None = None,
        short_conv: int = 0,
        **map_kwargs,
    ):
        super().__init__()
        self.embed_dim = check_positive_int(embed_dim, "embed_dim")
        self.num_heads = check_positive_int(num_heads, "num_heads")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        self.head_dim = self.embed_dim // self.num_heads
        self.qk_dim = self.head_dim if qk_dim is None else check_positive_int(qk_dim, "qk_dim")
        self.short_conv = check_int(short_conv, "short_conv", minimum=0)
        if self.short_conv == 1:
            raise ValueError("short_conv must be 0 (off) or a kernel size >= 2, got 1")
        self.causal = _check_bool(causal, "causal")
        _check_bool(rope, "rope")
        _check_bool(bias, "bias")
        self.checkpoint = _check_bool(checkpoint, "checkpoint")
        if qk_norm is not None:
            _check_bool(qk_norm, "qk_norm")
        if denominator_offset is not None:
            denominator_offset = check_float(denominator_offset, "denominator_offset")
        self.chunk_size = check_positive_int(chunk_size, "chunk_size")
        self.seed = check_int(seed, "seed", minimum=0)
        self.layer_index = check_int(layer_index, "layer_index", minimum=0)
        spec = resolve_attention(
            attention,
            self.qk_dim,
            map_kwargs,
            qk_norm=qk_norm,
            denominator_offset=denominator_offset,
        )
        if spec.algorithm == "mixed" and not self.causal:
            raise ValueError(f"attention={attention!r} (mixed local/global) needs causal=True")
        self.spec = spec
        self.attention = spec.name
        self.algorithm = spec.algorithm
        self.denominator_offset = float(spec.denominator_offset)
        self.degree = check_positive_int(spec.degree, "degree")

        e, h = self.embed_dim, self.num_heads
        self._split = (h * self.qk_dim, h * self.qk_dim, e)  # q, k, v columns of qkv
        self.qkv = nn.Linear(e, sum(self._split), bias=bias)
        self.conv = ShortConv(sum(self._split), self.short_conv) if self.short_conv else None
        self.out_proj = nn.Linear(e, e, bias=bias)
        self.q_norm = nn.LayerNorm(self.qk_dim) if spec.qk_norm else None
        self.k_norm = nn.LayerNorm(self.qk_dim) if spec.qk_norm else None
        self.rotary = RotaryEmbedding(self.qk_dim) if rope else None
        self.exact_degree: int | None = None  # warm start: see polysketch.nn.warm_start
        self.feature_map = None
        if spec.feature_map is not None:
            self.feature_map = MultiHeadFeatureMap(
                spec.feature_map,
                self.qk_dim,
                self.num_heads,
                seed=self.seed,
                layer_index=self.layer_index,
                **spec.map_kwargs,
            )

    # ----- decoding state --------------------------------------------------------------------
    def new_cache(self) -> RecurrentCache | KVCache | MixedCache:
        """An empty decode cache for this layer (see ``polysketch.nn.cache``)."""
        if not self.causal:
            raise ValueError("decoding caches need causal=True")
        if self.algorithm == "linear":
            return RecurrentCache()
        if self.algorithm == "mixed":
            return MixedCache(self.chunk_size, self.feature_map.square)
        return KVCache()

    def decode_state_size(self, seq_len: int) -> int:
        """Floats this layer's cache holds per sequence after ``seq_len`` tokens.

        Linear: H·F'·(D + 1) with F' = F(⌊F/2⌋+1) (square: the pair layout of ``ops.state``)
        or F, constant; KV cache: H·(D_qk + D)·t;
        mixed: H·F'·(D + 1) once a block is complete + H·(t mod b)·(D_qk + D + F); plus, with
        a short convolution of K taps, the last K - 1 projections (K - 1)·H·(2·D_qk + D).
        """
        t = check_int(seq_len, "seq_len", minimum=0)
        h, d, dqk = self.num_heads, self.head_dim, self.qk_dim
        conv = min(t, self.short_conv - 1) * sum(self._split) if self.short_conv else 0
        if self.algorithm in ("softmax", "polynomial"):
            return h * (dqk + d) * t + conv
        state = h * self.feature_map.state_dim * (d + 1)
        if self.algorithm == "linear":
            return (state if t else 0) + conv
        local = h * (t % self.chunk_size) * (dqk + d + self.feature_map.feature_dim)
        return (state if t >= self.chunk_size else 0) + local + conv

    @torch.no_grad()
    def redraw_feature_map_(self, generator: torch.Generator | None = None) -> None:
        """Redraw the per-head random feature maps (no-op without one)."""
        if self.feature_map is not None:
            self.feature_map.redraw_(generator)

    # ----- forward ---------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        cache: RecurrentCache | KVCache | MixedCache | None = None,
    ) -> torch.Tensor:
        """x (B, T, E) -> (B, T, E).

        ``key_padding_mask``: bool (B, T), True = keep (torch SDPA's boolean convention);
        padded tokens are never attended to (their own outputs are meaningless).
        ``cache``: a ``new_cache()`` object; x are then the next T tokens after the
        ``cache.length`` already consumed (RoPE positions continue), the cache is updated in
        place, and the output equals that of the full sequence at those positions.
        """
        x = check_tensor(x, "x", min_dim=3)
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must have shape (B, T, E={self.embed_dim}), got {tuple(x.shape)}")
        b, t, _ = x.shape
        if key_padding_mask is not None:
            if (
                not isinstance(key_padding_mask, torch.Tensor)
                or key_padding_mask.dtype != torch.bool
            ):
                raise TypeError("key_padding_mask must be a bool tensor (True = keep)")
            if tuple(key_padding_mask.shape) != (b, t):
                raise ValueError(
                    f"key_padding_mask must have shape (B, T) = {(b, t)}, "
                    f"got {tuple(key_padding_mask.shape)}"
                )
        if cache is not None:
            if not self.causal:
                raise ValueError("cache needs causal=True")
            expected = type(self.new_cache())
            if not isinstance(cache, expected):
                raise TypeError(f"cache must be a {expected.__name__} (from new_cache())")

        qkv = self.qkv(x)
        if self.conv is not None:
            tail = None if cache is None or cache.length == 0 else cache.conv_tail
            qkv, new_tail = self.conv(qkv, keep=key_padding_mask, tail=tail)
            if cache is not None:
                cache.conv_tail = new_tail
        q, k, v = (
            rearrange(part, "b t (h d) -> b h t d", h=self.num_heads)
            for part in qkv.split(self._split, dim=-1)
        )
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out_dtype = v.dtype
        with torch.autocast(x.device.type, enabled=False):
            dtype = torch.promote_types(q.dtype, v.dtype)
            od = operand_dtype(dtype, x.device)  # half stays half on accelerators
            if self.rotary is not None:  # rotated in the accumulation dtype, then cast
                start = 0 if cache is None else cache.length
                acc = _compute_dtype(dtype)
                q, k = self.rotary(q.to(acc), start), self.rotary(k.to(acc), start)
            q, k, v = q.to(od), k.to(od), v.to(od)
            o = self._attend(q, k, v, key_padding_mask, cache)
        o = rearrange(o.to(out_dtype), "b h t d -> b t (h d)")
        return self.out_proj(o)

    def _attend(self, q, k, v, keep, cache) -> torch.Tensor:
        """The attention core on (B, H, T, D) tensors in the compute dtype."""
        kpm = None if keep is None else keep.unsqueeze(1)  # (B, 1, T) against (B, H, T, .)
        if self.exact_degree is not None and cache is None:  # warm start (nn.warm_start)
            return polynomial_attention(q, k, v, degree=self.exact_degree, causal=self.causal,
                denominator_offset=self.denominator_offset, key_padding_mask=kpm)  # fmt: skip
        if self.algorithm in ("softmax", "polynomial"):
            if cache is not None:
                k, v, keep_all = cache.append(k, v, keep)
                kpm = None if keep_all is None else keep_all.unsqueeze(1)
            if self.algorithm == "polynomial":
                return polynomial_attention(
                    q,
                    k,
                    v,
                    degree=self.degree,
                    causal=self.causal,
                    denominator_offset=self.denominator_offset,
                    key_padding_mask=kpm,
                )
            if kpm is None and (q.shape[-2] == k.shape[-2] or q.shape[-2] == 1):
                if self.causal and q.shape[-2] > 1:  # a branch (a guard under compile), so
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # a bool
                return F.scaled_dot_product_attention(q, k, v)
            return softmax_attention(q, k, v, causal=self.causal, key_padding_mask=kpm)
        if self.algorithm == "linear":
            return self._linear(q, k, v, kpm, cache)
        return self._mixed(q, k, v, keep, cache)

    def _linear(self, q, k, v, kpm, cache) -> torch.Tensor:
        fm = self.feature_map

        def run(q, k, v, state):
            return linear_attention(
                fm.query(q),
                fm.key(k),
                v,
                causal=self.causal,
                square=fm.square,
                chunk_size=self.chunk_size,
                denominator_offset=self.denominator_offset,
                key_padding_mask=kpm,
                initial_state=state,
                return_state=cache is not None,
            )

        if cache is not None:
            out, cache.state = run(q, k, v, cache.state)
            cache.length += q.shape[-2]
            return out
        if self.checkpoint and torch.is_grad_enabled():
            return _checkpoint(run, q, k, v, None, use_reentrant=False)
        return run(q, k, v, None)

    def _mixed(self, q, k, v, keep, cache) -> torch.Tensor:
        fm = self.feature_map

        def features(q, k, v):
            phi_q, phi_k = fm.query(q), fm.key(k)
            if keep is not None:  # a zero key has κ = 0 and no features: it drops out
                m = keep[:, None, :, None]
                k, phi_k, v = k * m, phi_k * m, v * m
            return phi_q, k, phi_k, v

        def run(q, k, v):
            phi_q, k, phi_k, v = features(q, k, v)
            return mixed_attention(
                q,
                k,
                v,
                phi_q,
                phi_k,
                chunk_size=self.chunk_size,
                local="polynomial",
                degree=self.degree,
                square=fm.square,
                denominator_offset=self.denominator_offset,
            )

        if cache is None:
            if self.checkpoint and torch.is_grad_enabled():
                return _checkpoint(run, q, k, v, use_reentrant=False)
            return run(q, k, v)
        if cache.length == 0:  # prefill: the full computation, then keep the state
            out = run(q, k, v)
            _, k, phi_k, v = features(q, k, v)
            cache.prefill(k, phi_k, v)
            return out
        phi_q, k, phi_k, v = features(q, k, v)
        return cache.steps(
            q, k, v, phi_q, phi_k, degree=self.degree, offset=self.denominator_offset,
            eps=DEFAULT_EPS,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"attention={self.attention!r}, causal={self.causal}, qk_dim={self.qk_dim}, "
            f"short_conv={self.short_conv}, "
            f"chunk_size={self.chunk_size}, denominator_offset={self.denominator_offset:g}, "
            f"layer_index={self.layer_index}"
        )


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value
