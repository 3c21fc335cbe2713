"""The retrieval table: weight on the matching key vs context t, per attention and input.

For every input source (LayerNorm'd Gaussians, or each captured (layer, head)), draw d of
``draws`` and context t of ``contexts``: t keys are drawn (the first t of one draw of
max(contexts) keys, so contexts of one draw are nested), ``queries`` of them are picked at
random as the matching keys k*, and each attention's mean weight w (``retrieval``) is
measured for queries equal to k* and at cosine 0.9 and 0.7 to it (``inputs.near_queries``,
the orthogonal direction from rows outside the keys). Random maps are redrawn per draw
(seed = ``seed`` + d); learnable maps are fitted once per source on its fit samples (seed
``seed``), so a table resumed with ``--reuse`` measures the same maps as one run straight.

One CSV row per (input, head, attention, t, draw) with the three weights, the bound
min(1, F′/t) and the map's sizes; ``summarize`` averages over heads and draws.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from polysketch.random import make_generator

from .inputs import CapturedHeads, layer_norm_gaussian, near_queries
from .kernels import build_kernel, kernel_facts
from .report import ResultCSV
from .retrieval import FeatureKernel, match_weights

__all__ = [
    "DEFAULT_ATTENTIONS",
    "CONTEXTS",
    "COSINES",
    "COLUMNS",
    "KEY",
    "RetrievalSettings",
    "Source",
    "gaussian_source",
    "captured_sources",
    "run_retrieval",
    "summarize",
]

DEFAULT_ATTENTIONS = (
    "softmax",
    "polynomial",
    "psf_random",
    "psf_learned",
    "llops:num_features=32,degree=2,square=True",
    "llops:num_features=1024,degree=2,elementwise_square=True",
    "hedgehog",
    "taylor",
    "positive",
    "elu",
    "symmetric_power:degree=2",
)
"""The issue's rows. The two LLoPS forms are sized to psf_random's decode state (1,024
features per value dim): squared m = 32 (scores (φq·φk)², F² = 1,024) and element-wise
squared m = 1,024 (F = 1,024), both of target degree 4 (p = 2, squared)."""

CONTEXTS = (64, 256, 1024, 4096, 16384, 65536)
COSINES = (1.0, 0.9, 0.7)
WEIGHT_COLUMNS = {1.0: "w_match", 0.9: "w_cos0.9", 0.7: "w_cos0.7"}

COLUMNS = (
    "input", "head", "attention", "t", "draw", "w_match", "w_cos0.9", "w_cos0.7", "bound",
    "feature_dim", "state_dim", "rank_bound", "square", "nonnegative", "offset", "fit_s",
    "cpu_s",
)  # fmt: skip
KEY = ("input", "head", "attention", "t", "draw")


@dataclass
class RetrievalSettings:
    """What a retrieval table measures (stored beside its CSV; ``--reuse`` checks it)."""

    attentions: Sequence[str] = DEFAULT_ATTENTIONS
    contexts: Sequence[int] = CONTEXTS
    cosines: Sequence[float] = COSINES
    draws: int = 3
    queries: int = 64
    dim: int = 64
    seed: int = 0
    fit_num: int = 4096
    fit_steps: int | None = None
    inputs: Sequence[str] = ("gaussian",)
    checkpoint: str | None = None
    trained: Sequence[str] = ()  # checkpoints whose trained maps are measured (trained_kernels)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.attentions, self.inputs = list(self.attentions), list(self.inputs)
        self.trained = list(self.trained)
        self.contexts = sorted({int(t) for t in self.contexts})
        self.cosines = [float(c) for c in self.cosines]
        unknown = [c for c in self.cosines if c not in WEIGHT_COLUMNS]
        if unknown:
            raise ValueError(f"cosines must be among {list(WEIGHT_COLUMNS)}, got {unknown}")
        for name in ("draws", "queries", "dim", "fit_num"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.contexts or self.contexts[0] < 2:
            raise ValueError(f"contexts must be >= 2, got {self.contexts}")
        bad = [i for i in self.inputs if i not in ("gaussian", "captured")]
        if bad or not self.inputs:
            raise ValueError(f"inputs must be among gaussian, captured; got {self.inputs}")
        if "captured" in self.inputs and not self.checkpoint:
            raise ValueError("--checkpoint is required for captured inputs")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Source:
    """Keys to measure on: ``keys(draw, n)`` (n, D), ``others(draw, n)`` rows outside them
    (directions for near queries), and ``fit`` (q, k) samples for learnable maps."""

    input: str
    head: str
    dim: int
    keys: callable
    others: callable
    fit: tuple[torch.Tensor, torch.Tensor]
    available: int | None = None  # most keys a draw can hold (None: unlimited)


def gaussian_source(settings: RetrievalSettings) -> Source:
    """LayerNorm'd Gaussian keys; fit samples and near-query directions are other draws."""
    d, s = settings.dim, settings.seed

    def keys(draw: int, n: int) -> torch.Tensor:
        return layer_norm_gaussian(n, d, generator=make_generator(1_000_003 * s + 2 * draw))

    def others(draw: int, n: int) -> torch.Tensor:
        return layer_norm_gaussian(n, d, generator=make_generator(1_000_003 * s + 2 * draw + 1))

    gen = make_generator(1_000_003 * s + 999_999)
    fit = tuple(
        layer_norm_gaussian(settings.fit_num, d, generator=gen, dtype=torch.float32)
        for _ in range(2)
    )
    return Source("gaussian", "-", d, keys, others, fit)


