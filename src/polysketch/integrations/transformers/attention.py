"""The ``"polysketch"`` attention function of transformers and its per-layer module.

transformers' attention modules (Llama, Qwen2, Mistral, GPT-NeoX, GPT-2, ...) project and
rotate q, k, v themselves, update their cache, then call

    attn_output, attn_weights = ALL_ATTENTION_FUNCTIONS[config._attn_implementation](
        module, q (B, H, T, D), k (B, H_kv, Tk, D), v (B, H_kv, Tk, D), attention_mask,
        scaling=..., dropout=..., **kwargs)            ->  (B, T, H, D), weights or None

``polysketch_attention_forward`` is registered there under ``ATTENTION_NAME`` (and the
``sdpa`` mask builder under the same name, so padding reaches it). It reads the layer's
``PolysketchAttention`` (``module.polysketch``, a submodule, hence in the ``state_dict``) and
computes, on the per-query-head tensors (GQA: k, v repeated H / H_kv times, as the model's
own eager path does):

    q, k <- LayerNorm(q), LayerNorm(k)        (optional; trainable; default on for polynomial
                                                kernels and presets, as ``polysketch.nn``)
    out_i = Σ_{j≤i} s_ij v_j / (offset + Σ_{j≤i} s_ij)

with s_ij = φq(q_i)·φk(k_j) (squared for ``square`` maps) of per-head maps (``linear``), the
exact (q_i·k_j)^p inside blocks and the sketch before them (``psf_mixed``, ``mixed``),
exact ``polynomial``, or the model's own softmax (``softmax``: ``sdpa_attention_forward``
with the model's mask and scaling, so logits do not change).

Scale: a pretrained model's q·k is not normalized; softmax uses exp(scaling·q·k). Polynomial
kernels get the q/k LayerNorm (its gain is trained by attention transfer), softmax random
features and the learned ``hedgehog`` map get ``scale=scaling`` (the model's own temperature,
e.g. GPT-2's per-layer scale; for hedgehog it is the temperature of the target its ``fit``
imitates, its features do not depend on it). The LayerNorm acts on the rotated q, k (as in
the public PolySketchFormer code).

Attention transfer (``transfer=True``): the layer returns the exact softmax output (so
every later layer sees the teacher's inputs) and stores ``transfer_loss`` =
‖out_lin − out_softmax‖² / ‖out_softmax‖² for ``polysketch.integrations.transformers.
linearize``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ..._checks import check_int, check_positive_int
from ..._checks import compute_dtype as _compute_dtype
from ...features import available, get_class
from ...nn.cache import MixedCache, RecurrentCache
from ...nn.heads import MultiHeadFeatureMap
from ...nn.presets import SOFTMAX_TARGET_MAPS, resolve_attention
from ...ops import linear_attention, polynomial_attention
from ...ops.mixed import mixed_attention
from ...ops.naive import DEFAULT_EPS

__all__ = ["ATTENTION_NAME", "PolysketchAttention", "polysketch_attention_forward"]

ATTENTION_NAME = "polysketch"
"""The ``attn_implementation`` name under which polysketch attention is registered."""


class PolysketchAttention(nn.Module):
    """Per-layer kernelized attention core: (B, H, T, D) q, k, v -> (B, H, T, D).

    Args:
        attention: ``"softmax"``, ``"polynomial"``, a preset (``psf_random``, ``psf_learned``,
            ``psf_mixed``) or a ``polysketch.features.available()`` name.
        head_dim: D. num_heads: H (query heads). layer_index: seeds head maps.
        scaling: the model's softmax scale (maps whose target is exp(scale·q·k), softmax
            random features and ``hedgehog``, get it as ``scale``).
        chunk_size: block of the chunked algorithm and of the mixed local blocks.
        qk_norm, denominator_offset: ``None`` = the preset / map default.
        seed: base seed of the per-head maps.
        mixed: with a feature-map name, use psf_mixed's form with that map: exact
            (q·k)^degree inside blocks of ``chunk_size`` (degree = the map's ``degree``, else
            4), the map for earlier blocks (``ops.mixed_attention``), e.g. a learnable map.
            A ``degree=`` the map does not take (``hedgehog``) is the local degree only.
            ``qk_norm`` / ``denominator_offset`` of None become psf_mixed's (LayerNorm on q
            and k, 1 + Σ): the exact local polynomial needs normalized q, k.
        **map_kwargs: keywords of the feature map.
    """

    def __init__(
        self,
        attention: str,
        *,
        head_dim: int,
        num_heads: int,
        layer_index: int,
        scaling: float,
        chunk_size: int = 64,
        qk_norm: bool | None = None,
        denominator_offset: float | None = None,
        seed: int = 0,
        mixed: bool = False,
        **map_kwargs,
    ):
        super().__init__()
        if not isinstance(mixed, bool):
            raise TypeError(f"mixed must be a bool, got {type(mixed).__name__}")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.num_heads = check_positive_int(num_heads, "num_heads")
        self.layer_index = check_int(layer_index, "layer_index", minimum=0)
        self.chunk_size = check_positive_int(chunk_size, "chunk_size")
        kwargs = dict(map_kwargs)
        if attention in SOFTMAX_TARGET_MAPS and "scale" not in kwargs:
            kwargs["scale"] = float(scaling)
        local_degree = None
        if (
            mixed
            and "degree" in kwargs
            and attention in available()
            and not get_class(attention).takes("degree")
        ):
            local_degree = kwargs.pop("degree")  # only the exact local blocks have a degree
        if mixed:  # psf_mixed's form: its local polynomial needs normalized q, k (and 1 + Σ)
            qk_norm = True if qk_norm is None else qk_norm
            denominator_offset = 1.0 if denominator_offset is None else denominator_offset
        spec = resolve_attention(
            attention, self.head_dim, kwargs, qk_norm=qk_norm, denominator_offset=denominator_offset
        )
        self.attention = spec.name
        self.algorithm = spec.algorithm
        self.degree = spec.degree
        if mixed:  # exact (q·k)^p inside blocks, this map for earlier blocks (psf_mixed's form)
            if spec.algorithm != "linear":
                raise ValueError(
                    f"mixed=True needs a feature-map attention, got attention={attention!r}"
                )
            self.algorithm = "mixed"
            if local_degree is None:
                local_degree = spec.map_kwargs.get("degree", 4)
            self.degree = check_positive_int(local_degree, "degree")
        self.denominator_offset = float(spec.denominator_offset)
        self.q_norm = nn.LayerNorm(self.head_dim) if spec.qk_norm else None
        self.k_norm = nn.LayerNorm(self.head_dim) if spec.qk_norm else None
        self.feature_map = None
        if spec.feature_map is not None:
            self.feature_map = MultiHeadFeatureMap(
                spec.feature_map,
                self.head_dim,
                self.num_heads,
                seed=seed,
                layer_index=self.layer_index,
                **spec.map_kwargs,
            )
        self.transfer = False  # attention-transfer mode (see the module docstring)
        self.transfer_loss: torch.Tensor | None = None
        self._active_cache = None  # set by PolysketchCacheLayer.update, consumed by forward

    @property
    def uses_state_cache(self) -> bool:
        """Whether decoding keeps a constant-size state (linear, mixed) instead of a KV cache."""
        return self.algorithm in ("linear", "mixed")

    def new_state(self) -> RecurrentCache | MixedCache:
        """An empty per-layer decode state (``polysketch.nn.cache``)."""
        if self.algorithm == "linear":
            return RecurrentCache()
        if self.algorithm == "mixed":
            return MixedCache(self.chunk_size, self.feature_map.square)
        raise ValueError(f"attention={self.attention!r} decodes from a KV cache, not a state")

    def decode_state_size(self, seq_len: int) -> int:
        """Floats per sequence after ``seq_len`` tokens (as ``KernelAttention``)."""
        t = check_int(seq_len, "seq_len", minimum=0)
        h, d = self.num_heads, self.head_dim
        if not self.uses_state_cache:
            return 2 * h * d * t
        state = h * self.feature_map.state_dim * (d + 1)
        if self.algorithm == "linear":
            return state if t else 0
        local = h * (t % self.chunk_size) * (2 * d + self.feature_map.feature_dim)
        return (state if t >= self.chunk_size else 0) + local

    def forward(self, q, k, v, *, keep=None, state=None) -> torch.Tensor:
        """q (B, H, Tq, D), k, v (B, H, Tk, D) (heads already repeated) -> (B, H, Tq, D).

        ``keep``: bool (B, Tk) key padding (True = keep) or None. ``state``: a
        ``new_state()`` object (decoding; Tk = Tq new tokens) or None (full causal sequence,
        queries aligned with the last keys).
        """
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out_dtype = v.dtype
        with torch.autocast(q.device.type, enabled=False):
            cd = _compute_dtype(torch.promote_types(q.dtype, v.dtype))
            q, k, v = q.to(cd), k.to(cd), v.to(cd)
            kpm = None if keep is None else keep[:, None, :]
            if self.algorithm == "polynomial":
                o = polynomial_attention(
                    q, k, v, degree=self.degree, causal=True,
                    denominator_offset=self.denominator_offset, key_padding_mask=kpm,
                )  # fmt: skip
            elif self.algorithm == "linear":
                o = self._linear(q, k, v, kpm, state)
            else:
                o = self._mixed(q, k, v, keep, state)
        return o.to(out_dtype)

    def _linear(self, q, k, v, kpm, state):
        fm = self.feature_map
        out = linear_attention(
            fm.query(q),
            fm.key(k),
            v,
            causal=True,
            square=fm.square,
            chunk_size=self.chunk_size,
            denominator_offset=self.denominator_offset,
            key_padding_mask=kpm,
            initial_state=None if state is None else state.state,
            return_state=state is not None,
        )
        if state is None:
            return out
        out, state.state = out
        state.length += q.shape[-2]
        return out

    def _mixed(self, q, k, v, keep, state):
        fm = self.feature_map
        if state is None and q.shape[-2] != k.shape[-2]:
            raise ValueError(
                "psf_mixed / mixed attention needs as many queries as keys without a "
                "PolysketchCache (decode with the cache convert() installs for generate)"
            )
        phi_q, phi_k = fm.query(q), fm.key(k)
        if keep is not None:  # a zeroed key has κ = 0 and no features: it drops out
            m = keep[:, None, :, None].to(k.dtype)
            k, phi_k, v = k * m, phi_k * m, v * m
        if state is None or state.length == 0:
            out = mixed_attention(
                q, k, v, phi_q, phi_k, chunk_size=self.chunk_size, local="polynomial",
                degree=self.degree, square=fm.square, denominator_offset=self.denominator_offset,
            )  # fmt: skip
            if state is not None:
                state.prefill(k, phi_k, v)
            return out
        return state.steps(
            q, k, v, phi_q, phi_k, degree=self.degree, offset=self.denominator_offset,
            eps=DEFAULT_EPS,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"attention={self.attention!r}, algorithm={self.algorithm!r}, "
            f"num_heads={self.num_heads}, head_dim={self.head_dim}, chunk_size={self.chunk_size}, "
            f"denominator_offset={self.denominator_offset:g}, layer_index={self.layer_index}"
        )


def _key_padding(mask, q_len: int, k_len: int) -> torch.Tensor | None:
    """Key padding (B, k_len) from a causal(+padding) mask (B, 1|H, Tq, Tkv), or None.

    The mask of the ``sdpa`` builder: bool (True = attend) or additive float (0 = attend);
    None for plain causal attention. Keys visible to the last query are exactly the kept
    ones; anything that is not "causal AND key kept" (sliding windows, packed sequences,
    custom masks) cannot be linearized and raises ValueError.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(f"attention_mask must be None or a 4D tensor, got {type(mask).__name__}")
    allowed = mask if mask.dtype == torch.bool else mask == 0
    allowed = allowed[:, 0]  # (B, Tq, Tkv)
    tq, tkv = allowed.shape[-2:]
    keep_all = allowed[:, -1, :]  # (B, Tkv)
    pos_q = torch.arange(tkv - tq, tkv, device=mask.device)[:, None]
    causal = torch.arange(tkv, device=mask.device)[None, :] <= pos_q
    expected = causal[None] & keep_all[:, None, :]
    rows = keep_all[:, -tq:, None]  # padded query rows may be anything
    valid = ((allowed == expected) | ~rows).all()
    message = (
        "attention_mask is not a causal mask with key padding (sliding window, packed "
        "sequences or a custom mask): polysketch attention cannot linearize it"
    )
    keep = keep_all[:, -k_len:]
    if mask.device.type != "cpu" or torch.compiler.is_compiling():
        # no host sync on accelerators: a device-side assertion, and the mask kept as is
        torch._assert_async(valid, message)
        return keep
    if not bool(valid):
        raise ValueError(message)
    return None if bool(keep.all()) else keep


