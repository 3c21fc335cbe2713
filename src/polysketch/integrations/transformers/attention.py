"""The ``"polysketch"`` attention function of transformers and its per-layer module.

transformers' attention modules (Llama, Qwen2, Mistral, GPT-NeoX, GPT-2, ...) project and
rotate q, k, v themselves, update their cache, then call

    attn_output, attn_weights = ALL_ATTENTION_FUNCTIONS[config._attn_implementation](
        module, q (B, H, T, D), k (B, H_kv, Tk, D), v (B, H_kv, Tk, D), attention_mask,
        scaling=..., dropout=..., **kwargs)            ->  (B, T, H, D), weights or None

``polysketch_attention_forward`` is registered there under ``ATTENTION_NAME`` by
``policies.register`` (and the ``sdpa`` mask builder under the same name, so padding
reaches it). It reads the layer's
``PolysketchAttention`` (``module.polysketch``, a submodule, hence in the ``state_dict``),
translates the mask into key padding, repeats k, v over the query heads (GQA: H / H_kv
times, as the model's own eager path does) and calls the one attention core of
``polysketch.nn`` (``PolysketchAttention`` is an ``polysketch.nn.core.AttentionCore``):

    q, k <- LayerNorm(q), LayerNorm(k)        (optional; trainable; default on for polynomial
                                                kernels and presets, as ``polysketch.nn``;
                                                after the model's RoPE)
    out_i = Σ_{j≤i} s_ij v_j / (offset + Σ_{j≤i} s_ij)

with s_ij = φq(q_i)·φk(k_j) (squared for ``square`` maps) of per-head maps (``linear``), the
exact (q_i·k_j)^p inside blocks and the sketch before them (``psf_mixed``, ``mixed``),
exact ``polynomial``, an exact window (``sliding_window``), or the model's own softmax
(``softmax``: ``sdpa_attention_forward`` with the model's mask and scaling, so logits do not
change; with Gemma-2's logit soft-capping, the model's own eager attention, which applies it).
The core decides the precision (half operands on accelerators, ``ops.dispatch``), removes
padded tokens (mixed blocks start at each row's first real token) and decodes from the
``PolysketchCache`` states.

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

import sys

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..._checks import assert_on_device, check_int, check_positive_int
from ...nn.cache import ParallelCache
from ...nn.core import AttentionCore
from ...nn.resolve import resolve_converted, split_options
from ...nn.spec import LayerSpec

__all__ = ["ATTENTION_NAME", "PolysketchAttention", "polysketch_attention_forward"]

ATTENTION_NAME = "polysketch"
"""The ``attn_implementation`` name under which polysketch attention is registered."""


class PolysketchAttention(AttentionCore):
    """Per-layer kernelized attention core: (B, H, T, D) q, k, v -> (B, H, T, D).

    An ``AttentionCore`` (``polysketch.nn.core``: feature maps, precision policy, caches,
    padding) plus the q/k LayerNorm applied to the model's rotated q, k and the
    attention-transfer mode, built from a ``LayerSpec`` (``polysketch.nn.spec``;
    ``polysketch.nn.resolve.resolve_converted`` makes it from a name and options):

        O_h = W_h + G_h      (then the model's o_proj, as for any converted layer)

    W_h the exact sliding-window softmax over the last w keys on every query head
    (``spec.window_attention``, the model's ``scaling``; none: W = 0), G_h ``spec.attention``
    (its own q/k LayerNorm, feature map and normalizer) on query heads h < g
    (``spec.global_heads``; None: every head). Each branch keeps its own normalizer (BASED's
    local + global sum, as the model presets train), so at conversion the layer is no longer
    the model's softmax: attention transfer trains the global branch's LayerNorms and
    learnable map to match it, and the fine-tune the rest. The q/k LayerNorm acts on the
    global branch only.

    Args:
        spec: what the layer computes (a ``LayerSpec``).
        head_dim: D. num_heads: H (the model's query heads). layer_index: seeds head maps.
        seed: base seed of the per-head maps.

    ``new_state`` is, with a window, a ``polysketch.nn.cache.ParallelCache`` (``far``: this
    attention's, ``local``: the window's), and ``decode_state_size`` counts both.
    """

    def __init__(self, spec: LayerSpec, *, head_dim: int, num_heads: int, layer_index: int,
                 seed: int = 0):  # fmt: skip
        if not isinstance(spec, LayerSpec):
            raise TypeError(f"spec must be a LayerSpec (polysketch.nn.resolve."
                            f"resolve_converted), got {type(spec).__name__}")  # fmt: skip
        head_dim = check_positive_int(head_dim, "head_dim")
        num_heads = check_positive_int(num_heads, "num_heads")
        layer_index = check_int(layer_index, "layer_index", minimum=0)
        heads = num_heads if spec.global_heads is None else spec.global_heads
        if heads > num_heads:
            raise ValueError(f"global_heads={heads} > the model's {num_heads} query heads")
        super().__init__(spec.attention, qk_dim=head_dim, num_heads=heads, causal=True,
                         seed=seed, layer_index=layer_index)  # fmt: skip
        self.layer_spec = spec
        self.total_heads = num_heads  # the model's query heads (num_heads: the global ones)
        self.local_attn = None  # the window branch
        if spec.window_attention is not None:
            self.local_attn = AttentionCore(
                spec.window_attention, qk_dim=head_dim, num_heads=num_heads, causal=True,
                seed=seed, layer_index=layer_index,
            )  # fmt: skip
        self.head_dim = self.qk_dim
        self.q_norm = nn.LayerNorm(self.head_dim) if self.spec.qk_norm else None
        self.k_norm = nn.LayerNorm(self.head_dim) if self.spec.qk_norm else None
        self.drop_softcap = False  # convert(..., softcap="drop"): logit soft-capping dropped
        self.transfer = False  # attention-transfer mode (see the module docstring)
        self.transfer_loss: torch.Tensor | None = None
        # one slot that PolysketchCacheLayer.update fills and the attention function empties
        # (a list, so handing the cache over is no nn.Module.__setattr__ at every token)
        self._active_cache: list = [None]

    @classmethod
    def from_name(cls, attention: str, *, head_dim: int, num_heads: int, layer_index: int = 0,
                  scaling: float | None = None, seed: int = 0, n_layer: int = 1,
                  **options) -> PolysketchAttention:  # fmt: skip
        """The layer ``convert`` builds for ``attention`` and ``options`` (its keywords, split
        by ``polysketch.nn.resolve.split_options``; ``resolve_converted``), on a layer of
        ``num_heads`` query heads of ``head_dim`` with softmax scale ``scaling`` (default
        1/√D)."""
        opts, branch, maps = split_options(options, hybrid=True)
        spec = resolve_converted(
            attention, head_dim=head_dim, num_heads=num_heads,
            scaling=head_dim**-0.5 if scaling is None else scaling, map_kwargs=maps,
            options=opts, branch=branch, layer_index=layer_index, n_layer=n_layer,
        )  # fmt: skip
        return cls(spec, head_dim=head_dim, num_heads=num_heads, layer_index=layer_index,
                   seed=seed)  # fmt: skip

    @property
    def uses_state_cache(self) -> bool:
        """Whether decoding keeps its own state (linear, mixed, window: a ``PolysketchCache``)
        instead of transformers' KV cache (softmax, polynomial: a ``DynamicCache``)."""
        return self.form in ("linear", "mixed", "window")

    @property
    def local_window(self) -> int | None:
        """w of the window branch beside this attention, or None."""
        return None if self.local_attn is None else self.local_attn.window

    def new_state(self):
        """An empty per-layer decode state (``AttentionCore.new_cache``; with a window
        branch a ``ParallelCache`` of both)."""
        if not self.uses_state_cache:
            raise ValueError(f"attention={self.attention!r} decodes from a KV cache, not a state")
        if self.local_attn is None:
            return self.new_cache()
        return ParallelCache(self.new_cache(), self.local_attn.new_cache())

    def decode_state_size(self, seq_len: int) -> int:
        """Floats of the layer's decode state per sequence after ``seq_len`` tokens: the
        attention's (``AttentionCore.decode_state_size``, its g heads) plus, with a window
        branch, the window's H·(D + E)·min(t, w)."""
        size = super().decode_state_size(seq_len)
        if self.local_attn is not None:
            size += self.local_attn.decode_state_size(seq_len)
        return size

    def forward(self, q, k, v, *, keep=None, state=None) -> torch.Tensor:
        """q (B, H, Tq, D), k, v (B, H, Tk, D) (heads already repeated) -> (B, H, Tq, D).

        ``keep``: bool (B, Tk) key padding (True = keep) or None. ``state``: a
        ``new_state()`` object (decoding; Tk = Tq new tokens) or None (full causal sequence,
        queries aligned with the last keys).
        """
        near = None
        if self.local_attn is not None:  # the window branch on the raw (rotated) q, k, v
            if state is not None and not isinstance(state, ParallelCache):
                raise TypeError(f"state must be a ParallelCache (new_state()), got "
                                f"{type(state).__name__}")  # fmt: skip
            local, state = (None, None) if state is None else (state.local, state.far)
            near = self.local_attn.attend(q, k, v, keep=keep, cache=local)
            g = self.num_heads
            if g < q.shape[1]:
                q, k, v = q[:, :g], k[:, :g], v[:, :g]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attend(q, k, v, keep=keep, cache=state)
        if near is None:
            return out
        if out.shape[1] == near.shape[1]:
            return near + out
        g = out.shape[1]
        return torch.cat([near[:, :g] + out, near[:, g:]], dim=1)

    def extra_repr(self) -> str:
        extra = f", head_dim={self.head_dim}"
        if self.local_attn is not None:
            extra += f", local_window={self.local_window}, total_heads={self.total_heads}"
        return super().extra_repr() + extra


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
        assert_on_device(valid, message)
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
    layer_cache, core._active_cache[0] = core._active_cache[0], None
    softmax_needed = core.form == "softmax" or (core.transfer and torch.is_grad_enabled())
    softcap = kwargs.get("softcap")
    if softcap is not None and core.form != "softmax" and not core.drop_softcap:
        raise ValueError(
            f"this layer soft-caps its attention logits (softcap={softcap}), which "
            f"attention={core.attention!r} cannot apply: convert with softcap='drop' to drop "
            "it explicitly, or use attention='softmax'"
        )
    reference = None
    if softmax_needed:
        if layer_cache is not None:
            raise ValueError("softmax attention needs a KV cache, not a PolysketchCache")
        with torch.no_grad() if core.transfer else torch.enable_grad():
            reference, _ = _model_softmax(module)(
                module, query, key, value, attention_mask,
                dropout=dropout, scaling=scaling, **kwargs,
            )  # fmt: skip
        if core.form == "softmax":
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


def _model_softmax(module: nn.Module):
    """The model's own softmax attention: SDPA (as transformers' ``"sdpa"``), or, for a
    layer that soft-caps its logits (Gemma-2; SDPA cannot), the eager attention function of
    the module's own modeling file, which applies the cap exactly."""
    if getattr(module, "attn_logit_softcapping", None) is None:
        return sdpa_attention_forward
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise ValueError(
            f"{type(module).__name__} soft-caps its logits but its modeling file has no "
            "eager_attention_forward to compute them exactly"
        )

    def softcapped(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is None:  # the sdpa builder's "causal" (SDPA's is_causal)
            tq, tk = query.shape[-2], key.shape[-2]
            i = torch.arange(tq, device=query.device)[:, None] + (tk - tq)
            attention_mask = (torch.arange(tk, device=query.device)[None, :] <= i)[None, None]
        if attention_mask.dtype == torch.bool:  # eager adds its mask to the scores
            low = torch.finfo(query.dtype).min
            attention_mask = torch.where(attention_mask, 0.0, low).to(query.dtype)
        return eager(module, query, key, value, attention_mask, **kwargs)

    return softcapped
