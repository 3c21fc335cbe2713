"""Loss by position on long natural documents, and extrapolation beyond the training length.

A model that uses far context predicts late positions of a document better than early ones:
at position i it has i bytes of the same document to read. On windows that lie inside one
document (``document_windows``), the mean loss at position i over windows
(``position_losses``) is averaged over buckets of positions (``bucket_losses``, e.g.
[0, 256), [256, 1024), [1024, 2048)). Evaluating a model trained at T = 2048 on windows of
8k or 32k (``extrapolation``) shows whether it keeps using context past its training length
or breaks down there.

Documents are the corpus' own (e.g. each Shakespeare play is one document of 100–200 kB);
``validation_documents`` returns the ones that lie wholly in the corpus' validation split, so
a model trained on the training split never saw them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polysketch.data.corpus import DOC_SEPARATOR, load_documents
from polysketch.data.tokenizer import ByteTokenizer
from polysketch.random import make_generator

from .repeat_probe import token_losses

__all__ = [
    "DEFAULT_BUCKETS",
    "validation_documents",
    "document_windows",
    "position_losses",
    "bucket_losses",
    "bucket_edges",
]

DEFAULT_BUCKETS = (0, 256, 1024, 2048, 4096, 8192, 16384, 32768)
"""Bucket edges (positions); ``bucket_edges`` keeps those below a window's length."""


def validation_documents(
    source="shakespeare", *, val_fraction: float = 0.1, max_bytes: int | None = None
) -> list[torch.Tensor]:
    """The byte-token documents of ``source`` that lie wholly in ``load_corpus``'s
    validation split (the last ``val_fraction`` of the joined text)."""
    docs = load_documents(source, max_bytes=max_bytes)
    tok = ByteTokenizer()
    encoded = [tok.encode(d) for d in docs]
    sep = len(DOC_SEPARATOR.encode())
    total = sum(len(e) for e in encoded) + sep * (len(encoded) - 1)
    split = total - max(1, int(total * val_fraction))
    out, start = [], 0
    for e in encoded:
        if start >= split:
            out.append(e)
        start += len(e) + sep
    return out


def document_windows(
    documents: Sequence[torch.Tensor], length: int, num: int, *, seed: int = 0
) -> torch.Tensor:
    """``num`` windows of ``length`` + 1 tokens, each inside one document: (num, length + 1).

    Documents shorter than length + 1 are skipped; windows are drawn round-robin over the
    long enough documents at seeded random offsets. Raises ValueError if none is long enough.
    """
    long_enough = [d for d in documents if d.numel() >= length + 1]
    if not long_enough:
        longest = max((d.numel() for d in documents), default=0)
        raise ValueError(
            f"no document holds length + 1 = {length + 1} tokens (longest {longest}): use a "
            "shorter length or a corpus of longer documents"
        )
    gen = make_generator(seed)
    rows = []
    for i in range(num):
        doc = long_enough[i % len(long_enough)]
        start = int(torch.randint(doc.numel() - length, (1,), generator=gen))
        rows.append(doc[start : start + length + 1])
    return torch.stack(rows)


def position_losses(model, windows: torch.Tensor, *, batch: int = 1) -> torch.Tensor:
    """Mean over windows of the loss at each position: (N, T + 1) windows -> (T,)."""
    losses = token_losses(model, windows[:, :-1], windows[:, 1:], batch=batch)
    return losses.mean(0)


def bucket_edges(length: int, edges: Sequence[int] = DEFAULT_BUCKETS) -> list[int]:
    """``edges`` below ``length``, closed by ``length``: [0, …, length]."""
    kept = sorted({int(e) for e in edges if 0 <= int(e) < length} | {0})
    return kept + [int(length)]


def bucket_losses(per_position: torch.Tensor, edges: Sequence[int]) -> list[tuple[int, int, float]]:
    """(lo, hi, mean loss over positions lo ≤ i < hi) for consecutive ``edges``."""
    edges = list(edges)
    if len(edges) < 2 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(f"edges must be increasing with at least two entries, got {edges}")
    if edges[-1] > per_position.numel() or edges[0] < 0:
        raise ValueError(f"edges must lie in [0, {per_position.numel()}], got {edges}")
    return [(a, b, float(per_position[a:b].mean())) for a, b in zip(edges, edges[1:], strict=False)]
