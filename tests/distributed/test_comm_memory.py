"""Collective buffers are freed after each step (a Work <-> grad_fn cycle through C++ used to
keep every step's all-to-all buffers alive on gloo)."""

from __future__ import annotations

import gc
import time
import weakref

import torch
import torch.distributed as dist

from recsys_core.distributed.comm import TensorAllToAll, all_to_all_1d
from recsys_core.testing import run_gloo


def _steps_release_buffers(rank: int, world_size: int) -> list[bool]:
    refs = []
    for _ in range(3):
        x = torch.randn(8, requires_grad=True)
        inflight = all_to_all_1d(x, [4, 4], [4, 4], dist.group.WORLD)
        out = inflight.wait()
        (out * (rank + 1)).sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        ids = TensorAllToAll(torch.arange(4), [2, 2], [2, 2], dist.group.WORLD)
        refs.append([weakref.ref(inflight._state), weakref.ref(out), weakref.ref(ids.wait())])
        del inflight, out, ids, x
    # gloo's worker thread may hold a finished work for a moment; a leak never goes away
    deadline = time.monotonic() + 10
    while any(r() is not None for step in refs for r in step) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return [any(r() is not None for r in step) for step in refs]


def test_all_to_all_state_and_buffers_are_freed() -> None:
    for alive in run_gloo(2, _steps_release_buffers):
        assert alive == [False, False, False]
