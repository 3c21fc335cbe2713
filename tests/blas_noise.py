"""Another BLAS, on any machine: every matrix product gets a rounding error of its own.

Two BLAS code paths (MKL's AVX2 and AVX-512 kernels, OpenBLAS, cuBLAS) compute the same product
``C = A B`` (A: (M, K), B: (K, N)) with the K-term sums in different orders, so their results
differ by rounding alone. The standard bound for one dot product summed in any order is

    |fl(a·b) - a·b| <= gamma_K (|a|·|b|),   gamma_K = K u / (1 - K u),   u = eps / 2,

and a typical difference between two orders is about sqrt(K) u (|a|·|b|) (errors of random
sign). A test whose tolerance holds on one machine's path but not on another's is a test whose
tolerance came from that machine rather than from this bound.

:class:`BlasNoise` makes any machine behave like "another BLAS": under it every floating-point
product of the matmul family (``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``addbmm``, ``mv``,
``addmv``, ``dot``) returns

    C' = C + xi ∘ sqrt(n - 1) u (|A| |B|),   xi in [-1, 1],

n the number of nonzero terms of each sum (an order matters only when there are two or more:
a product by the identity or a one-hot row is exact on every BLAS, and stays exact here),
accumulated in fp32 for half operands (as CPU and GPU BLAS do) and fp64 for fp64. ``xi`` is a
pseudo-random function of the bits of ``C`` itself and of the operands' shapes (BLAS libraries
choose kernels by shape, so a row computed alone need not round as it does in a batch): the
same inputs of the same shapes give the same output, so properties a test checks bit for bit
(causality, state splitting over equal shapes) still hold exactly, while every comparison of
two different summations is perturbed by a realistic amount. ``seed`` picks one "other BLAS"
among many (it enters the hash): rerunning a comparison under several seeds shows the spread of
its margin. Tests opt in through ``POLYSKETCH_TEST_BLAS_NOISE=<seed>`` (a positive integer; see
``conftest.py``); ``tests/test_numerics_portability.py`` runs the numerics tests under it.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# op -> (positions of the two factors in args, position of the added term or None)
_PRODUCTS = {
    aten.mm.default: (0, 1, None),
    aten.bmm.default: (0, 1, None),
    aten.mv.default: (0, 1, None),
    aten.dot.default: (0, 1, None),
    aten.addmm.default: (1, 2, 0),
    aten.baddbmm.default: (1, 2, 0),
    aten.addbmm.default: (1, 2, 0),
    aten.addmv.default: (1, 2, 0),
}
_PLAIN = {  # the product alone, for |A| |B|
    aten.mm.default: aten.mm.default,
    aten.bmm.default: aten.bmm.default,
    aten.mv.default: aten.mv.default,
    aten.dot.default: aten.dot.default,
    aten.addmm.default: aten.mm.default,
    aten.baddbmm.default: aten.bmm.default,
    aten.addbmm.default: None,  # sum over the batch of bmm: handled below
    aten.addmv.default: aten.mv.default,
}


def _unit_noise(c: torch.Tensor, salt: int) -> torch.Tensor:
    """xi in [-1, 1], a deterministic hash of the bits of ``c`` (fp32 or fp64) and ``salt``."""
    bits = c.view(torch.int64 if c.dtype == torch.float64 else torch.int32).to(torch.int64)
    h = (bits ^ salt) ^ (bits >> 17)
    h = (h * 0x2545F491) & 0xFFFFFFFF  # wraps modulo 2^64, then keeps 32 bits
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & 0xFFFF
    return h.to(c.dtype) / 32767.5 - 1.0


class BlasNoise(TorchDispatchMode):
    """Adds ``xi * sqrt(n - 1) * u * (|A| |B|)`` to every floating-point matmul-family result;
    ``seed`` (a positive integer) selects the pseudo-random ``xi``. ``u`` is the unit roundoff
    of the product's accumulation dtype, or of ``unit_of`` when given: an fp64 computation under
    ``unit_of=torch.float32`` shows how an fp32 BLAS's rounding moves its result (fp64 itself
    adding almost nothing), which is how ``numerics.rounding_sigma`` measures a value's
    sensitivity to rounding."""

    def __init__(self, seed: int = 1, *, unit_of: torch.dtype | None = None) -> None:
        super().__init__()
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 1:
            raise ValueError(f"seed must be a positive integer, got {seed!r}")
        if unit_of is not None and not unit_of.is_floating_point:
            raise TypeError(f"unit_of must be a floating dtype, got {unit_of}")
        self.seed = seed
        self.unit_of = unit_of

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = _PRODUCTS.get(func)
        if spec is None:
            return func(*args, **kwargs)
        ia, ib, _ = spec
        a, b = args[ia], args[ib]
        if not (a.is_floating_point() and b.is_floating_point()) or a.is_complex():
            return func(*args, **kwargs)
        out_dtype = a.dtype
        acc = torch.float64 if out_dtype == torch.float64 else torch.float32
        if out_dtype != acc:  # half operands: fp32 accumulation, one rounding at the end
            args = tuple(x.to(acc) if torch.is_tensor(x) else x for x in args)
            a, b = args[ia], args[ib]
        c = func(*args, **kwargs)
        if func is aten.addbmm.default:
            absprod = aten.bmm.default(a.abs(), b.abs()).sum(0)
            terms = aten.bmm.default((a != 0).to(acc), (b != 0).to(acc)).sum(0)
        else:
            absprod = _PLAIN[func](a.abs(), b.abs())
            terms = _PLAIN[func]((a != 0).to(acc), (b != 0).to(acc))
        alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
        u = torch.finfo(acc if self.unit_of is None else self.unit_of).eps / 2
        # BLAS libraries pick kernels by shape: a product of other sizes rounds differently
        salt = hash((tuple(a.shape), tuple(b.shape), self.seed)) & 0x7FFFFFFF
        # n nonzero terms: n - 1 additions whose order a BLAS chooses; with n <= 1 (a product by
        # the identity, a masked row) every order gives the same, often exact, result
        scale = (terms - 1).clamp_min(0).sqrt() * (u * abs(float(alpha)))
        noisy = c + _unit_noise(c, salt) * scale * absprod
        return noisy.to(out_dtype)
