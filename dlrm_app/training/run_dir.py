"""A run directory (``dlrm-app train --out RUN``): what it holds, and starting one safely.

    RUN/config.json       the TrainConfig (``--resume`` continues with it)
    RUN/plan.json         the sharding plan
    RUN/metrics.jsonl     train / validation / best / summary events, one JSON per line
    RUN/checkpoints/      step_N/ directories, ``latest`` and ``best`` pointers
    RUN/evaluations/      metrics and curves of evaluations (for the report)
    RUN/report.md, RUN/plots/   the report (``dlrm-app report RUN`` regenerates it)

An existing run is never overwritten by accident. The same command again (a requeued or
restarted job: the saved config equals the new one) continues it from its newest checkpoint,
as ``--resume`` does, and says so; with any other config training refuses to start in it
unless given ``--resume`` (continue it) or ``--overwrite`` (start over). A start that failed before its
first step (a batch size too large for memory, a bad plan) is not a run: it trained nothing
and saved no checkpoint, so the next start replaces what it left (``config.json``,
``plan.json``, its ``start`` event) with or without ``--resume``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from dlrm_app.training.config import TrainConfig
from dlrm_app.training.resume import CONFIG, continued, trained

RUN_FILES = (CONFIG, "plan.json", "metrics.jsonl", "report.md", "tables.json")
RUN_DIRS = ("checkpoints", "evaluations", "plots")


def prepare_run_dir(config: TrainConfig, rank: int) -> TrainConfig:
    """Check ``config.out`` and decide the run's config (``resume.continued``: a continued run's
    is its saved one with the flags on top); on rank 0 clear it (``overwrite``, or a failed
    start's leftovers) and write ``config.json``. Every rank checks before any rank writes, so
    all ranks agree."""
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a directory for the run")
    if (out / "dataset.json").is_file():
        raise ValueError(f"--out {out} is a dataset (it holds dataset.json): checkpoints and logs "
                         "would land among its shards; pass another directory for the run")
    leftovers = any((out / name).exists() for name in RUN_FILES + RUN_DIRS)
    existing = leftovers and trained(out)
    config = continued(config, existing, rank)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        if leftovers and (config.overwrite or not existing):  # a failed start's too
            for name in RUN_FILES:
                (out / name).unlink(missing_ok=True)
            for name in RUN_DIRS:
                shutil.rmtree(out / name, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        config.save(out / CONFIG)
    if dist.is_initialized():
        dist.barrier()
    return config
