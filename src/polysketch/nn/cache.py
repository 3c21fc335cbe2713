"""Decode caches of the attention core: what a layer keeps per sequence between steps.

* ``RecurrentCache`` (feature-map attention): the constant-size state of causal linear
  attention, N = Σ_j Ψ(φk_j) ⊗ v_j and Z = Σ_j Ψ(φk_j) (the pair features of ``ops.pairs``
  with ``square``), a ``polysketch.ops.LinearAttentionState`` (PolySketchFormer §3: linear
  attention is an RNN). H·F'·(E + 1) floats per sequence, F' = F or F(⌊F/2⌋+1), whatever
  the length. One token is one fused update and read (``ops.linear_attention_step``).
* ``KVCache`` (``softmax`` and exact ``polynomial``): every key and value so far, 2·H·D·t
  floats at position t — the quadratic-attention baseline.
* ``MixedCache`` (mixed attention): the state of the completed blocks plus the keys, key
  features and values of the current, incomplete block (< b tokens)
  (``ops.mixed_attention_step``): bounded by H·(F'(E + 1) + b(D + F + E)) floats. Rows whose
  block grids differ (padded batches: each row's grid starts at its first real token,
  ``nn.padding``) keep one state each.
* ``WindowCache`` (``sliding_window``): the keys and values of the last w real tokens of
  each row, H·(D + E)·min(t, w) floats.
* ``ParallelCache``: a block with a sliding-window branch beside its attention
  (``TransformerConfig.local_window``) keeps one cache per branch.

Every cache counts ``length``, the time steps consumed (padded ones included), holds
``conv_tail``, the last K - 1 projections of a layer with a short convolution
(``KernelAttention(short_conv=K)``), else None, and ``positions``: per row, the RoPE position
of the next token (the real tokens consumed, ``nn.padding``), or None while every row has
consumed ``length`` real tokens. ``select_rows(index)`` keeps / reorders / repeats rows
(beam search). A cache is made by ``AttentionCore.new_cache()`` and filled in place by the
layer's forward with ``cache=``; ``TransformerLM.generate`` keeps one per layer.
"""

from __future__ import annotations

import torch

from ..ops import LinearAttentionState
from ..ops.mixed_step import (
    MixedAttentionState,
    far_attention_token,
    mixed_attention_state,
    mixed_attention_step,
    mixed_attention_token,
)

__all__ = ["RecurrentCache", "KVCache", "MixedCache", "WindowCache", "ParallelCache", "LayerCache"]