def captured_sources(captured: CapturedHeads, settings: RetrievalSettings) -> list[Source]:
    """One source per captured (layer, head): keys drawn from its measure positions (a
    seeded permutation per draw), near-query directions from its fit keys, fitted on its
    fit (q, k)."""
    sources = []
    n_keys = captured.keys.shape[1]
    for h, label in enumerate(captured.labels):
        pool, fit_q, fit_k = captured.keys[h], captured.fit_q[h], captured.fit_k[h]

        def keys(draw, n, pool=pool, h=h):
            perm = torch.randperm(pool.shape[0], generator=make_generator(settings.seed + draw))
            return pool[perm[:n]]

        def others(draw, n, fit_k=fit_k):
            gen = make_generator(settings.seed + 7919 + draw)
            return fit_k[torch.randint(fit_k.shape[0], (n,), generator=gen)]

        sources.append(
            Source("captured", label, pool.shape[1], keys, others, (fit_q, fit_k), n_keys)
        )
    return sources


def trained_kernels(paths: Sequence[str]) -> dict[str, tuple[FeatureKernel, dict]]:
    """The feature maps of trained models, as measured kernels: for every checkpoint, layer
    l and head h of its (global) attention, ``"trained:<run>:layer<l>.head<h>"`` -> (the
    map of that head as trained, in float64, with the layer's normalizer offset; its info).
    ``<run>`` is the checkpoint's folder name. The window-only layers of a model with
    ``global_every`` are skipped; a model whose global attention has no feature map
    (softmax, polynomial, a window) is refused: it has no trained map to measure."""
    from .inputs import load_model

    out: dict[str, tuple[FeatureKernel, dict]] = {}
    for path in paths:
        model = load_model(path)
        run = Path(path).resolve().parent.name
        for layer, block in enumerate(model.blocks):
            core = block.attn
            if not model.spec.has_global(layer):
                continue
            if core.feature_map is None:
                raise ValueError(f"trained: layer {layer} of {path} ({core.attention}) has no "
                                 "feature map to measure")  # fmt: skip
            for h in range(core.num_heads):
                fmap = core.feature_map.head_map(h).to(torch.float64).eval()
                kernel = FeatureKernel(fmap, offset=core.denominator_offset)
                info = {"feature_dim": int(fmap.feature_dim), "square": bool(fmap.square),
                        "fit_s": 0.0, **kernel_facts(kernel)}  # fmt: skip
                out[f"trained:{run}:layer{layer}.head{h}"] = (kernel, info)
    return out


def _units(sources, settings, table, trained=()) -> Iterator[tuple]:
    for src in sources:
        for spec in [*settings.attentions, *trained]:
            todo = [
                (d, t)
                for d in range(settings.draws)
                for t in settings.contexts
                if not table.has(
                    {"input": src.input, "head": src.head, "attention": spec, "t": t, "draw": d}
                )
            ]
            if todo:
                yield src, spec, todo


