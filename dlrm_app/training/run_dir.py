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
import sys
from pathlib import Path

import torch.distributed as dist

from dlrm_app.config import TrainConfig, resume_config

CONFIG = "config.json"
RUN_FILES = (CONFIG, "plan.json", "metrics.jsonl", "report.md")
RUN_DIRS = ("checkpoints", "evaluations", "plots")


def trained(out: Path) -> bool:
    """A checkpoint saved or a training step logged in ``out``."""
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return True
    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        return False
    with open(metrics, encoding="utf-8", errors="replace") as f:
        return any('"event": "train"' in line for line in f)


def same_run(saved: TrainConfig, config: TrainConfig) -> bool:
    """``config`` is the saved run's config again (``--resume`` / ``--overwrite`` aside)."""
    def plain(c: TrainConfig) -> dict:
        d = c.to_json_dict()
        d.pop("resume", None), d.pop("overwrite", None)
        return d
    return plain(saved) == plain(config)


def prepare_run_dir(config: TrainConfig, rank: int) -> TrainConfig:
    """Check ``config.out`` against ``config.resume`` / ``config.overwrite``; on rank 0 clear it
    (``overwrite``) and write ``config.json``. Every rank checks before any rank writes, so all
    ranks agree. With ``resume`` the saved config must agree with ``config`` on what a resumed
    run cannot change (``FIXED_ON_RESUME``)."""
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a directory for the run")
    if (out / "dataset.json").is_file():
        raise ValueError(f"--out {out} is a dataset (it holds dataset.json): checkpoints and logs "
                         "would land among its shards; pass another directory for the run")
    leftovers = any((out / name).exists() for name in RUN_FILES + RUN_DIRS)
    existing = leftovers and trained(out)
    saved_path = out / CONFIG
    again = (existing and saved_path.is_file() and not (config.resume or config.overwrite)
             and same_run(TrainConfig.load(saved_path), config))
    if again and rank == 0:
        print(f"--out {out} holds a run of this same config: continuing it from its newest "
              "checkpoint (--overwrite starts over)", file=sys.stderr)
    if (config.resume or again) and saved_path.is_file() and existing:
        saved = TrainConfig.load(saved_path)
        given = {k: v for k, v in config.to_json_dict().items() if k not in ("resume", "overwrite")}
        config = resume_config(saved, given, where=str(saved_path))
    elif existing and not (config.resume or config.overwrite):
        raise ValueError(f"--out {out} already holds a training run of another config; pass "
                         f"--resume to continue it (with the flags given here on top), --overwrite to start over (deletes its checkpoints and logs), or "
                         f"another --out")
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        if leftovers and (config.overwrite or not existing):  # a failed start's too
            for name in RUN_FILES:
                (out / name).unlink(missing_ok=True)
            for name in RUN_DIRS:
                shutil.rmtree(out / name, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        config.save(saved_path)
    if dist.is_initialized():
        dist.barrier()
    return config
