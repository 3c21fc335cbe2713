"""Queries and keys for the retrieval table: LayerNorm'd Gaussians, or captured from a model.

* ``layer_norm_gaussian(n, D)``: rows x = LayerNorm(g), g ~ N(0, I_D), without affine — what
  a q/k LayerNorm makes of unstructured projections: mean 0 and ‖x‖ = √D (up to LayerNorm's
  ε), so q·k/√D ~ N(0, 1) between unrelated rows and = √D for a row with itself.
* ``near_queries(keys, cosine, others)``: for each key k, the query
  q = ‖k‖ (c k̂ + √(1 − c²) û), where û is the unit part of another row r orthogonal to k
  (r − (r·k̂)k̂, normalized): cos(q, k) = c exactly, ‖q‖ = ‖k‖, and q stays in the span of
  the data (for LayerNorm'd rows it is again mean 0 with norm √D). c = 1 returns the keys.
* ``CapturedHeads``: the keys and queries of every (layer, head) of a trained
  ``TransformerLM``, captured after its q/k LayerNorm and RoPE
  (``polysketch.eval.fidelity.capture``) on validation windows, with a seeded split of token
  positions into a *fit* part (to fit learnable maps) and a disjoint *measure* part (the
  keys that are measured).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from polysketch.eval.fidelity.capture import capture_qk
from polysketch.random import make_generator

__all__ = ["layer_norm_gaussian", "near_queries", "CapturedHeads", "capture_heads", "load_model"]


def layer_norm_gaussian(
    n: int, dim: int, *, generator: torch.Generator, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """(n, D) rows LayerNorm(g), g ~ N(0, I_D) (no affine, ε = 1e-5 as torch's default)."""
    g = torch.randn(n, dim, generator=generator, dtype=torch.float64)
    return F.layer_norm(g, (dim,)).to(dtype)


def near_queries(keys: torch.Tensor, cosine: float, others: torch.Tensor) -> torch.Tensor:
    """Queries at cosine ``cosine`` to each key with the key's norm (module docstring).

    keys, others: (n, D); row i of ``others`` supplies the direction orthogonal to key i.
    A row parallel to its key (a captured key that recurs among the fit keys) is replaced by
    the next row of ``others``, cyclically, that is not; if every row is, ValueError.
    Returns (n, D).
    """
    if not 0.0 < cosine <= 1.0:
        raise ValueError(f"cosine must be in (0, 1], got {cosine}")
    if others.shape != keys.shape:
        raise ValueError(f"others must have the shape of keys {tuple(keys.shape)}")
    if cosine == 1.0:
        return keys.clone()
    norm = keys.norm(dim=-1, keepdim=True)
    unit = keys / norm

    def orthogonal(rows):
        ortho = rows - (rows * unit).sum(-1, keepdim=True) * unit
        size = ortho.norm(dim=-1, keepdim=True)
        return ortho, size, (size <= 1e-9 * rows.norm(dim=-1, keepdim=True)).squeeze(-1)

    ortho, size, bad = orthogonal(others)
    for shift in range(1, others.shape[0]):
        if not bool(bad.any()):
            break
        o2, s2, b2 = orthogonal(others.roll(-shift, dims=0))
        fix = bad & ~b2
        ortho, size = torch.where(fix[:, None], o2, ortho), torch.where(fix[:, None], s2, size)
        bad = bad & b2
    if bool(bad.any()):
        raise ValueError("others must not all be parallel to a key")
    return norm * (cosine * unit + (1.0 - cosine**2) ** 0.5 * ortho / size)


def load_model(path):
    """The ``TransformerLM`` of a ``polysketch train`` checkpoint, in eval mode, on the CPU."""
    from polysketch.train import load_model as _load

    return _load(path, "cpu")[0]


@dataclass
class CapturedHeads:
    """Captured q/k of every (layer, head), split into fit and measure positions.

    Attributes:
        keys: (L·H, N_measure, D) keys at the measure positions.
        fit_q, fit_k: (L·H, N_fit, D) queries and keys at the fit positions.
        labels: "layer l head h" per head.
        attention: the model's attention setting; windows, window_len: what was captured.
    """

    keys: torch.Tensor
    fit_q: torch.Tensor
    fit_k: torch.Tensor
    labels: list[str]
    attention: str
    windows: int
    window_len: int


@torch.no_grad()
def capture_heads(
    model,
    tokens: torch.Tensor,
    *,
    num_positions: int,
    num_fit: int,
    seed: int = 0,
    batch: int = 16,
    dtype: torch.dtype = torch.float64,
) -> CapturedHeads:
    """Capture (q, k) of every head on windows of ``tokens`` (the model's block size).

    ``num_positions`` tokens are captured (rounded up to whole windows, consecutive windows
    from the start of ``tokens``, ``batch`` windows per forward pass); a seeded permutation of
    the positions gives ``num_fit`` fit positions, the rest are measure positions.
    """
    t = int(model.config.block_size)
    windows = -(-num_positions // t)
    if tokens.numel() < windows * t:
        raise ValueError(
            f"tokens hold {tokens.numel()} ids, fewer than {windows} windows of {t}: lower "
            "num_positions"
        )
    idx = tokens[: windows * t].reshape(windows, t)
    qs, ks = [], []
    for i in range(0, windows, batch):
        captured = capture_qk(model, idx[i : i + batch])
        # (B, H, T, D) per layer -> (L·H, B·T, D)
        qs.append(torch.cat([c.q.transpose(0, 1).flatten(1, 2) for c in captured]))
        ks.append(torch.cat([c.k.transpose(0, 1).flatten(1, 2) for c in captured]))
    q, k = torch.cat(qs, dim=1).to(dtype), torch.cat(ks, dim=1).to(dtype)
    perm = torch.randperm(q.shape[1], generator=make_generator(seed))
    fit, measure = perm[:num_fit], perm[num_fit:]
    heads = model.config.n_head
    labels = [f"layer {i // heads} head {i % heads}" for i in range(q.shape[0])]
    return CapturedHeads(
        keys=k[:, measure].contiguous(),
        fit_q=q[:, fit].contiguous(),
        fit_k=k[:, fit].contiguous(),
        labels=labels,
        attention=model.config.attention,
        windows=windows,
        window_len=t,
    )
