"""Independent feature maps per attention head, applied to all heads at once.

PolySketchFormer §4: "for each attention head in each layer, we independently sample a
sketching matrix S". ``MultiHeadFeatureMap`` builds H maps of one kind, head h of layer l
seeded with ``head_seed(seed, l, h)``, and stacks their parameters and buffers along a new
leading head axis (``torch.func.stack_module_state``): a parameter of shape (...) of the map
becomes one (H, ...) parameter of the wrapper. The features of all heads are then one call

    φ(x)[:, h] = φ_h(x[:, h])      x: (B, H, T, D) -> (B, H, T, F),

computed by ``torch.vmap`` over the head axis of ``torch.func.functional_call`` on a template
map (no Python loop over heads). Trainable maps (``llops``, ``learned_polysketch``, trainable
``fpa`` / ``elementwise_power``) train through the stacked ``nn.Parameter``s.

The common maps (``polysketch`` with Gaussian or product projections, ``hedgehog``) skip
vmap: ``nn.heads_batched`` computes all heads as batched matmuls on the same stacked tensors
(equal to the vmapped result; vmap's per-call dispatch dominated a decoding step).

Maps that cannot be vmapped run a Python loop over per-head submodules instead
(``LOOP_MAPS``, plus any map whose vmapped probe raises at construction):
``hybrid_clustered`` is one, because its buffers are created by a data-dependent ``fit``
(k-means) and change shape with the number of clusters; call ``fit_(q, k)`` before use.
The two layouts name their tensors differently (``map__weight_q`` of shape (H, ...) against
``maps.h.weight_q``); ``load_state_dict`` accepts either, so that a checkpoint written where
the probe passed loads where it raises (another torch), and the reverse.
"""

from __future__ import annotations

import copy
import hashlib

import torch
from torch import nn

from .._checks import as_dtype, check_int, check_positive_int, check_tensor, compute_dtype
from ..features import create, get_class
from ..features.base import FeatureMap
from ..random import check_seed, make_generator
from .heads_batched import batched_form

__all__ = ["MultiHeadFeatureMap", "head_seed", "LOOP_MAPS"]

LOOP_MAPS = frozenset({"hybrid_clustered"})
"""Maps applied by a loop over heads (data-dependent buffers; see the module docstring)."""

_VMAP_OK: dict[tuple, bool] = {}  # probe results per (name, kwargs, D), computed once

_SEP = "__"  # replaces "." of nested parameter names (e.g. branch1.0.up -> branch1__0__up)


def head_seed(seed: int, layer_index: int, head_index: int) -> int:
    """The seed of head h in layer l: the first 63 bits of BLAKE2b("polysketch:{seed}:{l}:{h}").

    A hash rather than e.g. ``seed + 1000·l + h``, so that nearby (seed, l, h) triples give
    unrelated draws and no two triples collide in practice; it is stable across platforms
    and Python runs (``hash()`` of str is salted, this is not).
    """
    text = f"polysketch:{seed}:{layer_index}:{head_index}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


ROLES = ("query", "key", "query_stabilized")
"""The feature methods a ``MultiHeadFeatureMap`` applies per head."""


class _Role(nn.Module):
    """Calls ``map.query``, ``map.key`` or ``map.query_stabilized`` without the overflow
    refusal (``FeatureMap.unchecked``: the attention core checks the features it uses, and a
    data-dependent refusal would not vmap); the module ``functional_call`` runs per head."""

    def __init__(self, feature_map: FeatureMap):
        super().__init__()
        self.map = feature_map

    def forward(self, x: torch.Tensor, role: str) -> torch.Tensor:
        return self.map.unchecked(role, x)


