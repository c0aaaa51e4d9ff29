"""torch thread counts for training, on an idle and on a loaded machine: the default choice
(``dlrm_app.threads``: affinity, cgroup quota, ranks per host, the loader's thread) against
1, 2, ..., N threads, N the CPUs this process may use.

Each run is a short real training run with the default flags (``dlrm_app.training.trainer.train``, in this
process, ``--threads K`` or none) on a dataset preprocessed from the shared samples (found
beside the repository: ../shared/data from its root, as tests/shared_data.py does):

  movielens_100k      MovieLens 100K (98k train rows, batch 1024 by default)
  criteo_kaggle_10k   the Criteo Kaggle 10k-row sample (8.6k train rows, batch 128)

The load is made here, reproducibly: ``--loads 0 1 2`` runs everything with 0, 1 and 2
busy-loop processes (``python -c "while True: pass"``) that this script starts before and stops
after each block. Settings, loads and repeats are interleaved (each repeat rotates the order),
since the machine may carry other jobs' load too: every line also gives the 1-minute load
average seen at the start of its runs.

A run's rate is samples/s over its first epoch (at most ``--steps`` steps) after the first
metrics window (warm-up): rows trained / seconds spent, from ``metrics.jsonl`` (stalls count,
a median of windows would hide them). The line of a setting gives the median over repeats.

Output: a header line (CPU from lscpu, CPUs usable, cgroup quota), then one JSON line per
(dataset, load, setting), then one summary line per (dataset, load): the default's rate over
the best setting's.

Usage: python bench/threads.py [--loads 0 1 2] [--repeats 5] [--datasets movielens_100k ...]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from common import cpu_model

from dlrm_app.data.criteo import preprocess_criteo
from dlrm_app.data.movielens import preprocess_movielens
from dlrm_app.threads import allowed_cpus, cgroup_cpu_quota
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.trainer import train

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DATASETS = {
    "movielens_100k": ("movielens", SHARED / "movielens" / "ml-100k"),
    "criteo_kaggle_10k": ("criteo", SHARED / "criteo" / "kaggle_head_10k.tsv"),
}
SPIN = "while True: pass"
S = TypeVar("S")  # a setting compared: a thread count (None: the default), a rank count


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """``count`` processes spinning on a CPU each while the block runs; stopped after it."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        time.sleep(0.5 if count else 0.0)  # let them get scheduled
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@dataclasses.dataclass
class Runs:
    """One (dataset, load, setting)'s runs: their rates (samples/s), the 1-minute load average
    at each one's start, and the threads the last one used."""

    rates: list[float] = dataclasses.field(default_factory=list)
    loadavg: list[float] = dataclasses.field(default_factory=list)
    threads: int = 0

    def median(self) -> float:
        return statistics.median(self.rates)

    def line(self) -> dict[str, Any]:
        """The result line's measured part: the median rate, every run's, the load average."""
        return {"samples_per_s": round(self.median()), "runs": [round(r) for r in self.rates],
                "loadavg_1m_median": round(statistics.median(self.loadavg), 2)}


def interleaved_runs(
    datasets: Sequence[str], loads: Sequence[int], settings: Sequence[S], repeats: int,
    run: Callable[[str, S], tuple[float, int]],
) -> dict[tuple[str, int], dict[S, Runs]]:
    """(dataset, load) -> setting -> its runs, in that order (the result lines'): every
    (dataset, load, setting) ``repeats`` times, each under ``load`` busy loops; each repeat
    rotates the order of loads and of settings by one. ``run(dataset, setting)`` gives
    (samples/s, threads used)."""
    runs = {(name, load): {setting: Runs() for setting in settings}
            for name in datasets for load in loads}
    for rep in range(repeats):
        for load in [*loads[rep % len(loads):], *loads[:rep % len(loads)]]:
            with busy_loops(load):
                for name in datasets:
                    for setting in [*settings[rep % len(settings):],
                                    *settings[:rep % len(settings)]]:
                        runs_of = runs[(name, load)][setting]
                        runs_of.loadavg.append(os.getloadavg()[0])
                        rate, runs_of.threads = run(name, setting)
                        runs_of.rates.append(rate)
    return runs


