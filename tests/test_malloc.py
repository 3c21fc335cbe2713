"""``polysketch.hold_freed_memory``: training steps reuse the pages of the step before (no
page faults) once the thresholds are held, where glibc's defaults fault their large
activations in again every step; the allocator is left alone where the user chose it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from polysketch import _malloc

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Training steps of the preset whose activations churn most (one layer at T = 2048: its
# 2048 × 1920 bucket probabilities are 15 MiB each): the minor page faults of the last four of
# twelve steps, after the heap has reached its peak (held, it may still grow in the first few
# steps, the later the more processes share the machine).
_STEPS = r"""
import json, resource, sys, torch
import polysketch
from polysketch.nn import TransformerConfig, TransformerLM
torch.set_num_threads(1)
held = polysketch.hold_freed_memory() if sys.argv[1] == "hold" else False
torch.manual_seed(0)
model = TransformerLM(TransformerConfig(vocab_size=64, block_size=2048, n_layer=1, n_head=1,
                                        n_embd=64, attention="soft_hash_far_local_tied"))
idx = torch.randint(0, 64, (1, 2048))
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(idx, targets=idx)[1].backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"held": held, "faults": sum(faults[8:])}))
"""

PAGES_PER_TENSOR = 2048 * 1920 * 4 // 4096  # one 2048 × 1920 fp32 tensor


_CHOICES = (*_malloc._ENV_CHOICES, "GLIBC_TUNABLES", "POLYSKETCH_SYSTEM_MALLOC", "LD_PRELOAD")


def _run(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _CHOICES}
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only (mallopt)")
def test_held_thresholds_reuse_the_pages_of_the_step_before():
    held = _run("hold")
    assert held["held"] is True
    # held: the four steps reuse the heap's pages (1-2 faults on a quiet machine); at most a
    # late growth of the heap under load (seen up to 2.1 such tensors under xdist on 2 cores),
    # less than what glibc's defaults fault in again in one step (4.7+ tensors a step, so
    # 19+ over the four), not several tensors every step
    assert held["faults"] < 4 * PAGES_PER_TENSOR, held
    system = _run("system")  # glibc's defaults: four or more such tensors every step
    assert system["faults"] > 8 * PAGES_PER_TENSOR, system


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only (mallopt)")
@pytest.mark.parametrize("env", [
    {"POLYSKETCH_SYSTEM_MALLOC": "1"}, {"MALLOC_TRIM_THRESHOLD_": "131072"},
    {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
    {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"},
])  # fmt: skip
def test_the_users_choice_of_allocator_is_left_alone(env, monkeypatch):
    for name in _CHOICES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_malloc, "_held", False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _malloc.hold_freed_memory() is False
    assert _malloc.holds_freed_memory() is False
    for name in env:
        monkeypatch.delenv(name)
    assert _malloc.hold_freed_memory() is True  # (what polysketch.cli.main sets in this process)


def test_user_choice_names_the_setting(monkeypatch):
    for name in _CHOICES:
        monkeypatch.delenv(name, raising=False)
    assert _malloc._user_choice() is None
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libgomp.so.1")  # not an allocator
    assert _malloc._user_choice() is None
    monkeypatch.setenv("POLYSKETCH_SYSTEM_MALLOC", "0")  # 0: not set
    assert _malloc._user_choice() is None
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc.so.4")
    assert _malloc._user_choice() == "LD_PRELOAD"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert _malloc._user_choice() == "MALLOC_ARENA_MAX"
