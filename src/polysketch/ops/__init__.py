"""Sequence mixing on features (see README): exact references, chunked/cumsum/recurrent linear attention, mixed local+global."""