def _numel(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel()


def _rows(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, index.to(t.device))


class _Cache:
    """What every cache holds besides its state (module docstring)."""

    def __init__(self) -> None:
        self.length = 0
        self.conv_tail: torch.Tensor | None = None  # short convolution: (B, K-1, C)
        self.positions: torch.Tensor | None = None  # (B,) RoPE position of the next token

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (B',) int64 of the batch, in that order (repeats allowed)."""
        self.conv_tail = _rows(self.conv_tail, index)
        self.positions = _rows(self.positions, index)
        self._select_state(index)

    def _select_state(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` of the attention's own state; each cache class defines it."""
        raise NotImplementedError(f"{type(self).__name__} must define _select_state")


class RecurrentCache(_Cache):
    """Linear-attention decode state: ``state`` (a ``LinearAttentionState`` or None), ``length``."""

    def __init__(self) -> None:
        super().__init__()
        self.state: LinearAttentionState | None = None

    def num_floats(self) -> int:
        """Floats held per batch (all sequences of the batch together)."""
        tail = _numel(self.conv_tail)
        if self.state is None:
            return tail
        return self.state.numerator.numel() + self.state.denominator.numel() + tail

    def _select_state(self, index):
        if self.state is not None:
            st = self.state
            self.state = LinearAttentionState(
                _rows(st.numerator, index), _rows(st.denominator, index), st.length
            )


class KVCache(_Cache):
    """Keys (B, H, t, D) and values (B, H, t, E) of every token so far, with ``keep`` (B, t).

    Keys and values live in buffers of capacity ≥ t that grow by a quarter (at least
    ``MIN_CAPACITY`` rows) when full, so appending n tokens writes n rows and copies at most
    4n more in amortized terms (as a list's append), holding ≤ 1.25 t + 64 rows, where a
    ``torch.cat`` per step copies all t rows (O(t) a token, which dominated a long-context
    decode step on a GPU: ``docs/gpu.md``).
    ``append`` returns views of the filled rows. Under autograd (a key or value that requires
    grad, with grad enabled) it appends by ``torch.cat`` instead, the reference path: an in-place
    write could change a tensor a graph saved. ``num_floats`` counts the t filled rows."""

    MIN_CAPACITY = 64
    """Rows of room a buffer gets at least, on the prompt and on each growth (else a quarter
    of the rows it must hold)."""

    def __init__(self) -> None:
        super().__init__()
        self._k: torch.Tensor | None = None  # (B, H, capacity, D); rows [0, length) filled
        self._v: torch.Tensor | None = None
        self._owned = False  # _k, _v are this cache's buffers (else a caller's or a graph's)
        self.keep: torch.Tensor | None = None

    @property
    def k(self) -> torch.Tensor | None:
        return _filled(self._k, self.length)

    @property
    def v(self) -> torch.Tensor | None:
        return _filled(self._v, self.length)

    def append(
        self, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Append n tokens (k (B, H, n, D), v (B, H, n, E), keep (B, n) or None); return all."""
        n, t = k.shape[-2], self.length
        self.keep = _append_keep(self.keep, keep, t, k)
        if self._k is None and (_under_autograd(k) or _under_autograd(v)):
            self._k, self._v, self._owned = k, v, False
        elif self._k is None:  # the prompt: into buffers with room for a quarter more
            self._k, self._v, self._owned = _grown(k, n), _grown(v, n), True
        elif _by_cat(self._k, k) or _by_cat(self._v, v):  # the reference path
            self._k, self._v = torch.cat([self.k, k], dim=-2), torch.cat([self.v, v], dim=-2)
            self._owned = False
        else:
            if not self._owned or t + n > self._k.shape[-2] or _frozen(self._k):
                self._k, self._v = _grown(self.k, t + n), _grown(self.v, t + n)
                self._owned = True
            self._k.narrow(-2, t, n).copy_(k)
            self._v.narrow(-2, t, n).copy_(v)
        self.length = t + n
        return self.k, self.v, self.keep

    def num_floats(self) -> int:
        kv = 0 if self._k is None else self.k.numel() + self.v.numel()
        return kv + _numel(self.conv_tail)

    def _select_state(self, index):
        self._k, self._v = _rows(self.k, index), _rows(self.v, index)
        self._owned = False
        self.keep = _rows(self.keep, index)


def _filled(buffer: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """The first ``rows`` rows of a key or value buffer (itself when it holds no more)."""
    if buffer is None or buffer.shape[-2] == rows:
        return buffer
    return buffer.narrow(-2, 0, rows)


def _frozen(buffer: torch.Tensor) -> bool:
    """A buffer made under ``torch.inference_mode`` cannot be written outside it: copy it."""
    return buffer.is_inference() and not torch.is_inference_mode_enabled()


def _under_autograd(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def _by_cat(held: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether appending ``x`` to ``held`` must go by ``torch.cat`` (``KVCache``): under
    autograd, or where a buffer of ``held``'s layout cannot take x's rows as they are."""
    if _under_autograd(x) or _under_autograd(held):
        return True
    return (held.shape[:-2] != x.shape[:-2] or held.shape[-1] != x.shape[-1]
            or held.dtype != x.dtype or held.device != x.device)  # fmt: skip


def _grown(filled: torch.Tensor, rows: int) -> torch.Tensor:
    """A new buffer of capacity rows + max(rows // 4, MIN_CAPACITY) holding ``filled`` in its
    first rows (the rest uninitialized: never read, ``k`` / ``v`` view the filled rows only)."""
    capacity = rows + max(rows // 4, KVCache.MIN_CAPACITY)
    buffer = filled.new_empty(*filled.shape[:-2], capacity, filled.shape[-1])
    buffer[..., : filled.shape[-2], :] = filled
    return buffer


def _append_keep(old, keep, length, k):
    """The key mask after appending n tokens with mask ``keep`` (B, n) or None (all kept)."""
    if keep is None and old is None:
        return None
    if old is None and length:
        old = torch.ones(k.shape[0], length, dtype=torch.bool, device=k.device)
    new = keep if keep is not None else torch.ones_like(k[:, 0, :, 0], dtype=torch.bool)
    return new if old is None else torch.cat([old, new], dim=-1)


class MixedCache(_Cache):
    """Mixed local/global decode state: one ``polysketch.ops.MixedAttentionState`` for the
    batch (``batch``: ``summary`` [N Z] of the completed blocks (B, H, F', E+1), the current
    block's ``k``, ``phi_k``, ``v``) while every row shares one block grid, else one per row
    (``rows``, leading dims (1, H)), each stepped by ``ops.mixed_attention_step``."""

    def __init__(self, chunk_size: int, square: bool, local: str = "polynomial",
                 key_features=None) -> None:  # fmt: skip
        super().__init__()
        self.chunk_size = chunk_size
        self.square = square
        self.local = local  # the in-block kernel: "polynomial" or "none" (ops.mixed)
        # local="none": the current block keeps raw keys, featurized by this when it completes
        # (ops.mixed_step.far_attention_token); None keeps their features
        self.key_features = key_features
        self.batch: MixedAttentionState | None = None
        self.rows: list[MixedAttentionState] | None = None

    def _far(self) -> bool:
        return self.local == "none" and self.key_features is not None

    def _states(self) -> list[MixedAttentionState]:
        return [self.batch] if self.rows is None else self.rows

    def num_floats(self) -> int:
        tensors = [_numel(self.conv_tail)]
        for st in self._states():
            if st is not None:
                tensors += [_numel(t) for t in (st.summary, st.k, st.phi_k, st.v)]
        return sum(tensors)

    def prefill(self, k, phi_k, v, lengths: list[int] | None = None) -> None:
        """Store the first T time steps (empty cache). k, φk (B, H, T, ·), v (B, H, T, E)
        hold each row's real tokens first (compacted, ``nn.padding``); ``lengths``: the real
        tokens of each row (None: all T)."""
        kw = {"chunk_size": self.chunk_size, "square": self.square}
        t = k.shape[-2]
        if lengths is None or len(set(lengths)) == 1:
            n = t if lengths is None else lengths[0]
            head = (x[..., :n, :] for x in (k, phi_k, v))
            self.batch = self._kept(mixed_attention_state(*head, **kw))
        else:
            self.rows = [
                self._kept(mixed_attention_state(
                    k[b : b + 1, ..., :n, :],
                    phi_k[b : b + 1, ..., :n, :],
                    v[b : b + 1, ..., :n, :],
                    **kw,
                ))
                for b, n in enumerate(lengths)
            ]  # fmt: skip
        self.length = t

    def steps(self, q, k, v, phi_q, phi_k, keep, *, degree: int, offset: float, eps: float):
        """n new time steps after a prefill: (B, H, n, ·) inputs, ``keep`` (B, n) or None ->
        (B, H, n, E) (zeros at padded steps), by ``ops.mixed_attention_step`` (exact local
        polynomial of ``degree``, or no in-block scores with ``local="none"``)."""
        kw = dict(chunk_size=self.chunk_size, local=self.local, degree=degree,
                  square=self.square, denominator_offset=offset, eps=eps)  # fmt: skip
        self.length += q.shape[-2]
        step = self._step_function(kw)
        if self.rows is None and keep is None:
            if self._far():
                return self._far_steps(q, k, v, phi_q, step)
            if q.shape[-2] == 1 and self.batch.length > 0:  # one token: no re-validation
                out, self.batch = mixed_attention_token(q, k, v, phi_q, phi_k, self.batch,
                                                        scale=1.0, **kw)  # fmt: skip
            else:
                out, self.batch = mixed_attention_step(q, k, v, phi_q, phi_k, self.batch, **kw)
            return out
        if self.rows is None:  # some row skips a step: the grids part, one state per row
            self.rows = [_state_row(self.batch, b) for b in range(q.shape[0])]
            self.batch = None
        outs = []
        for b, st in enumerate(self.rows):
            row = []
            for i in range(q.shape[-2]):
                one = [x[b : b + 1, ..., i : i + 1, :] for x in (q, k, v, phi_q, phi_k)]
                if keep is not None and not bool(keep[b, i]):
                    row.append(torch.zeros_like(one[2]))  # a padded step: no output, no update
                    continue
                out, st = step(*one, st)
                row.append(out)
            self.rows[b] = st
            outs.append(torch.cat(row, dim=-2))
        return torch.cat(outs, dim=0)

    def _kept(self, st: MixedAttentionState) -> MixedAttentionState:
        """The state to keep after a prefill: without the current block's features when they
        are made at its completion (``local="none"``)."""
        if not self._far() or st.phi_k is None:
            return st
        return MixedAttentionState(st.summary, st.k, None, st.v, st.length)

    def _step_function(self, kw: dict):
        """(q, k, v, φq, φk, state) -> (out, state) for one token of one row."""
        if not self._far():
            return lambda *args: mixed_attention_step(*args, **kw)
        far = dict(chunk_size=kw["chunk_size"], square=kw["square"],
                   denominator_offset=kw["denominator_offset"], eps=kw["eps"],
                   key_features=self.key_features)  # fmt: skip
        return lambda q, k, v, phi_q, phi_k, st: far_attention_token(phi_q, k, v, st, **far)

    def _far_steps(self, q, k, v, phi_q, step) -> torch.Tensor:
        """Every row in step (one block grid): the new tokens one at a time by ``step``."""
        outs = []
        for i in range(q.shape[-2]):
            one = [x[..., i : i + 1, :] for x in (q, k, v, phi_q)]
            out, self.batch = step(*one, None, self.batch)
            outs.append(out)
        return torch.cat(outs, dim=-2)

    def _select_state(self, index):
        if self.rows is not None:
            self.rows = [self.rows[int(i)] for i in index.tolist()]
        elif self.batch is not None:
            st = self.batch
            self.batch = MixedAttentionState(
                *(_rows(t, index) for t in (st.summary, st.k, st.phi_k, st.v)), st.length
            )


def _state_row(st: MixedAttentionState, b: int) -> MixedAttentionState:
    def row(t):
        return None if t is None else t[b : b + 1]

    return MixedAttentionState(row(st.summary), row(st.k), row(st.phi_k), row(st.v), st.length)


class WindowCache(_Cache):
    """Sliding-window decode state: the keys ``k`` (B, H, n, D) and values ``v`` (B, H, n, E)
    of the last ``window`` real tokens of each row, oldest first, with ``keep`` (B, n) (None:
    all real; a row with fewer real tokens has padded slots in front). Until a step is padded
    (``aligned``) each row's real keys are its last slots, so a step keeps the last w slots
    without reading the mask on the host."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None
        self.aligned = True  # while no step was padded: each row's pads precede its real keys

    def num_floats(self) -> int:
        kv = 0 if self.k is None else self.k.numel() + self.v.numel()
        return kv + _numel(self.conv_tail)

    def prefill(self, k, v, lengths: torch.Tensor | None) -> None:
        """Store the first T time steps (empty cache): k (B, H, T, D), v (B, H, T, E) hold each
        row's real tokens first (compacted); ``lengths`` (B,) their numbers (None: all T)."""
        t = k.shape[-2]
        self.length = t
        if lengths is None:
            n = min(t, self.window)
            self.k, self.v = k[..., t - n :, :], v[..., t - n :, :]
            return
        n = min(t, self.window)  # not max(lengths): a static size, no host sync
        idx = lengths.to(k.device)[:, None] - n + torch.arange(n, device=k.device)  # (B, n)
        from .padding import gather_time

        self.k, self.v = (gather_time(x, idx.clamp_min(0), dim=-2) for x in (k, v))
        self.keep = idx >= 0  # each row's real keys right-aligned (its pads first)

    def append(self, k, v, keep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Add ONE time step (k (B, H, 1, D), v, ``keep`` (B, 1) or None); return the window
        each row's new query sees: keys, values (B, H, n, ·) and their mask (B, n), or None
        when every row sees all n (no padding anywhere: the last min(t, w) keys)."""
        self.length += 1
        ks = k if self.k is None else torch.cat([self.k, k], dim=-2)
        vs = v if self.v is None else torch.cat([self.v, v], dim=-2)
        if keep is None and self.keep is None:  # every key real: the last w are the window
            n = ks.shape[-2]
            if n > self.window:
                ks, vs = ks[..., n - self.window :, :], vs[..., n - self.window :, :]
            self.k, self.v = ks, vs
            return ks, vs, None
        if keep is None and self.aligned:  # every row's real keys right-aligned: its window
            mask = torch.cat([self.keep, torch.ones_like(self.keep[:, :1])], dim=-1)
            cut = max(0, ks.shape[-2] - self.window)  # is its real keys among the last w slots
            ks, vs, mask = ks[..., cut:, :], vs[..., cut:, :], mask[:, cut:]  # (no host sync)
            self.k, self.v, self.keep = ks, vs, mask
            return ks, vs, mask
        self.aligned = False  # a padded step: real keys no longer right-aligned
        mask = _append_keep(self.keep, keep, ks.shape[-2] - 1, k)
        if mask is None:
            mask = torch.ones(ks.shape[0], ks.shape[-2], dtype=torch.bool, device=ks.device)
        # a key is in row b's window if it is real and among the row's last w real keys
        newest = mask.flip(-1).to(torch.int64).cumsum(-1).flip(-1)  # real keys from j on
        window = mask & (newest <= self.window)
        first = int((window.to(torch.int64).cumsum(-1) == 0).sum(-1).min())  # unused prefix
        self.k, self.v = ks[..., first:, :], vs[..., first:, :]
        kept = window[:, first:]
        self.keep = None if bool(kept.all()) else kept
        return ks, vs, window

    def _select_state(self, index):
        self.k, self.v, self.keep = (_rows(t, index) for t in (self.k, self.v, self.keep))


class ParallelCache:
    """The decode cache of a block with two parallel attention branches
    (``TransformerConfig.local_window``): ``far``, the cache of the block's attention, and
    ``local``, the ``WindowCache`` of its sliding-window branch. Each branch fills its own;
    ``length``, ``num_floats`` and ``select_rows`` cover both."""

    def __init__(self, far, local: WindowCache) -> None:
        self.far, self.local = far, local

    @property
    def length(self) -> int:
        return self.far.length

    def num_floats(self) -> int:
        return self.far.num_floats() + self.local.num_floats()

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (B',) int64 of the batch in both branches (beam search)."""
        self.far.select_rows(index)
        self.local.select_rows(index)


LayerCache = RecurrentCache | KVCache | MixedCache | WindowCache | ParallelCache