def prepare(name: str, root: Path) -> Path:
    kind, src = DATASETS[name]
    if not src.exists():
        raise SystemExit(f"bench/threads.py: {src} not found (the shared samples are expected "
                         "in ../shared/data beside the repository)")
    out = root / name
    if kind == "movielens":
        preprocess_movielens(src, out)
    else:
        preprocess_criteo([src], out)
    return out


def run_once(data: Path, out: Path, threads: int | None, steps: int,
             log_every: int) -> tuple[float, int]:
    """One training run: (samples/s after the first window, threads the run used)."""
    config = TrainConfig.from_flags(data=str(data), out=str(out), max_steps=steps, epochs=1,
                                    log_every=log_every, validate_every=0, patience=0,
                                    overwrite=True, threads=threads)
    train(config, progress=False)
    return rate_after_warmup(out / "metrics.jsonl")


def rate_after_warmup(metrics: Path) -> tuple[float, int]:
    """(samples/s after the first window, threads of rank 0) from a run's ``metrics.jsonl``.
    Its rates are global (rank 0 times each window, every rank trains ``global_batch / ranks``
    rows a step), so this is the run's global rate at any number of ranks."""
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    windows = [e for e in events if e["event"] == "train"]
    batch = next(e for e in events if e["event"] == "summary")["global_batch"]
    rows, seconds, previous = 0, 0.0, windows[0]["step"]
    for w in windows[1:]:
        n = (w["step"] - previous) * batch
        rows, seconds, previous = rows + n, seconds + n / w["samples_per_s"], w["step"]
    return rows / seconds, int(start["threads"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--loads", nargs="+", type=int, default=[0, 1, 2],
                        help="busy-loop processes to run alongside (0: no added load)")
    parser.add_argument("--threads", nargs="+", type=int, default=None,
                        help="explicit settings to compare (default: 1..CPUs usable)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="cap on steps per run")
    parser.add_argument("--log-every", type=int, default=5)
    args = parser.parse_args()

    cpus, quota, cpu = allowed_cpus(), cgroup_cpu_quota(), cpu_model()
    settings: list[int | None] = [None, *(args.threads or range(1, cpus + 1))]
    print(json.dumps({"bench": "threads", "cpu": cpu, "cpus_usable": cpus, "cgroup_quota": quota,
                      "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
                      "settings": ["default" if s is None else s for s in settings],
                      "loads": args.loads, "repeats": args.repeats}), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        data = {name: prepare(name, Path(tmp)) for name in args.datasets}
        for name in args.datasets:  # warm-up: first-use costs (imports, kernels) not counted
            run_once(data[name], Path(tmp) / "run", None, 10, args.log_every)
        runs = interleaved_runs(
            args.datasets, args.loads, settings, args.repeats,
            lambda name, setting: run_once(data[name], Path(tmp) / "run", setting, args.steps,
                                           args.log_every))
    for (name, load), by_setting in runs.items():
        medians = {s: r.median() for s, r in by_setting.items()}
        for s, r in by_setting.items():
            print(json.dumps({"bench": "threads", "cpu": cpu, "dataset": name, "busy_loops": load,
                              "setting": "default" if s is None else s, "threads": r.threads,
                              **r.line()}))
        explicit = {s: rate for s, rate in medians.items() if s is not None}
        best = max(explicit, key=explicit.__getitem__)
        print(json.dumps({
            "bench": "threads_summary", "cpu": cpu, "dataset": name, "busy_loops": load,
            "default_threads": by_setting[None].threads, "best_threads": best,
            "default_over_best": round(medians[None] / explicit[best], 3)}))

if __name__ == "__main__":
    main()
