"""Kernel-level retrieval: the attention weight on the matching key among t keys.

For a query q whose matching key is k* among keys k_1 … k_t (k* one of them),

    w(q) = s(q, k*) / (c + Σ_{j=1..t} s(q, k_j)),

the share of q's attention row that goes to k* (c is the normalizer offset, PolySketchFormer's
1 in 1 + Σ). Attention that keeps long context keeps w high as t grows; an attention whose
scores carry a per-key floor (a sketch's variance, ``docs/quality_gap.md`` §1) averages the
prefix once t·floor dominates s(q, k*).

Kernels (``Kernel``) and how the sum is formed, never as a t × t (or q × t feature) matrix:

* ``SoftmaxKernel``: s = exp(scale·q·k), c = 0; w = exp(scale·q·k* − logsumexp_j scale·q·k_j),
  the logsumexp accumulated over chunks of keys (q × chunk logits at a time);
* ``PolynomialKernel``: s = (q·k)^p (PolySketchFormer Eq. 1), the sum over chunks of keys;
* ``FeatureKernel``: s = φq(q)·φk(k), or (φq(q)·φk(k))² for ``square`` maps (Eq. 2):
  Σ_j s = φq(q)·Σ_j φk(k_j), resp. φq(q)ᵀ Z φq(q) with Z = Σ_j φk(k_j) φk(k_j)ᵀ (F × F),
  both accumulated over chunks of keys: O(t·F) (O(t·F²) for Z) time and O(F²) memory, so
  t = 64k keys fit whatever F.

``naive_match_weights`` is the reference with the same signature: it forms the full q × t
score matrix (``Kernel.scores``) and divides; tests compare the two.

The rank bound: for non-negative scores, let S be the t × t score matrix of the keys
themselves (queries = keys) and R = diag(c + S·1). R⁻¹S has non-negative entries and row sums
≤ 1, so every eigenvalue has modulus ≤ 1, and at most rank(S) ≤ F′ are non-zero; hence
Σ_i w_i = tr(R⁻¹S) ≤ F′ and the mean exact-match weight is ≤ min(1, F′/t). F′ (``rank_bound``)
is F for a map of F features, F(F+1)/2 for a ``square`` map (the symmetric pairs of φ⊗φ span
its scores; its decode state keeps F(⌊F/2⌋+1) cyclic pairs, ``state_dim``, ops/pairs.py),
C(D+p−1, p) for exact degree-p scores (the symmetric power), and none for softmax (exp(q·k)
has full rank: its state is the KV cache).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

__all__ = [
    "Kernel",
    "SoftmaxKernel",
    "PolynomialKernel",
    "FeatureKernel",
    "match_weights",
    "naive_match_weights",
    "rank_bound_for",
    "DEFAULT_CHUNK",
]

DEFAULT_CHUNK = 4096
"""Keys per chunk when accumulating sums (bounds memory at chunk × max(F, queries))."""


def _check(q: torch.Tensor, keys: torch.Tensor, match: torch.Tensor) -> torch.Tensor:
    if not isinstance(q, torch.Tensor) or not isinstance(keys, torch.Tensor):
        raise TypeError("q and keys must be tensors")
    if q.dim() != 2 or keys.dim() != 2 or q.shape[1] != keys.shape[1]:
        raise ValueError(
            f"q must be (n, D) and keys (t, D) with the same D, got {tuple(q.shape)} and "
            f"{tuple(keys.shape)}"
        )
    match = torch.as_tensor(match, dtype=torch.int64)
    if match.shape != (q.shape[0],):
        raise ValueError(f"match must hold one key index per query, shape ({q.shape[0]},)")
    if q.shape[0] and (int(match.min()) < 0 or int(match.max()) >= keys.shape[0]):
        raise ValueError(f"match must index the {keys.shape[0]} keys")
    return match


class Kernel(ABC):
    """A score s(q, k) with its normalizer offset c (see the module docstring).

    Attributes:
        offset: c, added to every normalizer.
        nonnegative: every score is >= 0 (the rank bound applies).
        rank_bound: F′, an upper bound on the rank of any score matrix (None: full rank).
        state_dim: decode-state features per value dim (None: a KV cache that grows with t).
    """

    offset: float = 0.0
    nonnegative: bool = True
    rank_bound: int | None = None
    state_dim: int | None = None

    @abstractmethod
    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """s(q_i, k_j): (n, D), (m, D) -> (n, m)."""

    @abstractmethod
    def _weights(self, q, keys, match, chunk: int) -> torch.Tensor:
        """w per query (module docstring), computed without the q × t score matrix."""

    def bound(self, t: int) -> float | None:
        """min(1, F′/t) for non-negative scores of rank <= F′; None where no bound holds."""
        if not self.nonnegative or self.rank_bound is None:
            return None
        return min(1.0, self.rank_bound / t)


class SoftmaxKernel(Kernel):
    """s = exp(scale·q·k), no offset (softmax attention)."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def scores(self, q, k):
        return torch.exp(self.scale * (q @ k.T))

    def _weights(self, q, keys, match, chunk):
        lse = torch.full((q.shape[0],), -math.inf, dtype=q.dtype, device=q.device)
        for i in range(0, keys.shape[0], chunk):
            logits = self.scale * (q @ keys[i : i + chunk].T)
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
        return torch.exp(self.scale * (q * keys[match]).sum(-1) - lse)


