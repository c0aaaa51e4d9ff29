"""Day-by-day training on drifting days: following the days against a frozen model and against
retraining from scratch, in progressive AUC (each day scored by a model that has not seen it)
and in CPU seconds.

One generated dataset (``dlrm-app generate --days N --drift D --rows-per-shard R``: N days of R
rows, each day its own train shard; the last day's halves are the validation and test shards),
then, per training seed, for every day ``d >= 1``:

  follow   ``dlrm-app train --follow`` over all days: its ``day`` line of day ``d`` (the model
           after one pass over each of days 0..d-1, scored on day d before training on it)
  frozen   the model after day 0 only (the follow run's day-0 checkpoint), scored on day d;
           its cost is a ``train --follow`` over a view of the dataset holding day 0 alone
  retrain  a fresh model trained from scratch on days 0..d-1 pooled, as a team that retrains
           every day would: plain ``dlrm-app train`` (not --follow) with the app's default
           ``--epochs`` (3) over a view whose train split is the shards of days 0..d-1,
           shuffled together; no early stopping (``--patience 0``: the only validation rows
           at hand are of the days trained on or of the future), the last checkpoint scored on
           day d. One pass per day in order would be no baseline: with the constant default
           learning rate it is the follow run's own model, step for step

A view is a directory of symlinks to the dataset's shards and a ``dataset.json`` whose train
split (and days) are the chosen days' (its validation split is the last trained day's shard,
read one batch an epoch: ``--validate-every 0 --val-batches 1``). Every run uses the same
``--batch-size`` and seed. Frozen and retrain are scored in this process
(``load_trained_model`` + ``evaluate_model`` on ``ParquetLoader(days=d)``, as the follow run
scores a day, in its batch size); follow's numbers are its own log's.

Cost: CPU seconds (user + system) of each approach's training processes, from
``getrusage(RUSAGE_CHILDREN)`` around each; the follow run's include its progressive
evaluations, the in-process scoring of frozen and retrain is not counted.

Output: a header line (CPU, torch / FBGEMM versions, command, dataset and its days' teacher
AUC, the best any model can score), one line per (seed, approach, day), one cost line per
(seed, approach), and a summary line: the mean progressive AUC of each approach over days 1..N-1
and seeds, the mean gap to follow, and the CPU ratios to follow.

Usage: python bench/days.py [--days 6] [--rows-per-day 30000] [--drift 0.1] [--seeds 0]
                            [--batch-size 256] [--retrain-epochs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.schema import DATASET_JSON
from dlrm_app.training.checkpoint import latest_checkpoint
from dlrm_app.training.evaluate import evaluate_model, load_trained_model
from dlrm_app.training.runtime import init_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_flags, cpu_model  # noqa: E402

APPROACHES = ("follow", "frozen", "retrain")


def _versions() -> dict[str, str | None]:
    """torch's version and FBGEMM's (None: not installed, the pure-torch fallback)."""
    from importlib.metadata import PackageNotFoundError, version
    fbgemm = None
    for dist in ("fbgemm_gpu_cpu", "fbgemm_gpu"):
        try:
            fbgemm = version(dist)
            break
        except PackageNotFoundError:
            continue
    return {"torch": torch.__version__, "fbgemm_gpu": fbgemm}


def cli(*args: str) -> float:
    """Runs ``python -m dlrm_app ARGS``; returns its CPU seconds (user + system)."""
    cmd = [sys.executable, "-m", "dlrm_app", *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"bench/days.py: `{' '.join(cmd)}` failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-4000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def generate(out: Path, args: argparse.Namespace) -> None:
    cli("generate", "--out", str(out), "--rows", str(args.days * args.rows_per_day),
        "--days", str(args.days), "--drift", str(args.drift),
        "--rows-per-shard", str(args.rows_per_day), "--row-group-size",
        str(min(args.rows_per_day, 65536)), "--num-dense", str(args.num_dense),
        "--num-sparse", str(args.num_sparse), "--cardinalities", str(args.cardinality),
        "--seed", str(args.data_seed))


def view(data: Path, days: int, out: Path) -> Path:
    """A dataset of ``data``'s first ``days`` days: their train shards as its train split, the
    last one also as its validation split (symlinks; ``dataset.json`` rewritten)."""
    meta = json.loads((data / DATASET_JSON).read_text())
    shards = meta["splits"]["train"]["shards"]
    records = meta["parameters"]["days"][:days]
    files = [p["file"] for r in records for p in r["pieces"]]
    if len(records) < days or files != [s["file"] for s in shards[:days]]:
        raise SystemExit(f"bench/days.py: {data}: days 0..{days - 1} are not the first "
                         f"{days} train shards, one each (generate with --rows-per-shard = "
                         f"rows a day)")
    out.mkdir(parents=True)
    for s in shards[:days]:
        (out / s["file"]).symlink_to(data / s["file"])
    meta["splits"] = {"train": {**meta["splits"]["train"], "shards": shards[:days]},
                      "validation": {**meta["splits"]["validation"],
                                     "shards": [shards[days - 1]]},
                      "test": {**meta["splits"]["test"], "shards": [shards[days - 1]]}}
    meta["parameters"]["days"] = records
    (out / DATASET_JSON).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def score(run: Path, checkpoint: Path, data: Path, day: int, batch_size: int) -> dict:
    """A checkpoint of ``run`` on day ``day`` of ``data`` (as ``--follow`` scores a day)."""
    model, config, _, _ = load_trained_model(run, checkpoint, data=str(data))
    loader = ParquetLoader(data, days=day, batch_size=batch_size, drop_last=False,
                           pad_last=True)
    return evaluate_model(model, loader, init_distributed(), amp=config.parallel.amp)


def log(run: Path, event: str) -> list[dict]:
    lines = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["event"] == event]


def train_args(data: Path, out: Path, seed: int, args: argparse.Namespace) -> list[str]:
    return ["train", "--quiet", "--data", str(data), "--out", str(out), "--seed", str(seed),
            "--batch-size", str(args.batch_size), "--overwrite"]


def bench_seed(data: Path, work: Path, seed: int, args: argparse.Namespace,
               teacher: list[float]) -> list[dict]:
    lines: list[dict] = []

    def emit(approach: str, day: int, auc: float | None, ne: float | None, **kw: Any) -> None:
        line = {"bench": "days", "seed": seed, "approach": approach, "day": day,
                "progressive_auc": auc, "ne": ne, "teacher_auc": teacher[day], **kw}
        lines.append(line)
        print(json.dumps(line), flush=True)

    follow_run = work / f"follow-{seed}"
    follow_cpu = cli(*train_args(data, follow_run, seed, args), "--follow",
                     "--keep-checkpoints", str(args.days + 1))
    days = {d["day"]: d for d in log(follow_run, "day")}
    done = {d["day"]: d for d in log(follow_run, "day_done")}
    for d in range(1, args.days):
        emit("follow", d, days[d]["progressive_auc"], days[d]["ne"],
             model_step=days[d]["model_step"], model_days=days[d]["model_days"])

    day0 = follow_run / "checkpoints" / done[0]["checkpoint"]
    frozen_cpu = cli(*train_args(view(data, 1, work / f"view-{seed}-1"), work / f"frozen-{seed}",
                                 seed, args), "--follow")
    for d in range(1, args.days):
        m = score(follow_run, day0, data, d, args.batch_size)
        emit("frozen", d, m["auc"], m["ne"], model_step=done[0]["step"], model_days=1)

    retrain_cpu = 0.0
    for d in range(1, args.days):
        run = work / f"retrain-{seed}-{d}"
        cpu = cli(*train_args(view(data, d, work / f"view-{seed}-{d}-r"), run, seed, args),
                  "--epochs", str(args.retrain_epochs), "--patience", "0",
                  "--validate-every", "0", "--val-batches", "1")
        retrain_cpu += cpu
        checkpoint = latest_checkpoint(run / "checkpoints")
        assert checkpoint is not None, run
        m = score(run, checkpoint, data, d, args.batch_size)
        summary = log(run, "summary")[-1]
        emit("retrain", d, m["auc"], m["ne"], model_step=summary["steps"], model_days=d,
             cpu_s=round(cpu, 2))

    for approach, cpu in (("follow", follow_cpu), ("frozen", frozen_cpu),
                          ("retrain", retrain_cpu)):
        line = {"bench": "days_cost", "seed": seed, "approach": approach,
                "cpu_s": round(cpu, 2)}
        lines.append(line)
        print(json.dumps(line), flush=True)
    return lines


def summarize(lines: list[dict]) -> dict:
    aucs = {a: [x["progressive_auc"] for x in lines if x["bench"] == "days"
                and x["approach"] == a] for a in APPROACHES}
    cpu = {a: sum(x["cpu_s"] for x in lines if x["bench"] == "days_cost" and x["approach"] == a)
           for a in APPROACHES}
    by_day = {(x["seed"], x["day"]): x["progressive_auc"] for x in lines
              if x["bench"] == "days" and x["approach"] == "follow"}

    def gap(a: str) -> float:
        return statistics.fmean(x["progressive_auc"] - by_day[x["seed"], x["day"]]
                                for x in lines if x["bench"] == "days" and x["approach"] == a)

    return {"bench": "days_summary",
            "mean_progressive_auc": {a: round(statistics.fmean(v), 4) for a, v in aucs.items()},
            "mean_gap_to_follow": {a: round(gap(a), 4) for a in APPROACHES if a != "follow"},
            "cpu_s": {a: round(v, 1) for a, v in cpu.items()},
            "cpu_ratio_to_follow": {a: round(cpu[a] / cpu["follow"], 2) for a in APPROACHES
                                    if a != "follow"}}


def header(args: argparse.Namespace, days: list[dict]) -> dict:
    """The first line: the machine, the versions, the command and the data (``days``: the
    dataset's ``parameters.days``, with each day's teacher AUC and renewed share)."""
    return {"bench": "days_header", "cpu": cpu_model(),
            "cpus_usable": len(os.sched_getaffinity(0)),
            "loadavg_1m_at_start": round(os.getloadavg()[0], 2), **_versions(),
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
            "command": " ".join(["python", "bench/days.py", *sys.argv[1:]]),
            "days": args.days, "rows_per_day": args.rows_per_day, "drift": args.drift,
            "num_dense": args.num_dense, "num_sparse": args.num_sparse,
            "cardinality": args.cardinality, "data_seed": args.data_seed,
            "seeds": args.seeds, "batch_size": args.batch_size,
            "retrain": f"plain train, {args.retrain_epochs} epochs over days 0..d-1 pooled, "
                       "no early stopping, last checkpoint",
            "teacher_auc": [round(float(r["teacher_auc"]), 4) for r in days],
            "renewed": [r.get("renewed") for r in days]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_flags(parser, {"--days": 6, "--rows-per-day": 30000, "--drift": 0.1, "--num-dense": 13,
                       "--num-sparse": 26, "--cardinality": 10000})
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the generated days")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="training seeds (init and data order), one of each run apiece")
    parser.add_argument("--batch-size", type=int, default=256, help="of every run")
    parser.add_argument("--retrain-epochs", type=int, default=3,
                        help="epochs of each retraining (the app's default --epochs)")
    parser.add_argument("--work", type=Path, default=None,
                        help="keep the dataset and runs here (default: a temporary folder)")
    args = parser.parse_args()
    if args.days < 3:
        parser.error("--days must be at least 3: day 0 to start and days 1.. to score")

    with tempfile.TemporaryDirectory(prefix="bench-days-") as tmp:
        work = args.work or Path(tmp)
        data = work / "data"
        generate(data, args)
        meta = json.loads((data / DATASET_JSON).read_text())["parameters"]["days"]
        teacher = [round(float(r["teacher_auc"]), 4) for r in meta]
        print(json.dumps(header(args, meta)), flush=True)
        lines: list[dict] = []
        for seed in args.seeds:
            lines += bench_seed(data, work, seed, args, teacher)
    print(json.dumps(summarize(lines)), flush=True)


if __name__ == "__main__":
    main()
