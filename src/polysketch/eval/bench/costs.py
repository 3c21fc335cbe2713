"""Analytic cost model of ``polysketch bench``: FLOPs executed and memory alive at the peak.

FLOPs (analytic, per (batch, head) slice, feature maps NOT counted so GFLOP/s is a lower
bound), for the chunked scan ``ops.chunked.scan`` (the normalizer as row/key sums beside the
product, §4) with N = ⌈T/b⌉ blocks of b rows, M = N - 1 blocks that write (no final state is
built) and read (the first block reads nothing) a state, F features, value width E and F'
the state features per token: F plain; with ``square`` the F(⌊F/2⌋+1) symmetric pair
products ψ (``ops.pairs``), which the code builds explicitly (2 N b F' multiplies)::

    2 N b² F  +  2 N b² E  [+ N b² square]  +  N b² row sums         local lt blocks
    [+ 2 N b F' explicit square features of q and k]
    + 2 M b F' E                                                     block states
    + M F' E                                                         running state
    + 2 M b F' E                                                     queries read the state
    + 3 M b F'  (Σ Ψ(B), Ψq(A)·z)                                    key sums
    + T E                                                            normalisation

and for causal SDPA the useful work T² (D + E) (half of 2T²D + 2T²E).

Peak memory: with CUDA the measured ``torch.cuda.max_memory_allocated`` delta of the call;
on CPU an ANALYTIC estimate (in MiB) of the tensors alive at the peak of the call: for ours
inputs 3TD, features 2TF, values and output 2TE, row sums T, carried state F'(E+1), plus
one group of blocks of the scan (its temporaries are bounded by
``ops.dispatch.CPU_GROUP_BYTES``);
for
SDPA inputs and output 4TD plus, when its math backend is chosen, the 2T² score/probability
matrices (the fused CPU flash kernel stores no T×T matrix).
The ``max_memory_gb`` budget skips SDPA sizes whose T×T fp32 score matrix B·H·T²·4 bytes
would exceed it (reported ``skipped (memory)``), whatever backend would have run.
"""

from __future__ import annotations

from ...ops.chunked import _block_elements
from ...ops.dispatch import CPU_GROUP_BYTES as GROUP_BYTES
from ...ops.pairs import state_dim

__all__ = ["chunked_flops", "sdpa_flops", "chunked_memory", "sdpa_memory"]


def chunked_flops(t: int, *, feature_dim: int, value_dim: int, chunk_size: int, square: bool):
    """FLOPs executed by causal normalized ``linear_attention`` (chunked) per (batch, head) slice.

    Counts the work the implementation does (module docstring): the normalizer as row and key
    sums beside the E-wide product (``ops.chunked``); with ``square`` the per-token features
    are built explicitly, as the F(⌊F/2⌋+1) symmetric pair products. No final state is built
    (the forward returns none), and the first block reads no state.
    """
    b = min(chunk_size, t)
    n = -(-t // b)
    m = n - 1  # blocks that write a state (all but the last) and read one (all but the first)
    f, e = feature_dim, value_dim
    local = 2 * n * b * b * f + 2 * n * b * b * e + (n * b * b if square else 0)
    fe = state_dim(f, square)
    build = 2 * n * b * fe if square else 0  # explicit pair features of q and k
    # normalizer: row sums of the local scores; key sums Σ Ψ(B); reads Ψq(A)·z
    sums = n * b * b + 3 * m * b * fe
    states = 2 * m * b * fe * e
    apply = 2 * m * b * fe * e
    return local + build + sums + states + m * fe * e + apply + t * e


def sdpa_flops(t: int, *, head_dim: int, value_dim: int) -> int:
    """Useful FLOPs of causal softmax attention per slice: T²(D + E)."""
    return t * t * (head_dim + value_dim)


def chunked_memory(t, *, d, f, e, chunk, square, slices: int = 1) -> int:
    """Bytes alive at the peak of the group scan over ``slices`` (batch·head) slices (fp32)."""
    b = min(chunk, t)
    n = -(-t // b)
    ec = e
    fs = state_dim(f, square)  # ops.chunked builds the square (pair) features explicitly
    # inputs, features, values, output and row sums; carried state and key sums
    resident = 4 * slices * (3 * t * d + 2 * t * f + 2 * t * ec + t + fs * (ec + 1))
    per_block = 4 * slices * _block_elements(b, f, ec, fs, square=square, expand=square)
    group = max(1, min(n, GROUP_BYTES // max(1, per_block)))  # blocks per group (ops.chunked)
    return resident + group * per_block


def sdpa_memory(t, *, d, math_backend: bool) -> int:
    """Bytes alive in causal SDPA (fp32): inputs and output, plus 2T² with the math backend."""
    return 4 * (4 * t * d + (2 * t * t if math_backend else 0))