class PolynomialKernel(Kernel):
    """s = (q·k)^p with normalizer offset c (exact polynomial attention)."""

    def __init__(self, degree: int, *, offset: float, dim: int):
        self.degree = int(degree)
        self.offset = float(offset)
        self.nonnegative = self.degree % 2 == 0
        self.rank_bound = math.comb(dim + self.degree - 1, self.degree)
        self.state_dim = self.rank_bound

    def scores(self, q, k):
        return (q @ k.T) ** self.degree

    def _weights(self, q, keys, match, chunk):
        total = torch.zeros(q.shape[0], dtype=q.dtype, device=q.device)
        for i in range(0, keys.shape[0], chunk):
            total += ((q @ keys[i : i + chunk].T) ** self.degree).sum(1)
        return (q * keys[match]).sum(-1) ** self.degree / (self.offset + total)


class FeatureKernel(Kernel):
    """s = φq(q)·φk(k) (squared when the map is ``square``) with normalizer offset c."""

    def __init__(self, feature_map, *, offset: float):
        self.map = feature_map
        self.offset = float(offset)
        self.square = bool(feature_map.square)
        self.nonnegative = bool(feature_map.nonnegative)
        f = int(feature_map.feature_dim)
        self.rank_bound = rank_bound_for(f, square=self.square)
        self.state_dim = int(feature_map.state_dim)

    def scores(self, q, k):
        return self.map.approx_kernel(q, k)

    @torch.no_grad()
    def _weights(self, q, keys, match, chunk):
        phi_q = self.map.query(q)
        num = (phi_q * self.map.key(keys[match])).sum(-1)
        if self.square:
            f = phi_q.shape[-1]
            z = torch.zeros(f, f, dtype=phi_q.dtype, device=phi_q.device)
            for i in range(0, keys.shape[0], chunk):
                phi_k = self.map.key(keys[i : i + chunk])
                z += phi_k.T @ phi_k
            return num * num / (self.offset + ((phi_q @ z) * phi_q).sum(-1))
        total = torch.zeros(phi_q.shape[-1], dtype=phi_q.dtype, device=phi_q.device)
        for i in range(0, keys.shape[0], chunk):
            total += self.map.key(keys[i : i + chunk]).sum(0)
        return num / (self.offset + phi_q @ total)


def rank_bound_for(num_features: int, *, square: bool) -> int:
    """F′: F, or F(F+1)/2 for a square map (symmetric pairs of φ⊗φ)."""
    f = int(num_features)
    return f * (f + 1) // 2 if square else f


@torch.no_grad()
def match_weights(
    kernel: Kernel,
    q: torch.Tensor,
    keys: torch.Tensor,
    match: torch.Tensor,
    *,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """w_i = s(q_i, k_{match_i}) / (c + Σ_j s(q_i, k_j)) for q (n, D), keys (t, D) -> (n,).

    Sums are accumulated over ``chunk`` keys at a time (module docstring); no q × t matrix.
    """
    match = _check(q, keys, match)
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    return kernel._weights(q, keys, match, chunk)


@torch.no_grad()
def naive_match_weights(
    kernel: Kernel,
    q: torch.Tensor,
    keys: torch.Tensor,
    match: torch.Tensor,
    *,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """The reference for ``match_weights``: the full (n, t) score matrix, then one division.

    ``chunk`` is accepted for the same signature and ignored.
    """
    match = _check(q, keys, match)
    s = kernel.scores(q, keys)
    return s[torch.arange(q.shape[0]), match] / (kernel.offset + s.sum(1))
