"""Context parallelism: one sequence sharded along T across the ranks of a ``cp`` group.

Linear attention passes the past on as a constant-size state, so ranks exchange states, not
keys and values (LASP-2's design: one all-gather per layer). One function per op, each taking
the group (a ProcessGroup, a 1-D DeviceMesh such as ``mesh["cp"]``, or ``None`` for the world):

- ``cp_linear_attention``: causal ``linear_attention`` (plain and squared maps, key padding,
  ``denominator_offset``, an initial and a final state, packed documents via ``cu_seqlens``).
- ``cp_mixed_attention``: ``mixed_attention`` (psf_mixed) with the block grid kept global:
  a halo of the previous rank's last partial block.
- ``cp_short_conv``: ``nn.ShortConv``'s causal depthwise convolution (``short_conv=K``), the
  K - 1 inputs before each shard brought by ``halo`` (the rows before a shard).
- ``shard_bounds`` / ``shard``: the suggested balanced split; ``record_collectives``: the
  bytes every exchange moves.

Every op equals its single-process op on the whole sequence, outputs and gradients, up to
rounding (``tests/test_distributed_*.py``, gloo on CPU, 2 and 4 processes). NCCL on GPUs uses
the same calls but has not been tested. All ranks of the group must call each op, and run its
backward, together (the backward exchanges state gradients).
"""

from .comm import Collective, CommLog, record_collectives
from .group import CPGroup, resolve_group, shard, shard_bounds
from .halo import halo
from .linear import cp_linear_attention
from .mixed import cp_mixed_attention
from .short_conv import cp_short_conv

__all__ = [
    "CPGroup",
    "Collective",
    "CommLog",
    "cp_linear_attention",
    "cp_mixed_attention",
    "cp_short_conv",
    "halo",
    "record_collectives",
    "resolve_group",
    "shard",
    "shard_bounds",
]
