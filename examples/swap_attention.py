"""Swap ``torch.nn.MultiheadAttention`` for ``polysketch.nn.KernelAttention`` in your own model.

A small user-defined causal model uses ``nn.MultiheadAttention(batch_first=True)`` for
self-attention. ``swap_attention(model, attention=...)`` replaces every such module by a thin
adapter around ``KernelAttention`` that keeps MultiheadAttention's call signature
(``attn(x, x, x, attn_mask=..., need_weights=False) -> (out, None)``), so the model's code is
unchanged.

1. With ``attention="softmax"`` (no RoPE, with biases) and MultiheadAttention's weights copied
   over, the swapped model computes the same function: outputs agree to float rounding.
2. With ``attention="psf_random"`` (PolySketchFormer's linear-time sketch: LayerNorm on q/k,
   degree-2 Gaussian sketch r = 32, self-tensored so scores approximate (q·k)^4) the swapped
   model is a different kernel — fine-tune it — but it is causal by construction: changing the
   tokens after position t leaves every output at positions <= t bit-identical.

Run: ``python examples/swap_attention.py`` (a few seconds on CPU).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from polysketch.nn import KernelAttention


class TinyCausalModel(nn.Module):
    """A user's model: embedding -> 2 pre-norm self-attention blocks -> head."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.attns = nn.ModuleList(
            nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        t = idx.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1)  # True = blocked
        for norm, attn in zip(self.norms, self.attns, strict=True):
            h = norm(x)
            x = x + attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return self.head(x)


class KernelSelfAttention(nn.Module):
    """MultiheadAttention-compatible self-attention running ``KernelAttention`` (causal)."""

    def __init__(self, embed_dim: int, num_heads: int, **kwargs):
        super().__init__()
        self.inner = KernelAttention(embed_dim, num_heads, causal=True, **kwargs)

    def forward(self, query, key, value, attn_mask=None, need_weights=False, **_):
        if not (query is key and key is value):
            raise ValueError("query, key and value must be the same tensor (self-attention)")
        # The causal mask is built into KernelAttention (it never forms the T×T matrix).
        return self.inner(query), None


@torch.no_grad()
def swap_attention(model: nn.Module, *, copy_weights: bool = False, **kwargs) -> nn.Module:
    """Replace every nn.MultiheadAttention in ``model`` (in place) by KernelSelfAttention."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.MultiheadAttention):
                continue
            new = KernelSelfAttention(child.embed_dim, child.num_heads, **kwargs)
            if copy_weights:  # same layout: [W_q; W_k; W_v], heads contiguous within each
                new.inner.qkv.weight.copy_(child.in_proj_weight)
                new.inner.qkv.bias.copy_(child.in_proj_bias)
                new.inner.out_proj.weight.copy_(child.out_proj.weight)
                new.inner.out_proj.bias.copy_(child.out_proj.bias)
            setattr(parent, name, new.to(child.out_proj.weight.device))
    return model


def main() -> None:
    torch.manual_seed(0)
    model = TinyCausalModel().eval()
    idx = torch.randint(0, 64, (2, 48))
    reference = model(idx)

    # 1. Same kernel (softmax), same weights: the same function.
    exact = swap_attention(
        copy.deepcopy(model), copy_weights=True, attention="softmax", rope=False, bias=True
    )
    swapped = sum(isinstance(m, KernelSelfAttention) for m in exact.modules())
    left = sum(isinstance(m, nn.MultiheadAttention) for m in exact.modules())
    print(f"swapped {swapped} attention modules ({left} nn.MultiheadAttention left)")
    diff = (exact(idx) - reference).abs().max().item()
    print(f"softmax KernelAttention vs nn.MultiheadAttention: max |difference| = {diff:.2e}")
    if diff > 1e-5:
        raise SystemExit("the swapped softmax model should match the original")

    # 2. Linear-time PolySketchFormer attention (new kernel: fine-tune after swapping).
    fast = swap_attention(copy.deepcopy(model), attention="psf_random").eval()
    out = fast(idx)
    print(f"psf_random output: shape {tuple(out.shape)}, finite: {bool(out.isfinite().all())}")
    t = 20
    changed = idx.clone()
    changed[:, t + 1 :] = torch.randint(0, 64, changed[:, t + 1 :].shape)
    out2 = fast(changed)
    same = torch.equal(out[:, : t + 1], out2[:, : t + 1])
    print(f"causal: outputs at positions <= {t} unchanged when later tokens change: {same}")
    if not same:
        raise SystemExit("causality violated")
    before, after = (sum(p.numel() for p in m.parameters()) for m in (model, fast))
    print(f"parameters: {before} with MultiheadAttention, {after} after the swap")


if __name__ == "__main__":
    main()
