"""Calibrate an LLoPS feature map on the queries/keys of a model's attention layer.

LLoPS (``features.create("llops", D, degree=p, num_features=m)``) is a learnable polynomial
sketch φ(X) = Σ_r ∏_j X Θ_{j,r} with separate Θ for queries and keys (LLoPS Def. 3.3). Its
``fit(q, k)`` minimises ‖φq(Q)φk(K)ᵀ − (QKᵀ)^{∘p}‖_F² (LLoPS Eq. 6) on sampled queries and keys.

1. Train a tiny ``TransformerLM`` with exact degree-4 polynomial attention
   (``attention="polynomial"``: LayerNorm on q/k, scores (q·k)^4, quadratic in T) for a few
   steps on a built-in text.
2. Capture the q and k that its first layer's attention core sees (after the q/k LayerNorm and
   RoPE) with ``polysketch.eval.fidelity.capture.capture_qk``; split the token positions into a
   fitting half and a test half.
3. For one head, build LLoPS with m features (initialised as a polynomial sketch), measure the
   RMAE (LLoPS Eq. 21) and relative Frobenius error against (QKᵀ)^{∘4} on the test tokens,
   fit on the other tokens, measure again, and compare with the optimum: the truncated SVD of
   the test kernel matrix (Eckart–Young, LLoPS Thm 3.1), the best any m-dimensional feature
   map could do on these very tokens.

Run: ``python examples/calibrate_llops.py`` (well under a minute on CPU).
"""

from __future__ import annotations

import torch

from polysketch.data.corpus import Corpus
from polysketch.data.tokenizer import ByteTokenizer
from polysketch.eval.fidelity import (
    optimal_rank_approximation,
    polynomial_target,
    relative_frobenius_error,
    rmae,
)
from polysketch.eval.fidelity.capture import capture_qk, head_samples, split_tokens
from polysketch.features import create
from polysketch.nn import TransformerConfig
from polysketch.train import TrainConfig, train

DEGREE = 4
NUM_FEATURES = 32
TEXT = (
    "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune, "
    "or to take arms against a sea of troubles and by opposing end them. To die, to sleep; "
    "no more; and by a sleep to say we end the heart-ache and the thousand natural shocks "
    "that flesh is heir to.\n"
) * 20


def scores(label: str, approx: torch.Tensor, exact: torch.Tensor) -> None:
    print(
        f"{label:<28} RMAE {rmae(approx, exact):8.4f}   "
        f"relative Frobenius {relative_frobenius_error(approx, exact):8.4f}"
    )


def main() -> None:
    torch.manual_seed(0)
    tokens = ByteTokenizer().encode(TEXT)
    split = int(0.9 * len(tokens))
    corpus = Corpus(tokens[:split], tokens[split:], 256, "built-in text")
    config = TransformerConfig(
        n_layer=1, n_head=2, n_embd=32, block_size=64, attention="polynomial", chunk_size=32
    )
    train_config = TrainConfig(
        steps=20, batch_size=8, lr=3e-3, min_lr=3e-4, warmup_steps=5, eval_interval=None,
        eval_batches=1, seed=0,
    )  # fmt: skip
    history = train(config, train_config, corpus, progress=False)
    print(f"trained: loss {history['train'][0]['loss']:.3f} -> {history['train'][-1]['loss']:.3f}")

    # q, k as the attention core of layer 0 sees them, from 8 sequences of 64 bytes.
    idx = corpus.train[: 8 * 64].reshape(8, 64)
    captured = capture_qk(history["model"], idx, layers=[0])
    fit_pos, test_pos = split_tokens(idx.numel(), 2, seed=0)
    q_fit, k_fit = head_samples(captured, num=256, seed=1, positions=fit_pos)
    q, k = head_samples(captured, num=256, seed=2, positions=test_pos)
    head = 0
    q_fit, k_fit, q, k = q_fit[head], k_fit[head], q[head], k[head]  # (N, D) of one head
    print(
        f"captured head {head}: {q.shape[0]} test and {q_fit.shape[0]} fitting tokens, "
        f"D = {q.shape[1]}"
    )

    exact = polynomial_target(q, k, DEGREE)
    llops = create("llops", q.shape[-1], degree=DEGREE, num_features=NUM_FEATURES, seed=0)
    llops = llops.to(torch.float64)
    print(f"targets (q·k)^{DEGREE}; LLoPS with m = {llops.state_dim} features")
    with torch.no_grad():
        scores("LLoPS at init (sketch)", llops.approx_kernel(q, k), exact)
    losses = llops.fit(q_fit, k_fit, steps=200, lr=2e-2, seed=0, progress=False)
    print(f"fit: training loss {losses[0]:.4f} -> {losses[-1]:.4f} (on the fitting tokens)")
    with torch.no_grad():
        scores("LLoPS after fit", llops.approx_kernel(q, k), exact)
    scores(
        f"optimal rank-{llops.state_dim} (SVD)",
        optimal_rank_approximation(exact, llops.state_dim),
        exact,
    )
    print("(the SVD optimum is computed on the test tokens themselves: a lower bound on the")
    print(" relative Frobenius error of any map with that many features, LLoPS Thm 3.1)")


if __name__ == "__main__":
    main()
