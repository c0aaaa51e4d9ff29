"""``PreemptionGuard`` alone: which signals stop training and how, and how often the ranks
agree (fewer steps between agreements when steps are slow, so that the stop fits a quarter of
``--grace-period``; the same interval on every rank)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dlrm_app.training.components.preemption import EVERY, Preempted, PreemptionGuard
from recsys_core.testing import run_gloo


@pytest.mark.parametrize(("step_s", "grace", "expected"), [
    (0.0, 30.0, EVERY),     # not measured yet
    (0.01, 30.0, EVERY),    # 375 steps would fit: capped
    (1.0, 30.0, 3),         # 2 intervals of 3 steps = 6 s <= 7.5 s; 4 would be 8 s
    (3.75, 30.0, 1),        # exactly 2 steps in 7.5 s
    (10.0, 30.0, 1),        # slower than the budget: as often as possible
    (0.1, 2.0, 2),          # 0.25 * 2 / (2 * 0.1) = 2.5
])
def test_interval_fits_a_quarter_of_the_grace_period(step_s: float, grace: float,
                                                     expected: int) -> None:
    assert PreemptionGuard(2, grace_period_s=grace).interval(step_s) == expected


def _agree(rank: int, world: int, slow_rank: int, step_s: float, grace: float,
           signal_at: int) -> list[tuple[int, int, bool]]:
    """Steps of ``step_s`` (the slow rank's; the other's are fast), SIGTERM to rank 1 after
    step ``signal_at``; per step (step, interval, stop)."""
    seen = []
    with PreemptionGuard(world, grace_period_s=grace) as guard:
        for step in range(1, 60):
            time.sleep(step_s if rank == slow_rank else 0.001)
            if step == signal_at and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            stop = guard.agreed()
            seen.append((step, guard.every, stop))
            if stop:
                assert guard.signal == signal.SIGTERM
                break
    return seen


def test_ranks_agree_on_the_interval_and_the_stop() -> None:
    # rank 0's steps take 0.1 s: with a 3 s grace period the ranks agree every 3 steps
    # (0.25 * 3 / (2 * 0.1) = 3.75; fewer where a busy machine stretches the steps), both of
    # them, though rank 1's own steps are fast; both stop after the same step
    ranks = run_gloo(2, _agree, 0, 0.1, 3.0, 20)
    assert ranks[0] == ranks[1]
    steps = ranks[0]
    assert steps[-1][2] and all(not stop for _, _, stop in steps[:-1])
    (every,) = {every for step, every, _ in steps if step >= 4}
    assert 1 <= every < EVERY  # adapted to the slow steps, below the cap (3 at 0.1 s steps)
    # the stop: at most 2 intervals after the signal, within a quarter of the grace period
    assert 20 < steps[-1][0] <= 20 + 2 * every


def _in_process(program: str) -> subprocess.CompletedProcess:
    head = ("import os, signal\n"
            "from dlrm_app.training.components.preemption import PreemptionGuard\n")
    return subprocess.run([sys.executable, "-c", head + program], capture_output=True,
                          text=True, timeout=60)


def test_sigint_is_noted_and_a_second_one_interrupts() -> None:
    # a repeat within REPEAT_AFTER_S is the same stop (torchrun passing on the terminal's
    # Ctrl-C to workers that had it too); a later one interrupts at once
    proc = _in_process(
        "import time\n"
        "with PreemptionGuard(1) as guard:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    print('noted', guard.signalled == signal.SIGINT, guard.agreed(), flush=True)\n"
        "    time.sleep(1.2)\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    except KeyboardInterrupt:\n"
        "        print('interrupted', flush=True)\n")
    assert proc.stdout.splitlines() == ["noted True True", "interrupted"], proc.stderr


def test_a_signal_of_the_other_kind_is_only_noted() -> None:
    # Ctrl-C under torchrun: the terminal's SIGINT, then torchrun's SIGTERM; the save must go on
    # (the handlers before it, whatever they were: a job started in the background of a
    # non-interactive shell begins with SIGINT ignored, not Python's default_int_handler)
    proc = _in_process(
        "before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)\n"
        "with PreemptionGuard(1) as guard:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    print('saving', guard.agreed(), guard.signal == signal.SIGINT, flush=True)\n"
        "print(signal.getsignal(signal.SIGTERM) is before[0],\n"
        "      signal.getsignal(signal.SIGINT) is before[1])\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["saving True True", "True True"]  # handlers restored


def test_exit_code_follows_the_signal() -> None:
    assert Preempted("x").exit_code == 143
    assert Preempted("x", signal.SIGINT).exit_code == 130


def _timed_saves(rank: int, world: int, step_s: float, every_s: float) -> list[tuple[int, float]]:
    """A training loop's use of the guard for ``--save-every DURATION``: (step, time) of saves."""
    saves = []
    with PreemptionGuard(world) as guard:
        for step in range(1, 90):
            time.sleep(step_s)
            guard.agreed()
            if guard.since_save_s is not None and guard.since_save_s >= every_s:
                saves.append((step, time.monotonic()))
                guard.saved()
    return saves


def test_ranks_agree_when_a_duration_has_passed_since_the_last_save() -> None:
    ranks = run_gloo(2, _timed_saves, 0.02, 0.3)
    assert [s for s, _ in ranks[0]] == [s for s, _ in ranks[1]]  # the same steps on both
    times = [t for _, t in ranks[0]]
    assert len(times) >= 3
    # never sooner than the duration after the previous save (the agreement in flight at a
    # save was sent before it and is not read for it); how much later is the machine's speed
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(g >= 0.3 for g in gaps), gaps


@pytest.mark.parametrize(("given", "expected"), [
    (0, 0), (500, 500), ("500", 500), ("10m", "10m"), (" 30s ", "30s"), ("1.5h", "1.5h")])
def test_save_every_takes_steps_or_a_duration(given, expected) -> None:
    from dlrm_app.training.config import TrainConfig, duration_seconds

    config = TrainConfig.from_flags(data="d", out="o", save_every=given)
    assert config.checkpoint.save_every == expected
    again = TrainConfig.from_json_dict(config.to_json_dict())
    assert again.checkpoint.save_every == expected
    assert duration_seconds("10m") == 600 and duration_seconds("1.5h") == 5400
    assert duration_seconds("30s") == 30 and duration_seconds("0m") is None


@pytest.mark.parametrize("bad", [-1, "10", "10q", "m", "-5m", "0s", True, 1.5])
def test_save_every_refuses_what_is_neither(bad) -> None:
    from dlrm_app.training.config import TrainConfig

    if bad == "10":  # digits alone are a step count
        assert TrainConfig.from_flags(data="d", out="o", save_every=bad).checkpoint.save_every == 10
        return
    with pytest.raises(ValueError, match="--save-every must be"):
        TrainConfig.from_flags(data="d", out="o", save_every=bad)
