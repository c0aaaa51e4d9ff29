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
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from dlrm_app.config import TrainConfig
from dlrm_app.data.criteo import preprocess_criteo
from dlrm_app.data.movielens import preprocess_movielens
from dlrm_app.threads import allowed_cpus, cgroup_cpu_quota
from dlrm_app.training.trainer import train

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DATASETS = {
    "movielens_100k": ("movielens", SHARED / "movielens" / "ml-100k"),
    "criteo_kaggle_10k": ("criteo", SHARED / "criteo" / "kaggle_head_10k.tsv"),
}
SPIN = "while True: pass"


def cpu_name() -> str:
    """The CPU's model name, as lscpu prints it."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


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
    config = TrainConfig(data=str(data), out=str(out), max_steps=steps, epochs=1,
                         log_every=log_every, validate_every=0, patience=0, overwrite=True,
                         threads=threads)
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

    cpus, quota, cpu = allowed_cpus(), cgroup_cpu_quota(), cpu_name()
    settings: list[int | None] = [None, *(args.threads or range(1, cpus + 1))]
    print(json.dumps({"bench": "threads", "cpu": cpu, "cpus_usable": cpus, "cgroup_quota": quota,
                      "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
                      "settings": ["default" if s is None else s for s in settings],
                      "loads": args.loads, "repeats": args.repeats}), flush=True)
    rates: dict[tuple[str, int, int | None], list[float]] = {}
    used: dict[tuple[str, int, int | None], int] = {}
    loadavg: dict[tuple[str, int, int | None], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        data = {name: prepare(name, Path(tmp)) for name in args.datasets}
        for name in args.datasets:  # warm-up: first-use costs (imports, kernels) not counted
            run_once(data[name], Path(tmp) / "run", None, 10, args.log_every)
        for rep in range(args.repeats):
            loads = args.loads[rep % len(args.loads):] + args.loads[:rep % len(args.loads)]
            for load in loads:
                with busy_loops(load):
                    for name in args.datasets:
                        order = settings[rep % len(settings):] + settings[:rep % len(settings)]
                        for setting in order:
                            key = (name, load, setting)
                            loadavg.setdefault(key, []).append(os.getloadavg()[0])
                            rate, threads = run_once(data[name], Path(tmp) / "run", setting,
                                                     args.steps, args.log_every)
                            rates.setdefault(key, []).append(rate)
                            used[key] = threads
    for name in args.datasets:
        for load in args.loads:
            medians = {s: statistics.median(rates[(name, load, s)]) for s in settings}
            for s in settings:
                key = (name, load, s)
                print(json.dumps({
                    "bench": "threads", "cpu": cpu, "dataset": name, "busy_loops": load,
                    "setting": "default" if s is None else s, "threads": used[key],
                    "samples_per_s": round(medians[s]),
                    "runs": [round(r) for r in rates[key]],
                    "loadavg_1m_median": round(statistics.median(loadavg[key]), 2)}))
            explicit = {s: r for s, r in medians.items() if s is not None}
            best = max(explicit, key=explicit.__getitem__)
            print(json.dumps({
                "bench": "threads_summary", "cpu": cpu, "dataset": name, "busy_loops": load,
                "default_threads": used[(name, load, None)], "best_threads": best,
                "default_over_best": round(medians[None] / explicit[best], 3)}))


if __name__ == "__main__":
    main()
