"""tests/gpu: one Triton launch configuration per kernel (``POLYSKETCH_TRITON_CONFIGS``, read
when the kernels are defined, so before any test imports them): every kernel compiles once and
nothing is timed, which keeps the whole folder inside one short GPU lease. The values a kernel
computes do not depend on its warps or pipeline stages; ``make gpu-check``'s bench stage runs
the full autotuning set. An explicit setting in the environment wins."""

import os

os.environ.setdefault("POLYSKETCH_TRITON_CONFIGS", "4x1")
