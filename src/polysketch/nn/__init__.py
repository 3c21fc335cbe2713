"""Attention layer and language model."""