class MultiHeadFeatureMap(nn.Module):
    """H independent feature maps ``name`` of dim D, one per head: (B, H, T, D) -> (B, H, T, F).

    Args:
        name: a ``polysketch.features.available()`` name.
        head_dim: D. num_heads: H.
        seed: base seed (int >= 0); head h of layer ``layer_index`` gets
            ``head_seed(seed, layer_index, h)`` (maps without randomness ignore it).
        layer_index: l, the layer this map belongs to (for the seed derivation).
        **map_kwargs: passed to every head's map (``create(name, D, **map_kwargs)``).

    Attributes (from the head maps, which share them): ``feature_dim`` F, ``square``,
    ``state_dim`` (F² if square else F), ``nonnegative``, ``kind``, ``is_random``, ``family``,
    ``stable_query`` (``query_stabilized`` rescales query rows; see ``features.stability``
    for when attention may use it); ``symmetric`` (query = key = query_stabilized);
    ``vectorized`` (False for the loop fallback);
    ``use_batched`` (True: the batched-heads form of ``nn.heads_batched`` where the map has
    one; set False to force the vmapped path, e.g. to compare them).
    """

    use_batched: bool = True

    def __init__(
        self,
        name: str,
        head_dim: int,
        num_heads: int,
        *,
        seed: int = 0,
        layer_index: int = 0,
        **map_kwargs,
    ):
        super().__init__()
        get_class(name)  # an unknown name fails here, naming the choices
        self.name = name
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.num_heads = check_positive_int(num_heads, "num_heads")
        self.seed = check_seed(seed)
        self.layer_index = check_int(layer_index, "layer_index", minimum=0)
        self.map_kwargs = dict(map_kwargs)  # every head's options (shown in the repr)
        if "seed" in map_kwargs or "generator" in map_kwargs:
            raise ValueError("map_kwargs must not contain seed/generator: pass seed= instead")

        def build(h: int) -> FeatureMap:  # every map takes seed= (deterministic ones ignore it)
            seed = head_seed(self.seed, self.layer_index, h)
            return create(name, self.head_dim, **map_kwargs, seed=seed)

        maps = [build(h) for h in range(self.num_heads)]
        first = maps[0]
        self.feature_dim = first.feature_dim
        self.square = first.square
        self.state_dim = first.state_dim
        self.nonnegative = first.nonnegative
        self.kind = first.kind
        self.is_random = first.is_random
        self.family = first.family
        self.stable_query = first.stable_query
        self.symmetric = first.symmetric
        self.scale = getattr(first, "scale", None)  # for the range checks' advice
        probe_key = (name, repr(sorted(map_kwargs.items())), self.head_dim)
        if probe_key not in _VMAP_OK:
            _VMAP_OK[probe_key] = name not in LOOP_MAPS and self._vmap_works(first)
        self.vectorized = _VMAP_OK[probe_key]
        self._register_load_state_dict_pre_hook(self._from_other_layout)
        if not self.vectorized:
            self.maps = nn.ModuleList(maps)
            return
        params, buffers = torch.func.stack_module_state([_Role(m) for m in maps])
        self._param_names = tuple(params)
        self._buffer_names = tuple(buffers)
        for key, value in params.items():
            self.register_parameter(_mangle(key), nn.Parameter(value, value.requires_grad))
        for key, value in buffers.items():
            self.register_buffer(_mangle(key), value)
        # The template supplies the code; its own tensors are never used (not a submodule,
        # so it stays out of parameters(), state_dict() and .to()).
        self._template = (_Role(first),)
        self._batched = batched_form(first)  # all heads without vmap (nn.heads_batched)
        self._memo: dict = {}  # tensors the batched form derives from the buffers

    def _from_other_layout(self, state_dict, prefix, *_):
        """Before loading: the other layout's tensors rewritten into this one's, in place
        (per-head ``maps.h.NAME`` stacked into ``map__NAME``, or the reverse); a state in this
        layout, or a partial one, is left as it is."""
        heads = range(self.num_heads)
        if self.vectorized:
            for name in (*self._param_names, *self._buffer_names):
                rest = name.removeprefix("map.")
                per_head = [f"{prefix}maps.{h}.{rest}" for h in heads]
                if all(k in state_dict for k in per_head):
                    state_dict[prefix + _mangle(name)] = torch.stack(
                        [state_dict.pop(k) for k in per_head]
                    )
            return
        first = self.maps[0]
        for rest, _ in (*first.named_parameters(), *first.named_buffers()):
            stacked = prefix + _mangle("map." + rest)
            if stacked in state_dict:
                value = state_dict.pop(stacked)
                for h in heads:
                    state_dict[f"{prefix}maps.{h}.{rest}"] = value[h]

    # ----- construction helpers ------------------------------------------------------------
    def _vmap_works(self, feature_map: FeatureMap) -> bool:
        """Try the vmapped call on a tiny input; False if it raises (then loop over heads)."""
        role = _Role(feature_map)
        params, buffers = torch.func.stack_module_state([role, role])
        x = torch.randn(1, 2, 3, self.head_dim, generator=torch.Generator().manual_seed(0))
        try:
            for name in ROLES:
                torch.vmap(
                    lambda p, b, xh, name=name: torch.func.functional_call(
                        role, (p, b), (xh,), {"role": name}
                    ),
                    in_dims=(0, 0, 1),
                    out_dims=1,
                )(params, buffers, x)
        except Exception:  # noqa: BLE001 - any failure selects the loop fallback
            return False
        return True

    def _stacked(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        own_params, own_buffers = self._parameters, self._buffers  # read at every call
        params = {k: own_params[_mangle(k)] for k in self._param_names}
        buffers = {k: own_buffers[_mangle(k)] for k in self._buffer_names}
        return params, buffers

    # ----- features ------------------------------------------------------------------------
    def _features(self, x: torch.Tensor, role: str) -> torch.Tensor:
        check_tensor(x, "x", min_dim=3, last_dim=self.head_dim)
        if x.shape[-3] != self.num_heads:
            raise ValueError(
                f"x must have shape (..., H={self.num_heads}, T, D={self.head_dim}), "
                f"got {tuple(x.shape)}"
            )
        if not self.vectorized:
            outs = [m.unchecked(role, x.select(-3, h)) for h, m in enumerate(self.maps)]
            return torch.stack(outs, dim=-3)
        params, buffers = self._stacked()
        template = self._template[0]
        if self._batched is not None and self.use_batched:
            ref = next(iter(buffers.values()), None) if buffers else next(iter(params.values()))
            if ref.device != x.device:
                raise ValueError(
                    f"x is on {x.device} but feature map {self.name!r} holds its tensors on "
                    f"{ref.device}: move the map (.to({str(x.device)!r})) or the input"
                )
            work = as_dtype(x, compute_dtype(x.dtype))
            out = self._batched(template.map, params, buffers, work, role, self._memo)
            return as_dtype(out, x.dtype)

        def one_head(p, b, xh):
            return torch.func.functional_call(template, (p, b), (xh,), {"role": role})

        head_axis = x.dim() - 3
        return torch.vmap(one_head, in_dims=(0, 0, head_axis), out_dims=head_axis)(
            params, buffers, x
        )

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """φq per head: (..., H, T, D) -> (..., H, T, F), dtype of x. Unlike
        ``FeatureMap.query`` it does not refuse features that overflow: the attention core
        checks what it uses (``features.stability.attention_features``)."""
        return self._features(x, "query")

    def key(self, x: torch.Tensor) -> torch.Tensor:
        """φk per head: (..., H, T, D) -> (..., H, T, F), dtype of x."""
        return self._features(x, "key")

    def query_stabilized(self, x: torch.Tensor) -> torch.Tensor:
        """c·φq per head, c > 0 per row (``FeatureMap.query_stabilized``): only where normalized
        attention without an offset cancels c (``features.stability.attention_features``)."""
        return self._features(x, "query_stabilized")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Alias of ``query``."""
        return self.query(x)

    def head_map(self, h: int) -> FeatureMap:
        """A standalone copy of head h's map (with its current tensors), e.g. for tests."""
        h = check_int(h, "h", minimum=0)
        if h >= self.num_heads:
            raise ValueError(f"h must be < num_heads={self.num_heads}, got {h}")
        if not self.vectorized:
            return self.maps[h]
        role = copy.deepcopy(self._template[0])
        params, buffers = self._stacked()
        self._load_head(role, h, params, buffers)
        return role.map

    @staticmethod
    @torch.no_grad()
    def _load_head(role: nn.Module, h: int, params: dict, buffers: dict) -> None:
        for k, v in params.items():
            role.get_parameter(k).data = v[h].detach().clone()
        for k, v in buffers.items():
            _set_module_buffer(role, k, v[h].clone())

    # ----- randomness ----------------------------------------------------------------------
    @torch.no_grad()
    def redraw_(self, generator: torch.Generator | None = None) -> MultiHeadFeatureMap:
        """Redraw every head's random tensors, heads in order from one ``generator``.

        ``generator=None`` seeds one from torch's global RNG. A no-op for deterministic maps.
        Returns ``self``.
        """
        if not self.is_random:
            return self
        gen = make_generator(None, generator)
        if not self.vectorized:
            for m in self.maps:
                m.redraw_(gen)
            return self
        role = self._template[0]
        params, buffers = self._stacked()
        for h in range(self.num_heads):
            self._load_head(role, h, params, buffers)
            role.map.redraw_(gen)
            for k, v in params.items():
                v[h].copy_(role.get_parameter(k))
            for k, v in buffers.items():
                v[h].copy_(role.get_buffer(k))
        return self

    def fit_(self, q: torch.Tensor, k: torch.Tensor) -> MultiHeadFeatureMap:
        """Call ``fit(q_h, k_h)`` of each head's map (maps with ``fit``, e.g. hybrid_clustered).

        q, k: (..., H, T, D) sample queries and keys. Only for the loop fallback.
        """
        if self.vectorized or not hasattr(self.maps[0], "fit"):
            raise TypeError(f"feature map {self.name!r} has no per-head fit")
        for h, m in enumerate(self.maps):
            m.fit(q.select(-3, h), k.select(-3, h))
        return self

    def extra_repr(self) -> str:
        return (
            f"name={self.name!r}, head_dim={self.head_dim}, num_heads={self.num_heads}, "
            f"feature_dim={self.feature_dim}, square={self.square}, "
            f"vectorized={self.vectorized}, seed={self.seed}, layer_index={self.layer_index}"
            + "".join(f", {k}={v!r}" for k, v in sorted(self.map_kwargs.items()))
        )


def _mangle(name: str) -> str:
    return name.replace(".", _SEP)


def _set_module_buffer(module: nn.Module, name: str, value: torch.Tensor) -> None:
    prefix, _, leaf = name.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    owner._buffers[leaf] = value
