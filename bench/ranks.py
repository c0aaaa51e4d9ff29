"""1 rank against 2 ranks of ``dlrm-app train`` on one host, on an idle machine and with a core
taken by another process: what a second rank gains, and what it loses when the machine is busy.

Each run is a short real training run of the command line with the default flags, in its own
process as a user starts it: ``python -m dlrm_app train`` for 1 rank, ``python -m
torch.distributed.run --standalone --nproc-per-node 2 -m dlrm_app train`` for 2. The datasets,
the busy loops, the header's CPU and the rate are those of bench/threads.py:

  movielens_100k      MovieLens 100K (98k train rows)
  criteo_kaggle_10k   the Criteo Kaggle 10k-row sample (8.6k train rows)

Same global batch: ``--batch-size`` is rows per rank per step, and its data-derived default
divides the rows by 64 steps x ranks, which may round differently (or hit its cap) at 2 ranks.
Both runs therefore get the 1-rank default as their global batch: ``--batch-size G`` on 1 rank,
``G/2`` on 2 (on these two samples that is what the defaults choose anyway: 1024 and 128), so
they train the same rows per step and follow the same trajectory (docs/training.md).

Loads: ``--loads 0 1`` runs everything with 0 and 1 busy-loop processes (bench/threads.py's
``busy_loops``); loads and rank counts are interleaved, each repeat rotating their order. A
run's rate is global samples/s after its first metrics window, from its ``metrics.jsonl``
(``rate_after_warmup``: rank 0 writes the log and times each window of steps, in which every
rank trains its share of the global batch, so its rates are already the global ones).

Output: a header line, one JSON line per (dataset, load, ranks) with the median over repeats,
the repeats' values and the 1-minute load average, then one summary line per (dataset, load):
the 2-rank median over the 1-rank median.

Usage: python bench/ranks.py [--loads 0 1] [--repeats 3] [--datasets movielens_100k ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from dlrm_app.data.schema import DatasetSpec
from dlrm_app.threads import allowed_cpus, cgroup_cpu_quota
from dlrm_app.training.config import TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model  # noqa: E402
from threads import DATASETS, interleaved_runs, prepare, rate_after_warmup  # noqa: E402

RANKS = (1, 2)


def global_batch(data: Path) -> int:
    """The default ``--batch-size`` of 1 rank on ``data``: the global batch of every run."""
    rows = DatasetSpec.load(data).split("train").rows
    size = TrainConfig.from_flags(data=str(data), out="").with_batch_size(
        rows, world_size=1).schedule.batch_size
    assert size is not None and size % max(RANKS) == 0, size
    return size


def command(ranks: int, data: Path, out: Path, batch: int, steps: int,
            log_every: int) -> list[str]:
    """The command line of one run: the defaults but for ``--batch-size`` (``batch`` rows a step
    over all ranks) and the short run's flags bench/threads.py gives ``train``."""
    launch = [sys.executable, "-m", "dlrm_app"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(ranks), "-m", "dlrm_app"]
    return [*launch, "train", "--quiet", "--data", str(data), "--out", str(out),
            "--batch-size", str(batch // ranks), "--epochs", "1", "--max-steps", str(steps),
            "--log-every", str(log_every), "--validate-every", "0", "--patience", "0",
            "--overwrite"]


def run_once(ranks: int, data: Path, out: Path, batch: int, steps: int,
             log_every: int) -> tuple[float, int]:
    """One run: (global samples/s after the first window, threads of each rank)."""
    cmd = command(ranks, data, out, batch, steps, log_every)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench/ranks.py: `{' '.join(cmd)}` failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-4000:]}")
    metrics = out / "metrics.jsonl"
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    summary = next(e for e in events if e["event"] == "summary")
    if (summary["world_size"], summary["global_batch"]) != (ranks, batch):
        raise SystemExit(f"bench/ranks.py: {metrics} ran {summary['world_size']} rank(s) at "
                         f"global batch {summary['global_batch']}, not {ranks} at {batch}")
    return rate_after_warmup(metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--loads", nargs="+", type=int, default=[0, 1],
                        help="busy-loop processes to run alongside (0: no added load)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="cap on steps per run")
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--warmup-steps", type=int, default=10,
                        help="steps of one unmeasured run per dataset and rank count first, "
                             "so the measured ones find torch and the data in the page cache "
                             "(0: none)")
    args = parser.parse_args()
    for flag, steps in (("--steps", args.steps), ("--warmup-steps", args.warmup_steps or None)):
        if steps is not None and steps < 2 * args.log_every:
            parser.error(f"{flag} {steps} leaves no metrics window after the first (warm-up) "
                         f"one; give at least 2 x --log-every ({2 * args.log_every})")

    cpu = cpu_model()
    header = {"bench": "ranks", "cpu": cpu, "cpus_usable": allowed_cpus(),
              "cgroup_quota": cgroup_cpu_quota(),
              # unset: torchrun sets 1 per rank (and train follows it), 1 rank uses the CPUs
              "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
              "loadavg_1m_at_start": round(os.getloadavg()[0], 2), "ranks": list(RANKS),
              "loads": args.loads, "repeats": args.repeats, "steps": args.steps,
              "rate": "global samples/s after the first window, same global batch at each "
                      "rank count (--batch-size global/ranks)"}
    print(json.dumps(header), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        data = {name: prepare(name, Path(tmp)) for name in args.datasets}
        batch = {name: global_batch(data[name]) for name in args.datasets}
        run = Path(tmp) / "run"
        if args.warmup_steps:
            for name in args.datasets:
                for ranks in RANKS:
                    run_once(ranks, data[name], run, batch[name], args.warmup_steps,
                             args.log_every)
        runs = interleaved_runs(
            args.datasets, args.loads, RANKS, args.repeats,
            lambda name, ranks: run_once(ranks, data[name], run, batch[name], args.steps,
                                         args.log_every))
    for (name, load), by_ranks in runs.items():
        for ranks, r in by_ranks.items():
            print(json.dumps({
                "bench": "ranks", "cpu": cpu, "dataset": name, "busy_loops": load,
                "ranks": ranks, "global_batch": batch[name], "batch_per_rank": batch[name] // ranks,
                "threads_per_rank": r.threads, **r.line()}))
        print(json.dumps({
            "bench": "ranks_summary", "cpu": cpu, "dataset": name, "busy_loops": load,
            "two_over_one": round(by_ranks[2].median() / by_ranks[1].median(), 3)}))

if __name__ == "__main__":
    main()
