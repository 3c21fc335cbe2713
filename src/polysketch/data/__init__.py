"""Corpora, tokenizer and the MQAR synthetic task."""
