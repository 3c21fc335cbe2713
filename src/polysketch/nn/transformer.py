"""``TransformerLM``: a nanoGPT-sized decoder-only language model on ``KernelAttention``.

Architecture (PolySketchFormer §5 and its public code): token embedding → n_layer pre-norm
blocks ``x += Attn(LN(x)); x += GLU(LN(x))`` → LN → logits with the (tied) embedding matrix.
The feed-forward is a GELU-gated linear unit (Shazeer 2020):

    GLU(x) = (x W_1 ∘ GELU(x W_2)) W_3,   hidden ≈ 8/3·E rounded down to a multiple of 8,

which has about the parameters of a 4·E MLP. Positions come from RoPE inside attention
(``rope=False`` gives no position signal besides the causal mask). Each layer's feature maps
are seeded from (``config.seed``, layer index, head index) (``polysketch.nn.heads.head_seed``).

Decoding: ``generate`` prefills a per-layer cache (``polysketch.nn.cache``) with the prompt and
then feeds one token at a time: linear attentions keep a constant-size state (one fused
update per token), softmax and polynomial a KV cache, mixed attention the state of complete
blocks plus the current block, ``sliding_window`` the last w keys (a layer with a
``local_window`` branch both its attention's cache and the window's). Prompts of different
lengths go in one batch with a ``key_padding_mask`` (pads anywhere, usually on the left):
each row generates what it generates alone (``polysketch.nn.padding``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import assert_on_device, check_float, check_int, check_positive_int
from .._device import checks_on_host
from .._fields import documented
from ..random import make_generator
from .attention import KernelAttention
from .cache import ParallelCache
from .resolve import resolve_model
from .sharding import check_core_on_shard, make_shard
from .short_conv import ShortConv
from .spec import ModelSpec
from .warm_start import set_exact_attention as _set_exact_attention

__all__ = ["TransformerConfig", "TransformerLM", "GLU", "EXECUTION_FIELDS"]

EXECUTION_FIELDS = frozenset({"recompute"})
"""``TransformerConfig`` fields that choose memory against time, not the model's arithmetic
(values and gradients are the same either way): a resumed run may change them."""


@dataclass
class TransformerConfig:
    """Model hyperparameters (see the module docstring)."""

    vocab_size: int = documented(256, help="tokens of the vocabulary (bytes: 256)")
    block_size: int = documented(256, help="sequence length of training (RoPE has no hard limit)")
    n_layer: int = documented(4, help="layers")
    n_head: int = documented(4, help="heads (of the window branch beside a global attention)")
    n_embd: int = documented(128, help="width of the residual stream")
    attention: str = documented(
        "polysketch", help="a feature-map name, softmax, polynomial, a preset or a model preset "
        "(polysketch.nn.valid_model_attentions())",
    )  # fmt: skip
    map_kwargs: dict = documented(default_factory=dict, help="keywords of the feature map")
    chunk_size: int | None = documented(
        None, help="block of the chunked algorithm and of mixed blocks (default: the model "
        "preset's, else 64: polysketch.nn.DEFAULT_CHUNK_SIZE)",
    )  # fmt: skip
    rope: bool = documented(True, help="rotary position embeddings on q and k")
    ffn_hidden: int | None = documented(
        None, help="hidden size of the GLU feed-forward (default ≈ 8/3 · n_embd, a multiple of 8)"
    )
    dropout: float = documented(0.0, help="dropout probability")
    seed: int = documented(0, help="seed of the weights and the feature maps' random buffers")
    tie_embeddings: bool = documented(True, help="the output layer is the token embedding")
    qk_dim: int | None = documented(
        None, help="per-head query/key size (default: the head dim; BASED: 16)"
    )
    value_dim: int | None = documented(
        None, help="per-head value size of the attention (default: n_embd / its heads)"
    )
    short_conv: int = documented(
        0, help="causal depthwise convolution of K taps on q, k, v (BASED / Zoology); 0 = off"
    )
    qk_norm: bool | None = documented(None, help="LayerNorm on q and k (default: the attention's)")
    denominator_offset: float | None = documented(
        None, help="added to the normalizer (default: 1 for polynomial kernels, else 0)"
    )
    mixed: bool = documented(
        False, help="mixed attention with the feature map (exact local blocks, psf_mixed's form)"
    )
    learn_balance: bool = documented(
        False, help="mixed attention: a learned per-head weight of the far blocks"
    )
    gradient_surrogate: float | None = documented(
        None, help="λ of the training-only surrogate gradient of attention without in-block "
        "scores (soft_hash_far; exactly 0 in value; default: the model preset's, else 0)",
    )  # fmt: skip
    window: int | None = documented(
        None, help="keys each query sees with attention=sliding_window (itself included)"
    )
    softmax_scale: float | None = documented(
        None, help="scale of softmax scores and of softmax-kernel maps' targets (default: "
        "1/sqrt(D))",
    )  # fmt: skip
    local_window: int | None = documented(
        None, help="an exact sliding-window softmax branch over the last W tokens beside the "
        "attention in every layer (own projections and normalizer; BASED's local + global)",
    )  # fmt: skip
    local_shared: bool | None = documented(
        None, help="the window branch reads the attention's q/k/v and output projections "
        "(default: the model preset's, else its own)",
    )  # fmt: skip
    global_heads: int | None = documented(
        None, help="heads of the attention beside the window branch (q/k of the model's head "
        "dim; default: the model preset's, else n_head)",
    )  # fmt: skip
    global_every: int | None = documented(
        None, help="only every K-th layer (K-1, 2K-1, ...) has the attention beside the window "
        "branch; the others are the window alone (default: every layer)",
    )  # fmt: skip
    global_rope: bool | None = documented(
        None, help="RoPE on the q/k of the attention beside the window branch (default: the "
        "model preset's, else as the model)",
    )  # fmt: skip
    global_out_init: float | None = documented(
        None, help="the output projection of the attention beside the window branch starts at "
        "this multiple of the residual-output initialization (0: zero; default: the model "
        "preset's, else 1)",
    )  # fmt: skip
    global_out_tied: bool | None = documented(
        None, help="the output projection of the attention beside the window branch starts as "
        "its value projection transposed (× global_out_init / √(2 n_layer)), so each head's "
        "value-output circuit starts positive semidefinite: a value read raises its key's own "
        "input (default: the model preset's, else off)",
    )  # fmt: skip
    recompute: bool = documented(
        True, help="the linear, mixed and window attentions recompute their features and "
        "scores in the backward pass instead of keeping them (memory ≈ softmax's; about one "
        "more attention forward per training step); off: kept, faster where memory allows. "
        "Values and gradients are the same either way",
    )  # fmt: skip

    def resolve(self) -> ModelSpec:
        """Validate the config (``validate``) and resolve its attention, once, into a
        ``ModelSpec`` (``polysketch.nn.resolve.resolve_model``: a model preset expanded, the
        window branch and the attention's heads, sizes and RoPE)."""
        self.validate()
        return resolve_model(self)  # resolved again: a config is a mutable dataclass

    def validate(self) -> TransformerConfig:
        """Raise ValueError/TypeError naming the bad field; return self. The attention's
        fields are checked together by resolving them (``resolve_model``)."""
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check_positive_int(getattr(self, name), name)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.ffn_hidden is not None:
            check_positive_int(self.ffn_hidden, "ffn_hidden")
        check_float(self.dropout, "dropout", minimum=0.0, maximum=1.0)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        check_int(self.seed, "seed", minimum=0)
        for name in ("qk_dim", "value_dim"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)
        check_int(self.short_conv, "short_conv", minimum=0)
        if self.short_conv == 1:
            raise ValueError("short_conv must be 0 (off) or a kernel size >= 2, got 1")
        if not isinstance(self.map_kwargs, dict):
            raise TypeError(f"map_kwargs must be a dict, got {type(self.map_kwargs).__name__}")
        for name in ("chunk_size", "window", "local_window", "global_heads", "global_every"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)
        for name in ("rope", "tie_embeddings", "mixed", "learn_balance", "recompute"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool")
        for name in ("qk_norm", "global_rope", "local_shared", "global_out_tied"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool or None, got {type(value).__name__}")
        if self.gradient_surrogate is not None:
            check_float(self.gradient_surrogate, "gradient_surrogate", minimum=0.0)
        if self.global_out_init is not None:
            check_float(self.global_out_init, "global_out_init", minimum=0.0)
        resolve_model(self)  # the attention's fields, together
        return self


class GLU(nn.Module):
    """GELU-gated linear unit: (x W_1 ∘ GELU(x W_2)) W_3, (..., E) -> (..., E), no biases."""

    def __init__(self, embed_dim: int, hidden: int | None = None, dropout: float = 0.0):
        super().__init__()
        if hidden is None:
            hidden = max(8, (8 * embed_dim // 3) // 8 * 8)
        self.hidden = hidden
        self.up = nn.Linear(embed_dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, embed_dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, gate = self.up(x).chunk(2, dim=-1)
        return self.dropout(self.down(a * F.gelu(gate)))


class Block(nn.Module):
    """Pre-norm block: x + Attn(LN(x)), then + GLU(LN(x)), built from the model's
    ``ModelSpec`` (``polysketch.nn.spec``).

    With a window branch (``spec.hybrid``, window w) the attention has two parallel branches
    on the same LN(x), each with its own q/k/v/output projections and its own normalizer, and
    their outputs are summed: ``Attn(h) = Global(h) + Local(h)``, Global the configured
    attention over all earlier tokens, Local exact softmax attention (scale 1/√D, RoPE) over
    the last w tokens (``spec.window_attention``). This is BASED's design of a linear global
    part beside an exact local window (Arora et al. 2024), in one layer: the local branch
    models the next token from its neighbours, and the global branch's normalizer is not
    shared with the local scores (as mixed attention's is). The decode cache of such a layer
    is a ``polysketch.nn.cache.ParallelCache``.

    ``hybrid.shared``: the two branches read one q/k/v projection and share the output
    projection, ``Attn(h) = (O_global + O_local) W_out`` with [Q K V] = h W_qkv for both (the
    global branch's q/k LayerNorm and short convolution are its own; the window sees the raw
    projections with RoPE): the function of the unshared layer whose local projections equal
    the global ones, with half the projections to run.

    ``spec.heads = g`` (beside a window): the global branch has g heads with q/k of
    ``spec.qk_dim`` (the model's head dim n_embd / n_head by default, so its feature map keeps
    its input size) and values of ``spec.value_dim`` (default n_embd / g), while the window
    keeps n_head heads: one such head per layer costs 1/n_head of n_head heads' feature maps
    and in-block scores at the same decode state.

    ``spec.rope`` = False (beside a window): the global branch's q and k are not rotated: its
    feature map sees content only, so a key and a query far apart land in the same buckets
    when their content matches, while the window keeps RoPE for order within its span.

    ``hybrid.every = k``: only layers k-1, 2k-1, ... have the global branch; the others are
    the window branch alone (``attn`` is then the window attention and ``local_attn`` None),
    as hybrid models interleave a few global layers with local ones.
    """

    def __init__(self, config: TransformerConfig, spec: ModelSpec, layer_index: int):
        super().__init__()
        # recompute: each core's own default (AttentionCore.checkpoint None: the linear, mixed
        # and window forms), or no core recomputes
        layer = dict(causal=True, seed=config.seed, layer_index=layer_index,
                     checkpoint=None if config.recompute else False)  # fmt: skip
        hybrid = spec.hybrid
        # the order of the submodules is the order of the parameters, which the optimizer
        # state of a checkpoint follows: ln_1, attn, local_attn, ln_2, ffn
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.shared = hybrid is not None and hybrid.shared
        self.global_ablated = False  # with a local branch: see polysketch.nn.ablate_global
        self.local_attn = None
        window = spec.window_attention  # the branch beside the attention (or None)
        if not spec.has_global(layer_index):  # global_every: the window alone
            self.shared, window = False, None
            self.attn = KernelAttention(config.n_embd, config.n_head, rope=config.rope,
                                        attention=spec.window_attention, **layer)  # fmt: skip
        else:
            self.attn = KernelAttention(
                config.n_embd, spec.heads, attention=spec.attention, rope=spec.rope,
                qk_dim=spec.qk_dim, value_dim=spec.value_dim, short_conv=config.short_conv,
                **layer,
            )  # fmt: skip
        if window is not None:
            shared = dict(qk_dim=config.qk_dim, projections=False) if self.shared else {}
            self.local_attn = KernelAttention(config.n_embd, config.n_head, attention=window,
                                              rope=config.rope, **layer, **shared)  # fmt: skip
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.ffn = GLU(config.n_embd, config.ffn_hidden, config.dropout)
        self.dropout = nn.Dropout(config.dropout)

    def cores(self) -> tuple:
        """The block's attention modules: (attn,) or (attn, local_attn)."""
        return (self.attn,) if self.local_attn is None else (self.attn, self.local_attn)

    def new_cache(self):
        """The layer's empty decode cache (a ``ParallelCache`` with a local branch)."""
        if self.local_attn is None:
            return self.attn.new_cache()
        return ParallelCache(self.attn.new_cache(), self.local_attn.new_cache())

    def decode_state_size(self, seq_len: int) -> int:
        """Floats of the layer's decode cache per sequence after ``seq_len`` tokens."""
        local = 0 if self.local_attn is None else self.local_attn.decode_state_size(seq_len)
        return self.attn.decode_state_size(seq_len) + local

    def forward(self, x, *, key_padding_mask=None, cache=None, shard=None):
        h = self.ln_1(x)
        if self.local_attn is None:
            a = self.attn(h, key_padding_mask=key_padding_mask, cache=cache, shard=shard)
        else:
            if cache is not None and not isinstance(cache, ParallelCache):
                raise TypeError("cache must be a ParallelCache (from new_caches())")
            far, near = (None, None) if cache is None else (cache.far, cache.local)
            if self.shared:
                a = self._shared_branches(h, key_padding_mask, far, near, shard)
            else:
                a = self.local_attn(h, key_padding_mask=key_padding_mask, cache=near, shard=shard)
                g = self.attn(h, key_padding_mask=key_padding_mask, cache=far, shard=shard)
                a = a if self.global_ablated else a + g  # the far cache advances either way
        x = x + self.dropout(a)
        return x + self.ffn(self.ln_2(x))

    def _shared_branches(self, h, keep, far, near, shard) -> torch.Tensor:
        """(O_global + O_local) W_out from one projection h W_qkv (``local_shared``)."""
        attn = self.attn
        qkv = attn.qkv(h)
        o = self.local_attn.attend_projected(qkv, key_padding_mask=keep, cache=near, shard=shard)
        g = attn.attend_projected(qkv, key_padding_mask=keep, cache=far, shard=shard)
        o = o if self.global_ablated else o + g  # the far cache advances either way
        return attn.out_proj(attn.merge_heads(o))


class TransformerLM(nn.Module):
    """Decoder-only LM: idx (B, T) -> logits (B, T, V) (see the module docstring)."""

    def __init__(self, config: TransformerConfig, spec: ModelSpec | None = None):
        """``spec``: the config's ``ModelSpec`` resolved already (a checkpoint's stored spec,
        which keeps what the model computed when a preset of its name changed later); None
        resolves ``config`` (``TransformerConfig.resolve``)."""
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        if spec is not None and not isinstance(spec, ModelSpec):
            raise TypeError(f"spec must be a ModelSpec or None, got {type(spec).__name__}")
        self.config = config.validate()
        self.spec = config.resolve() if spec is None else spec
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, self.spec, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) for linears and embeddings, residual outputs / √(2 n_layer);
        the output projection of an attention beside a window branch then × its
        ``HybridSpec.out_init``, or with ``HybridSpec.out_tied`` replaced by its value
        projection transposed × out_init / √(2 n_layer) (drawn first either way, so the other
        weights do not depend on them).

        Drawn from a generator seeded with ``config.seed`` (reproducible models: nothing
        reads the global RNG); feature maps keep their own (seeded) initialization. A short
        convolution's bias keeps ``Conv1d``'s distribution, U(−1/√K, 1/√K) for K taps, drawn
        from the same generator.
        """
        gen = make_generator(self.config.seed)
        std = 0.02
        root = (2 * self.config.n_layer) ** 0.5  # residual outputs: std / root
        skip = {
            id(p)
            for blk in self.blocks
            if blk.attn.feature_map is not None
            for p in blk.attn.feature_map.parameters()
        }
        conv_bias = {id(m.bias): m.kernel_size for m in self.modules() if isinstance(m, ShortConv)}
        for name, p in self.named_parameters():
            if id(p) in conv_bias:
                bound = conv_bias[id(p)] ** -0.5
                u = torch.rand(p.shape, generator=gen, dtype=torch.float64)
                p.copy_((2 * u - 1) * bound)
                continue
            if id(p) in skip or p.dim() < 2:
                continue
            scale = std / root if name.endswith(("out_proj.weight", "ffn.down.weight")) else std
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale)
        hybrid = self.spec.hybrid
        if hybrid is not None and (hybrid.out_init != 1 or hybrid.out_tied):
            for blk in self.blocks:
                if blk.local_attn is None:  # shared branches keep 1, untied (HybridSpec)
                    continue
                out = blk.attn.out_proj.weight
                if hybrid.out_tied:
                    value = blk.attn.value_weight()  # (H·D_v, E)
                    out.copy_(value.T / root)  # entries' RMS: std / root, as drawn
                out.mul_(hybrid.out_init)

    # ----- forward ---------------------------------------------------------------------------
    def _check_idx(self, idx: torch.Tensor, name: str = "idx", *, empty: bool = False):
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be a LongTensor of token ids")
        if idx.dim() != 2 or idx.shape[1] < (0 if empty else 1):
            least = "T >= 0 (a context-parallel shard)" if empty else "T >= 1"
            raise ValueError(f"{name} must have shape (B, T) with {least}, got {tuple(idx.shape)}")
        vocab = self.config.vocab_size
        message = f"{name} must hold ids in [0, vocab_size={vocab})"
        if not checks_on_host(idx):
            # no host sync, no graph break: a device-side assertion (fails at the next sync)
            assert_on_device(((idx >= 0) & (idx < vocab)).all(), message)
        elif idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= vocab):
            raise ValueError(message)
        return idx

    def _check_targets(self, targets, idx: torch.Tensor) -> torch.Tensor:
        """targets (B, T) int ids in [0, vocab_size) or -100 (ignored). Float targets are
        refused (``.long()`` would truncate them silently); out-of-range ids raise here on
        CPU and through a device-side assertion on accelerators / under compile (no sync)."""
        if not isinstance(targets, torch.Tensor) or tuple(targets.shape) != tuple(idx.shape):
            raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}")
        if targets.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"targets must be integer token ids (int64 or int32), got {targets.dtype}: "
                "convert them with .long() if they are whole numbers"
            )
        vocab = self.config.vocab_size
        message = f"targets must hold ids in [0, vocab_size={vocab}) or -100 (ignored)"
        valid = (targets == -100) | ((targets >= 0) & (targets < vocab))
        if not checks_on_host(targets):
            assert_on_device(valid.all(), message)  # fails at the next sync, no graph break
        elif not bool(valid.all()):
            raise ValueError(message)
        return targets

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
        caches: list | None = None,
        cp_group=None,
        cu_seqlens=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) and, with ``targets`` (B, T), the mean cross-entropy (-100 ignored).

        ``key_padding_mask`` (B, T) bool, True = real token. ``caches``: one per layer from
        ``new_caches()``; idx are then the tokens after those already consumed.

        Context parallelism: with ``cp_group`` (a ProcessGroup, a 1-D DeviceMesh such as
        ``mesh["cp"]``, or a ``polysketch.distributed.CPGroup``), idx is this rank's shard
        (B, T_r) of the sequence (T_r >= 0; ranks in sequence order, e.g.
        ``polysketch.distributed.shard(idx, group=g, dim=1)``), and the logits (and loss) are
        those of its tokens; every rank of the group calls forward and backward together, and
        parameter gradients must then be SUMMED over the group (the training loop does it).
        ``cu_seqlens``: packed documents of the whole sequence (the same for every row and
        rank; ``polysketch.ops.varlen``): each document is computed as if alone, RoPE
        positions restarting at its start. ``key_padding_mask`` with ``cp_group``: this
        rank's (B, T_r) shard of the mask (linear attentions; padding is removal across
        ranks). Both: ``polysketch.nn.sharding`` (what is supported, what is refused).
        """
        sharded = cp_group is not None or cu_seqlens is not None
        idx = self._check_idx(idx, empty=cp_group is not None)
        shard = None
        if sharded:
            if caches is not None:
                raise ValueError("cp_group / cu_seqlens cannot be combined with caches")
            keep = key_padding_mask
            if keep is not None and (cu_seqlens is not None or cp_group is None):
                raise ValueError(
                    "key_padding_mask with cu_seqlens is not supported: pack documents "
                    "instead of padding them"
                )
            if keep is not None and (not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool
                                     or tuple(keep.shape) != tuple(idx.shape)):  # fmt: skip
                raise ValueError(
                    f"key_padding_mask must be a bool tensor of idx's shape {tuple(idx.shape)}"
                )
            shard = make_shard(idx.shape[1], group=cp_group, cu_seqlens=cu_seqlens, keep=keep,
                               device=idx.device)  # fmt: skip
            for core in (c for block in self.blocks for c in block.cores()):
                check_core_on_shard(core, shard)  # refuse before any collective of the layers
        if targets is not None:
            targets = self._check_targets(targets, idx)
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(f"caches must hold one cache per layer ({len(self.blocks)})")
        x = self.drop(self.wte(idx))
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            x = block(x, key_padding_mask=key_padding_mask, cache=cache, shard=shard)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits_for_loss(logits).flatten(0, 1), targets.flatten().long(), ignore_index=-100
            )
        return logits, loss

    def new_caches(self) -> list:
        """One empty decode cache per layer."""
        return [block.new_cache() for block in self.blocks]

    # ----- generation ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to idx (B, T0) -> (B, T0 + N).

        The prompt is prefilled once into per-layer caches, then one token per step.
        ``temperature=0`` or ``top_k=1``: greedy argmax. Otherwise tokens are drawn from
        softmax(logits / temperature) restricted to the ``top_k`` largest, with the CPU
        ``generator`` (``None``: torch's global RNG). Dropout is off while generating.
        ``key_padding_mask``: bool (B, T0), True = real prompt token (pads anywhere, e.g. on
        the left of shorter prompts): row b continues after its last real token and generates
        what it generates alone (``polysketch.nn.padding``); the returned ids keep the pads.
        """
        idx = self._check_idx(idx)
        last = None
        if key_padding_mask is not None:
            if (
                not isinstance(key_padding_mask, torch.Tensor)
                or key_padding_mask.dtype != torch.bool
                or tuple(key_padding_mask.shape) != tuple(idx.shape)
            ):
                raise ValueError(
                    f"key_padding_mask must be a bool tensor of the shape of idx "
                    f"{tuple(idx.shape)} (True = real token)"
                )
            count = key_padding_mask.sum(-1)
            if bool((count == 0).any()):
                raise ValueError("key_padding_mask: every prompt needs at least one real token")
            positions = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
            last = torch.where(key_padding_mask, positions, -1).amax(-1)  # last real token
        n = check_int(max_new_tokens, "max_new_tokens", minimum=0)
        temperature = check_float(temperature, "temperature", minimum=0.0)
        if top_k is not None:
            top_k = check_positive_int(top_k, "top_k")
        greedy = temperature == 0.0 or top_k == 1
        if n == 0:
            return idx
        was_training = self.training
        self.eval()
        try:
            caches = self.new_caches()
            logits, _ = self(idx, caches=caches, key_padding_mask=key_padding_mask)
            if last is not None:  # each row's next token follows its last real one
                logits = logits[torch.arange(idx.shape[0], device=idx.device), last].unsqueeze(1)
            out = [idx]
            for step in range(n):
                final = logits[:, -1, :].float()
                if greedy:
                    nxt = final.argmax(dim=-1, keepdim=True)
                else:
                    nxt = _sample(final / temperature, top_k, generator).to(idx.device)
                out.append(nxt.to(idx.dtype))
                if step + 1 < n:
                    logits, _ = self(out[-1], caches=caches)
            return torch.cat(out, dim=1)
        finally:
            self.train(was_training)

    # ----- sizes and randomness -------------------------------------------------------------
    def num_parameters(self) -> int:
        """Number of trainable parameters (tied embeddings counted once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def decode_state_size(self, seq_len: int) -> int:
        """Floats held per sequence by all layers' decode caches after ``seq_len`` tokens."""
        return sum(block.decode_state_size(seq_len) for block in self.blocks)

    def set_exact_attention(self, exact: bool) -> int:
        """Warm start: exact polynomial attention (True) or the sketch (False) in every
        sketched layer; returns the number of layers switched (``polysketch.nn.warm_start``)."""
        return _set_exact_attention(self, exact)

    @torch.no_grad()
    def redraw_feature_maps_(self, generator: torch.Generator | None = None) -> None:
        """Redraw every layer's random feature maps, layers in order, from one generator."""
        gen = make_generator(None, generator)
        for block in self.blocks:
            block.attn.redraw_feature_map_(gen)


def logits_for_loss(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the loss: fp32 at least (half precision is upcast; fp64 stays fp64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _sample(logits: torch.Tensor, top_k: int | None, generator) -> torch.Tensor:
    """Draw one id per row from softmax(logits) limited to the top_k; (B, V) -> (B, 1), CPU."""
    logits = logits.cpu()
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)
