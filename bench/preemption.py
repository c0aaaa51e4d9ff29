"""What the preemption check adds to a training step: the ranks' agreement after each step (an
all-reduce of a one-element flag, read after the next step, ``PreemptionGuard.agreed``), timed
on ``--world`` gloo ranks of this host: steps of a stand-in compute without it, with it, and with a
blocking all-reduce right after the step instead, alternating in rounds, in the same run.

One JSON line: median microseconds per step both ways over ``--rounds`` rounds of ``--calls``
steps, the difference, and the CPU. For scale: a step of ``dlrm-app train`` at its default batch takes tens of
milliseconds or more (docs/benchmarks.md).

Usage: python bench/preemption.py [--world 2] [--calls 500] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from dlrm_app.training.components.preemption import PreemptionGuard
from recsys_core.testing import run_gloo


def worker(rank: int, world: int, calls: int, rounds: int) -> dict[str, float]:
    """Per step: a stand-in for a step's compute (a 256x256 matrix product chain, about a
    millisecond), with and without the agreement after it, alternating in rounds."""
    a = torch.randn(256, 256)

    def step() -> None:
        x = a
        for _ in range(8):
            x = torch.mm(x, a).clamp_(-1, 1)

    def blocking() -> bool:  # the alternative: agree right after the step
        flag = torch.zeros(1, dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    timings: dict[str, list[float]] = {"bare": [], "agreed": [], "blocking": []}
    for _ in range(rounds):
        for case in timings:
            guard = PreemptionGuard(world)
            with guard:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    step()
                    if case == "agreed":
                        guard.agreed()
                    elif case == "blocking":
                        blocking()
                timings[case].append((time.perf_counter() - start) / calls * 1e6)
    return {case: statistics.median(t) for case, t in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = run_gloo(args.world, worker, args.calls, args.rounds)
    from torchrec_program import cpu_name  # noqa: PLC0415  (this folder is on sys.path)
    r = results[0]
    print(json.dumps({"bench": "preemption_agreement", "world": args.world,
                      "step_us": round(r["bare"], 1),
                      "added_us": round(r["agreed"] - r["bare"], 1),
                      "added_us_blocking": round(r["blocking"] - r["bare"], 1),
                      "cpu": cpu_name()}))


if __name__ == "__main__":
    main()