def run_retrieval(
    settings: RetrievalSettings,
    sources: Sequence[Source],
    table: ResultCSV,
    *,
    trained: dict | None = None,
    progress: bool = True,
    log=print,
) -> list[str]:
    """Measure every (source, attention, draw, t) not yet in ``table``, the attentions being
    ``settings.attentions`` and the ``trained`` kernels (``trained_kernels``); returns notes on
    contexts left out (a captured pool smaller than t)."""
    from tqdm.auto import tqdm

    trained = trained or {}
    units = list(_units(sources, settings, table, trained))
    notes: list[str] = []
    bar = tqdm(total=sum(len(u[2]) for u in units), disable=not progress, desc="retrieval")
    for src, spec, todo in units:
        if spec in trained:  # a trained model's map: measured as it is, never redrawn
            kernel, info = trained[spec]
            if kernel.map.dim != src.dim:
                raise ValueError(f"{spec}: its map takes D = {kernel.map.dim}, the "
                                 f"{src.input} input has D = {src.dim}")  # fmt: skip
        else:
            kernel, info = build_kernel(
                spec, src.dim, seed=settings.seed, fit_data=src.fit, fit_steps=settings.fit_steps
            )
        fit_s = info["fit_s"]
        redraw = spec not in trained and getattr(getattr(kernel, "map", None), "is_random", False)
        for d in sorted({d for d, _ in todo}):
            if redraw and d:  # random maps: draw d uses seed + d (resuming gives the same)
                kernel, info = build_kernel(spec, src.dim, seed=settings.seed + d)
            contexts = [t for dd, t in todo if dd == d]
            t_max = max(contexts)
            if src.available is not None and t_max > src.available:
                notes.append(
                    f"{src.input} {src.head}: t > {src.available} left out (the capture "
                    "holds no more keys)"
                )
                contexts = [t for t in contexts if t <= src.available]
                bar.update(sum(1 for dd, t in todo if dd == d) - len(contexts))
                if not contexts:
                    continue
                t_max = max(contexts)
            all_keys = src.keys(d, t_max)
            for t in contexts:
                start = time.process_time()
                keys = all_keys[:t]
                gen = make_generator(1_000_003 * settings.seed + 1009 * d + t)
                n = min(settings.queries, t)
                match = torch.randperm(t, generator=gen)[:n]
                others = src.others(d, n)
                row = {"input": src.input, "head": src.head, "attention": spec, "t": t, "draw": d}
                for c in settings.cosines:
                    q = near_queries(keys[match], c, others)
                    w = match_weights(kernel, q, keys, match)
                    row[WEIGHT_COLUMNS[c]] = float(w.mean())
                bound = kernel.bound(t)
                row.update(
                    bound="" if bound is None else bound,
                    feature_dim="" if info["feature_dim"] is None else info["feature_dim"],
                    state_dim="" if info["state_dim"] is None else info["state_dim"],
                    rank_bound="" if info["rank_bound"] is None else info["rank_bound"],
                    square=int(info["square"]),
                    nonnegative=int(info["nonnegative"]),
                    offset=info["offset"],
                    fit_s=fit_s,
                    cpu_s=time.process_time() - start,
                )
                fit_s = 0.0  # counted once, on the first row measured with the fit
                table.add(row)
                bar.update(1)
    bar.close()
    return sorted(set(notes))


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Mean weights per (input, attention, t) over heads and draws, with the standard
    deviation over draws of the per-draw mean (over heads); sizes and bound carried over."""
    groups: dict[tuple, dict[int, list[dict]]] = {}
    order: list[tuple] = []
    for r in rows:
        key = (r["input"], r["attention"], int(r["t"]))
        if key not in groups:
            groups[key] = {}
            order.append(key)
        groups[key].setdefault(int(r["draw"]), []).append(r)
    out = []
    for key in order:
        draws = groups[key]
        first = next(iter(draws.values()))[0]
        row = {"input": key[0], "attention": key[1], "t": key[2], "draws": len(draws),
               "heads": max(len(v) for v in draws.values())}  # fmt: skip
        for col in WEIGHT_COLUMNS.values():
            per_draw = [
                sum(float(r[col]) for r in v) / len(v)
                for v in draws.values()
                if all(r.get(col, "") != "" for r in v)
            ]
            if not per_draw:
                continue
            mean = sum(per_draw) / len(per_draw)
            var = sum((x - mean) ** 2 for x in per_draw) / max(1, len(per_draw) - 1)
            row[col], row[col + "_std"] = mean, math.sqrt(var)
        for col in ("bound", "feature_dim", "state_dim", "rank_bound", "square", "offset"):
            row[col] = first.get(col, "")
        out.append(row)
    return out
