"""Byte-level tokenizer: every UTF-8 byte is a token (vocabulary 256), nothing to train."""

from __future__ import annotations

import torch

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """Text <-> int64 token ids, one id per UTF-8 byte (``vocab_size`` = 256).

    ``decode(encode(s)) == s`` for every string; decoding arbitrary ids (e.g. model samples
    that split a multi-byte character) replaces invalid byte sequences with U+FFFD.
    """

    vocab_size: int = 256

    def encode(self, text: str) -> torch.Tensor:
        """``text`` -> (N,) int64 ids in [0, 256)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        data = text.encode("utf-8")
        if not data:
            return torch.zeros(0, dtype=torch.int64)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)

    def decode(self, ids) -> str:
        """(N,) ids (tensor or sequence of ints in [0, 256)) -> text."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if any((not isinstance(v, int)) or v < 0 or v > 255 for v in values):
            raise ValueError("ids must be integers in [0, 256) for the byte tokenizer")
        return bytes(values).decode("utf-8", errors="replace")