def _repeat_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, T, D) -> (B, H_kv·n_rep, T, D), head h reading kv head h // n_rep (GQA)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def polysketch_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q (B, H, T, D), k, v (B, H_kv, Tk, D) -> (B, T, H, D).

    See the module docstring. Dropout is ignored by the kernelized paths (PolySketchFormer
    has none); ``softmax`` passes everything to transformers' ``sdpa_attention_forward``.
    """
    core = getattr(module, "polysketch", None)
    if not isinstance(core, PolysketchAttention):
        raise TypeError(
            f"{type(module).__name__} has no polysketch attention: call "
            "polysketch.integrations.transformers.convert(model) first"
        )
    layer_cache, core._active_cache = core._active_cache, None
    softmax_needed = core.algorithm == "softmax" or (core.transfer and torch.is_grad_enabled())
    reference = None
    if softmax_needed:
        if layer_cache is not None:
            raise ValueError("softmax attention needs a KV cache, not a PolysketchCache")
        with torch.no_grad() if core.transfer else torch.enable_grad():
            reference, _ = sdpa_attention_forward(
                module, query, key, value, attention_mask,
                dropout=dropout, scaling=scaling, **kwargs,
            )  # fmt: skip
        if core.algorithm == "softmax":
            return reference, None
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"query heads ({query.shape[1]}) must be a multiple of key/value heads ({key.shape[1]})"
        )
    n_rep = query.shape[1] // key.shape[1]
    k, v = _repeat_heads(key, n_rep), _repeat_heads(value, n_rep)
    keep = _key_padding(attention_mask, query.shape[-2], k.shape[-2])
    state = None
    if layer_cache is not None:
        state = layer_cache.state
    out = core(query, k, v, keep=keep, state=state).transpose(1, 2).contiguous()
    if reference is not None:  # attention transfer: learn from, and pass on, the teacher
        ref = reference.detach()
        core.transfer_loss = (out - ref).square().mean() / ref.square().mean().clamp_min(1e-12)
        return ref, None
    return out, None


def register() -> None:
    """Register ``ATTENTION_NAME`` in transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, polysketch_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


register()
