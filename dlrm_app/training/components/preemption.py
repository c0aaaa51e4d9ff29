"""Preemption: SIGTERM (what Slurm, Kubernetes and torchrun send before they stop a job) or
SIGINT (Ctrl-C) ends training after the step in progress, with a checkpoint of that step.

A rank only notes the signal in its handler; every few steps the ranks agree (an all-reduce,
MAX: any rank signalled stops them all) so that every rank stops after the same step and saves
the same checkpoint together. The all-reduce started at one such step is read at the next, so
it runs while the steps between compute: the stop comes at most ``2 * every`` steps after the
signal, and the check costs a step almost nothing (``bench/preemption.py``, 2 gloo ranks on the
2-core AMD EPYC, 3.2-3.4 ms stand-in steps: -0.07 to 0.28 ms a step, 4 runs; a blocking
all-reduce after every step added 1.0-1.2 ms, one started ahead at every step 0.8-1.1 ms).

How many steps lie between agreements follows the grace period (``--grace-period``, default
30 s, what a scheduler waits between SIGTERM and SIGKILL; Kubernetes' default is 30 s): each
agreement also carries the slowest rank's seconds per step since the previous one, so every
rank sets the same next interval, ``EVERY`` steps at most and fewer when steps are slow, such
that the stop takes at most a quarter of the grace period and the save has the rest.

The run then ends with :class:`Preempted` (exit code 128 + the signal: 143 for SIGTERM, 130 for
SIGINT, the shell's codes), and the same command (or ``--resume``) continues from that step
exactly. A second signal of the same kind, ``REPEAT_AFTER_S`` or more after the first, ends the
process at once (SIGTERM: its default action; SIGINT: ``KeyboardInterrupt``), without a
checkpoint. Sooner it is the same stop: a launcher passing on the signal its workers also got
(Ctrl-C reaches torchrun and its workers, which torchrun then signals again; Slurm's scancel
signals every process of the step, torchrun included). A signal of the other kind is only
noted. torchrun waits ``--shutdown-timeout`` (default 30 s) for the workers it signalled
before it kills them: keep it at least ``--grace-period``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

REPEAT_AFTER_S = 1.0
"""A repeated signal sooner than this after the first is the same stop (a launcher's relay)."""
EVERY = 8
"""The most steps between the ranks' agreements (one process: every step, no collective)."""
STOP_SHARE = 0.25
"""The part of the grace period the ranks may take to agree on a stop; the save has the rest."""
SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_CODE = 128 + signal.SIGTERM
"""What a process ended by SIGTERM reports (143): the job's scheduler sees a stop, not a crash."""


class Preempted(Exception):  # noqa: N818  (not an error: the run stopped when told to)
    """Training stopped on SIGTERM or SIGINT after a step, its checkpoint saved; the command
    line prints the message and exits with ``exit_code`` (128 + the signal)."""

    def __init__(self, message: str, signum: int = signal.SIGTERM) -> None:
        super().__init__(message)
        self.exit_code = 128 + int(signum)


class PreemptionGuard:
    """Notes SIGTERM and SIGINT while training runs (``with guard:``); :meth:`agreed` says after
    a step whether any rank was signalled. The previous handlers come back on exit."""

    def __init__(self, world_size: int, device: torch.device | None = None,
                 every: int = EVERY, grace_period_s: float = 30.0) -> None:
        self.world_size, self.max_every = world_size, every
        self.every = 1
        """Steps to the next agreement (the same on every rank): 1 until the ranks have
        agreed on a measured step time (at the third step), then :meth:`interval`."""
        self.grace_period_s = grace_period_s
        self._calls = 0
        self._next = 1
        self._since: tuple[int, float] | None = None  # (call, time) of the last agreement
        self.signalled: int | None = None
        """The first signal this rank got, or None."""
        self.signal: int | None = None
        """The signal the ranks agreed to stop on (the larger number where ranks differ)."""
        self._seen: dict[int, float] = {}  # signal -> when it first came
        self._previous: dict[int, Any] = {}
        self._device = device  # NCCL: the flag on the GPU
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._saved = time.monotonic()
        self._stale = False
        self.since_save_s: float | None = None
        """At an agreement (None between them): the longest any rank has gone without a
        checkpoint, the same number on every rank (``--save-every 10m`` saves on it)."""

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():  # signals reach it only
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pending is not None:  # every rank started it: finish it before what follows
            self._pending[0].wait()
            self._pending = None
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if signum in self._seen:
            if now - self._seen[signum] < REPEAT_AFTER_S:
                return  # the same stop, passed on by a launcher
            if signum == signal.SIGINT:  # asked again: at once
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._seen[signum] = now
        if self.signalled is None:
            self.signalled = signum

    def saved(self) -> None:
        """A checkpoint was saved after this step (on every rank): the time since the last
        one starts again (the agreement in flight, sent before it, is not read for it)."""
        self._saved = time.monotonic()
        self._stale = self._pending is not None

    def agreed(self) -> bool:
        """True when a rank had been signalled by the previous agreement (collective: every
        rank calls it after each step, and gets the same answer at the same call)."""
        self.since_save_s = None
        if self.world_size == 1 or not dist.is_initialized():
            if self.signalled is not None:
                self.signal = self.signalled
            self.since_save_s = time.monotonic() - self._saved
            return self.signalled is not None
        self._calls += 1
        if self._calls < self._next:
            return False
        now = time.perf_counter()
        step_s = 0.0 if self._since is None else \
            (now - self._since[1]) / max(self._calls - self._since[0], 1)
        self._since = (self._calls, now)
        stop = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            signum, slowest = int(flag[0].item()), float(flag[1].item())
            stop = signum > 0
            if stop:
                self.signal = signum
            if slowest > 0:
                self.every = self.interval(slowest)
            if not self._stale:
                self.since_save_s = float(flag[2].item())
            self._stale = False
        flag = torch.tensor([float(self.signalled or 0), step_s, now - self._saved],
                            dtype=torch.float64, device=self._device)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        self._next = self._calls + self.every
        return stop

    def interval(self, step_s: float) -> int:
        """Steps between agreements for steps of ``step_s`` seconds: the stop (at most two
        intervals after the signal) within ``STOP_SHARE`` of the grace period."""
        if step_s <= 0:
            return self.max_every
        return max(1, min(self.max_every, int(STOP_SHARE * self.grace_period_s / (2 * step_s))))
