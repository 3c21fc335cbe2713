"""What ``polysketch demo`` runs: the sizes of every section and the attention it compares.

``FULL`` (≈ 10 minutes on 2 CPU cores), ``CUDA_FULL`` (on a CUDA device) and ``QUICK`` (≈ 1
minute, the tests' version) are ``DemoSizes``; ``polysketch_attention()`` is the attention the
quality and fidelity sections compare with softmax (``psf_random``, else ``polysketch``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DemoSizes", "FULL", "CUDA_FULL", "QUICK", "polysketch_attention"]


@dataclass(frozen=True)
class DemoSizes:
    """Sizes of every section (``FULL`` ≈ 10 minutes on 2 cores, ``QUICK`` ≈ 1 minute)."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch_size: int
    steps: int
    eval_interval: int
    eval_batches: int
    lr: float
    warmup_steps: int
    max_bytes: int | None  # corpus bytes read (None: all)
    sample_tokens: int
    capture_batch: int  # validation sequences run through the model to capture q/k
    num: int  # queries and keys per head in fidelity
    feature_dims: tuple[int, ...]
    trials: int
    fit_steps: int
    lengths: tuple[int, ...]
    min_time: float
    matmul_n: int
    speed_passes: int = 3  # runs of the whole speed benchmark (the spread of every point)


FULL = DemoSizes(
    n_layer=4, n_head=2, n_embd=64, block_size=128, batch_size=16, steps=600,
    eval_interval=50, eval_batches=8, lr=2e-3, warmup_steps=50, max_bytes=None,
    sample_tokens=240, capture_batch=8, num=256, feature_dims=(16, 32, 64, 128), trials=3,
    fit_steps=200, lengths=(256, 512, 1024, 2048, 4096, 8192), min_time=0.1, matmul_n=2048,
)  # fmt: skip
CUDA_FULL = DemoSizes(
    n_layer=6, n_head=6, n_embd=384, block_size=1024, batch_size=16, steps=600,
    eval_interval=100, eval_batches=8, lr=1e-3, warmup_steps=60, max_bytes=None,
    sample_tokens=400, capture_batch=8, num=256, feature_dims=(16, 32, 64, 128), trials=3,
    fit_steps=200, lengths=(1024, 2048, 4096, 8192, 16384, 32768, 65536), min_time=0.2,
    matmul_n=4096,
)  # fmt: skip
"""On a CUDA device: the paper's head dim 64 (6 × 384, 6 heads) at context 1024 trained under
bf16 autocast, and attention timed to 64k (forward, decode, and forward + backward)."""
QUICK = DemoSizes(
    n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=4, steps=8, eval_interval=4,
    eval_batches=2, lr=3e-3, warmup_steps=2, max_bytes=200_000, sample_tokens=30,
    capture_batch=2, num=48, feature_dims=(8, 16), trials=1, fit_steps=5,
    lengths=(64, 128, 256), min_time=0.0, matmul_n=256,
)  # fmt: skip


def polysketch_attention() -> str:
    """The polysketch attention the demo compares with softmax: ``psf_random``."""
    return "psf_random"
