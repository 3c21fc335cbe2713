"""Sources of query/key samples for fidelity measurement.

``load_qk(source, dim=, num=, seed=)`` returns float64 q: (N, D) and k: (M, D):

- ``"gaussian"``: i.i.d. N(0, I_D / √D) rows, so that q·k has mean 0 and variance 1 (the
  scale of 1/√D-scaled attention logits);
- ``"sphere"``: rows uniform on the unit sphere S^{D−1} (normalized Gaussians), the setting
  of unit-norm (LayerNorm-like) queries and keys;
- a file: ``.pt`` / ``.pth`` holding a dict with ``"q"`` and ``"k"`` tensors or a (q, k)
  tuple/list; ``.npz`` with arrays ``"q"`` and ``"k"``; ``.npy`` holding one array of shape
  (2, N, D) (q then k). Leading dims, e.g. (B, H, T, D) dumped from a model, are flattened
  to rows. If a file holds more than ``num`` rows, ``num`` of them are drawn at random
  (seeded) without replacement; ``dim``, when given, must match the file's last dim.

Polynomial-kernel relative errors are invariant to rescaling q and k, so the scale of the
synthetic sources only matters for softmax-type kernels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..._checks import check_int, check_positive_int
from ...random import make_generator

__all__ = ["SYNTHETIC_SOURCES", "load_qk"]

SYNTHETIC_SOURCES = ("gaussian", "sphere")


def _synthetic(source: str, dim: int, num: int, seed: int):
    gen = make_generator(seed)
    q = torch.randn(num, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(num, dim, generator=gen, dtype=torch.float64)
    if source == "gaussian":
        scale = dim**-0.25
        return q * scale, k * scale
    return q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)


def _as_tensor(value, what: str, path: Path) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"source {str(path)!r}: {what} must be an array, got {type(value).__name__}"
        )
    if not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"source {str(path)!r}: {what} must be numeric, got dtype {value.dtype}")
    if value.dim() < 2:
        raise ValueError(
            f"source {str(path)!r}: {what} must have shape (..., N, D), got {tuple(value.shape)}"
        )
    value = value.detach().to("cpu", torch.float64).reshape(-1, value.shape[-1])
    if value.shape[0] == 0 or value.shape[1] == 0:
        raise ValueError(f"source {str(path)!r}: {what} is empty, shape {tuple(value.shape)}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"source {str(path)!r}: {what} contains NaN or Inf values")
    return value


def _read_file(path: Path):
    suffix = path.suffix.lower()
    where = f"source {str(path)!r}"
    if suffix in (".pt", ".pth"):
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # unreadable or unsafe pickle: report which file
            raise ValueError(f"{where}: cannot load as a torch file ({err})") from err
        if isinstance(obj, dict):
            missing = [key for key in ("q", "k") if key not in obj]
            if missing:
                raise ValueError(f"{where}: dict lacks key(s) {missing}; found {sorted(obj)}")
            return obj["q"], obj["k"]
        if isinstance(obj, (tuple, list)) and len(obj) == 2:
            return obj[0], obj[1]
        raise ValueError(f"{where}: expected a dict with 'q' and 'k' or a (q, k) tuple")
    if suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as data:
                missing = [key for key in ("q", "k") if key not in data.files]
                if missing:
                    raise ValueError(f"{where}: archive lacks array(s) {missing}; has {data.files}")
                return data["q"], data["k"]
        except (OSError, EOFError) as err:
            raise ValueError(f"{where}: cannot read as .npz ({err})") from err
    if suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, EOFError, ValueError) as err:
            raise ValueError(f"{where}: cannot read as .npy ({err})") from err
        if arr.ndim < 3 or arr.shape[0] != 2:
            raise ValueError(
                f"{where}: a .npy file must hold one array of shape (2, N, D) (q then k), "
                f"got {arr.shape}; use .npz with arrays 'q' and 'k' otherwise"
            )
        return arr[0], arr[1]
    raise ValueError(
        f"source {str(path)!r}: unknown file type {suffix!r}; use .pt, .pth, .npz or .npy"
    )


def load_qk(
    source: str | Path = "gaussian",
    *,
    dim: int | None = 16,
    num: int | None = 256,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key samples: (q, k), float64 tensors of shapes (N, D), (M, D).

    Args:
        source: ``"gaussian"``, ``"sphere"`` or a path to a .pt/.pth/.npz/.npy file (module
            docstring for the formats).
        dim: D for synthetic sources (required there); for files, the expected last dim
            (None: accept the file's).
        num: rows drawn for synthetic sources (required there); for files, the most rows kept
            (None: all).
        seed: seed of the synthetic draw or of the row subsample.

    Raises ValueError naming ``source`` for a missing file, an unknown type or bad contents.
    """
    seed = check_int(seed, "seed", minimum=0)
    if isinstance(source, str) and source in SYNTHETIC_SOURCES:
        if dim is None or num is None:
            raise ValueError(f"dim and num are required for source {source!r}")
        dim = check_positive_int(dim, "dim")
        num = check_positive_int(num, "num")
        return _synthetic(source, dim, num, seed)
    if not isinstance(source, (str, Path)):
        raise TypeError(f"source must be a name or a path, got {type(source).__name__}")
    path = Path(source)
    if not path.is_file():
        raise ValueError(
            f"source {str(source)!r} is neither one of {list(SYNTHETIC_SOURCES)} nor an "
            "existing file"
        )
    raw_q, raw_k = _read_file(path)
    q = _as_tensor(raw_q, "q", path)
    k = _as_tensor(raw_k, "k", path)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"source {str(path)!r}: q and k differ in last dim ({q.shape[-1]} vs {k.shape[-1]})"
        )
    if dim is not None and q.shape[-1] != check_positive_int(dim, "dim"):
        raise ValueError(f"dim is {dim} but source {str(path)!r} holds D = {q.shape[-1]}")
    if num is not None:
        num = check_positive_int(num, "num")
        gen = make_generator(seed)
        if q.shape[0] > num:
            q = q[torch.randperm(q.shape[0], generator=gen)[:num]]
        if k.shape[0] > num:
            k = k[torch.randperm(k.shape[0], generator=gen)[:num]]
    return q.contiguous(), k.contiguous()
