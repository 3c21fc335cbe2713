"""Kernels of attention specs, as a model's attention core would score its q and k.

``build_kernel("NAME[:key=value,...]", D, ...)`` reads the spec as ``polysketch mqar`` and
``polysketch train`` do (``polysketch.eval.mqar_sweep.parse_attention``) and resolves it
with the model's own rules (``polysketch.nn.presets.resolve_attention``): the same feature
map, map keywords, normalizer offset and degree as a ``KernelAttention`` layer of that spec.
The q/k LayerNorm and RoPE of the layer are not applied here: the inputs are taken to be what
the attention core receives (LayerNorm'd Gaussians, or q/k captured after them).

* ``softmax`` -> ``SoftmaxKernel(1/√D)``; ``polynomial`` -> ``PolynomialKernel`` (degree 4,
  offset 1 by default); a feature map or a linear preset (``psf_random``, ``psf_learned``)
  -> ``FeatureKernel`` of one head's map, seeded with ``seed``.
* Learnable maps (``llops``, ``learned_polysketch``, ``hedgehog``) are fitted first, with
  their own ``fit`` and defaults, on ``fit_data`` — samples other than the measured ones,
  as ``polysketch approx --fit-source`` does. ``llops`` with ``elementwise_square`` has no
  closed-form start and is fitted from its construction draw (``init="current"``).
* ``psf_mixed`` (exact inside a block, sketched before) has no position-free kernel: its
  retrieval depends on where the key sits relative to the query's block, so it is refused.
"""

from __future__ import annotations

import inspect
import math
import time

import torch

from polysketch.eval.mqar_sweep import parse_attention
from polysketch.features import create, get_class
from polysketch.nn.resolve import resolve_attention

from .retrieval import FeatureKernel, Kernel, PolynomialKernel, SoftmaxKernel

__all__ = ["FITTED_MAPS", "build_kernel"]

FITTED_MAPS = ("llops", "learned_polysketch", "hedgehog")
"""Maps fitted on held-out samples before they are measured (their ``fit``)."""


def _accepts_seed(name: str) -> bool:
    """Whether the map's constructor takes ``seed=`` (deterministic maps may not)."""
    params = inspect.signature(get_class(name).__init__).parameters.values()
    return any(p.name == "seed" or p.kind is p.VAR_KEYWORD for p in params)


def _fit(feature_map, name: str, fit_data, *, steps: int | None, seed: int) -> None:
    q, k = fit_data
    kwargs: dict = {"seed": seed, "progress": False}
    if steps is not None:
        kwargs["steps"] = steps
    if name == "llops" and feature_map.elementwise_square:
        kwargs["init"] = "current"
    feature_map.fit(q.float(), k.float(), **kwargs)


def build_kernel(
    spec: str,
    dim: int,
    *,
    seed: int = 0,
    fit_data: tuple[torch.Tensor, torch.Tensor] | None = None,
    fit_steps: int | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[Kernel, dict]:
    """The ``Kernel`` of ``spec`` for head dim ``dim`` and facts about it.

    Args:
        spec: ``NAME[:key=value,...]``; keys are feature-map keywords (model options such as
            ``qk_dim`` have no kernel-level meaning and are refused).
        seed: the map's seed (random maps: its draw; learned maps: their init).
        fit_data: (q, k) samples, (N, D) each, to fit learnable maps on (required for them).
        fit_steps: steps of their ``fit`` (None: each map's default).
        dtype: the map's dtype for measuring (fits run in float32).

    Returns ``(kernel, info)``; info holds ``feature_dim`` F (None for softmax/polynomial),
    ``square``, ``state_dim``, ``rank_bound`` F′, ``fitted`` and ``fit_s`` (CPU seconds).
    """
    name, model_opts, map_kwargs = parse_attention(spec)
    if model_opts:
        raise ValueError(
            f"attentions {spec!r}: model options {sorted(model_opts)} have no kernel-level "
            "meaning in the retrieval table"
        )
    resolved = resolve_attention(name, dim, map_kwargs)
    info = {"feature_dim": None, "square": False, "fitted": False, "fit_s": 0.0}
    if resolved.form == "softmax":
        kernel: Kernel = SoftmaxKernel(1.0 / math.sqrt(dim))
    elif resolved.form == "polynomial":
        kernel = PolynomialKernel(resolved.degree, offset=resolved.denominator_offset, dim=dim)
    elif resolved.form == "linear" or (
        resolved.form == "mixed" and resolved.local == "none"
    ):  # without in-block scores (soft_hash_far) the t keys count as earlier blocks' keys
        # (the query's own block is the window's), whose weights are the map's kernel
        kwargs = dict(resolved.map_kwargs)
        if _accepts_seed(resolved.feature_map):
            kwargs["seed"] = seed
        fmap = create(resolved.feature_map, dim, **kwargs)
        if resolved.feature_map in FITTED_MAPS:
            if fit_data is None:
                raise ValueError(f"attentions {spec!r}: a learnable map needs fit_data")
            start = time.process_time()
            _fit(fmap, resolved.feature_map, fit_data, steps=fit_steps, seed=seed)
            info["fitted"], info["fit_s"] = True, time.process_time() - start
        fmap = fmap.to(dtype).eval()
        kernel = FeatureKernel(fmap, offset=resolved.denominator_offset)
        info["feature_dim"], info["square"] = int(fmap.feature_dim), bool(fmap.square)
    else:
        raise ValueError(
            f"attentions {spec!r}: {resolved.form} attention has no position-free kernel "
            "(its weight on a key depends on the key's block); measure it in a model"
        )
    return kernel, {**info, **kernel_facts(kernel)}


def kernel_facts(kernel: Kernel) -> dict:
    """The sizes a table row records of ``kernel``: state_dim, rank_bound F′, nonnegative,
    offset."""
    return {"state_dim": kernel.state_dim, "rank_bound": kernel.rank_bound,
            "nonnegative": kernel.nonnegative, "offset": kernel.offset}  # fmt: skip
