"""Preemption: SIGTERM (what Slurm, Kubernetes and torchrun send before they stop a job) ends
training after the step in progress, with a checkpoint of that step.

A rank only notes the signal in its handler; after each step the ranks agree (an all-reduce
of a flag, MAX: any rank signalled stops them all) so that every rank stops after the same step
and saves the same checkpoint together. The all-reduce started after a step is read after the
next one, so it runs while that step computes (the stop comes one step later; on gloo a
blocking one cost about as much as a small step's exchange). The run then ends with :class:`Preempted` (exit code
143, the shell's code for SIGTERM), and ``--resume`` (which a requeued job's command should
carry: it starts afresh where there is no checkpoint yet) continues from that step exactly.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

EXIT_CODE = 128 + signal.SIGTERM
"""What a process ended by SIGTERM reports (143): the job's scheduler sees a stop, not a crash."""


class Preempted(Exception):  # noqa: N818  (not an error: the run stopped when told to)
    """Training stopped on SIGTERM after a step, its checkpoint saved; the command line prints
    the message and exits with ``exit_code``."""

    exit_code = EXIT_CODE


class PreemptionGuard:
    """Notes SIGTERM while training runs (``with guard:``); :meth:`agreed` says after a step
    whether any rank was signalled. The previous handler comes back on exit."""

    def __init__(self, world_size: int, device: torch.device | None = None) -> None:
        self.world_size = world_size
        self.signalled = False
        self._previous: Any = None
        self._device = device  # NCCL: the flag on the GPU
        self._pending: tuple[Any, torch.Tensor] | None = None

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():  # signals reach it only
            self._previous = signal.signal(signal.SIGTERM, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pending is not None:  # every rank started it: finish it before what follows
            self._pending[0].wait()
            self._pending = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True

    def agreed(self) -> bool:
        """True when a rank had been signalled by the end of the previous call's step
        (collective: every rank calls it after each step, and gets the same answer)."""
        if self.world_size == 1 or not dist.is_initialized():
            return self.signalled
        stop = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            stop = bool(flag.item())
        flag = torch.tensor([int(self.signalled)], dtype=torch.int32, device=self._device)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return stop
