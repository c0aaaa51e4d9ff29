"""Atomic training checkpoints on top of ``recsys_core.distributed.checkpoint`` (DCP).

Layout of ``<run>/checkpoints/``::

    step_00000100/          a complete checkpoint (DCP's files, one per rank, + .metadata)
    step_00000200.partial/  a save in progress, or one a crash interrupted (never loaded)
    latest                  "step_00000200": the newest complete checkpoint
    best                    "step_00000100": the checkpoint with the best validation AUC

Every rank writes its shards into ``step_N.partial``; after a barrier rank 0 renames it to
``step_N`` (an atomic directory rename) and then replaces ``latest`` (write + rename). A crash
at any point leaves ``latest`` naming the previous complete checkpoint. With several nodes the
run directory must be on a file system every node sees.

A checkpoint holds the model (sharded tables as ShardedTensors, dense weights), the combined
optimizer (fused table state such as Adagrad accumulators, and the dense optimizer), and
``extra``: step, loader position, RNG state. DCP reshards on load, so a checkpoint written by N
ranks loads on M.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from dlrm_app.config import TrainConfig
from recsys_core.distributed import checkpoint as dcp_checkpoint

LATEST = "latest"
BEST = "best"
PARTIAL = ".partial"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _pointed(root: Path, pointer: str) -> Path | None:
    """The complete checkpoint a pointer file names, or None."""
    file = root / pointer
    if file.is_file():
        path = root / file.read_text().strip()
        if (path / ".metadata").is_file():
            return path
    return None


def best_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The checkpoint recorded as the best (highest validation AUC) so far, or None."""
    return _pointed(Path(checkpoint_dir), BEST)


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``checkpoint_dir``, or None."""
    root = Path(checkpoint_dir)
    path = _pointed(root, LATEST)
    if path is not None:
        return path
    # no pointer (or a stale one): the highest complete step directory
    complete = sorted(p for p in root.glob("step_*")
                      if not p.name.endswith(PARTIAL) and (p / ".metadata").is_file())
    return complete[-1] if complete else None


def save_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: Any,
    extra: Mapping[str, Any],
    keep: int = 2,
    best: bool = False,
) -> Path:
    """Collective: every rank calls it at the same step. Returns the checkpoint's directory.
    ``best``: also record it as the best checkpoint. Pruning keeps the ``keep`` newest and the
    best one."""
    root = Path(checkpoint_dir)
    final = root / step_dir_name(step)
    partial = root / (final.name + PARTIAL)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)  # left by a crash during an earlier save of this step
    _barrier()
    dcp_checkpoint.save(str(partial), model=model, optimizer=optimizer, extra=extra)
    _barrier()
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        for pointer in (LATEST, BEST) if best else (LATEST,):
            tmp = root / (pointer + ".tmp")
            tmp.write_text(final.name + "\n")
            tmp.replace(root / pointer)
        _prune(root, keep, final)
    _barrier()
    return final


def _prune(root: Path, keep: int, newest: Path) -> None:
    complete = sorted(p for p in root.glob("step_*") if not p.name.endswith(PARTIAL))
    best = best_checkpoint(root)
    for old in complete[:-keep]:
        if old not in (newest, best):
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(f"step_*{PARTIAL}"):
        shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(
    path: str | Path, *, model: nn.Module, optimizer: Any | None,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """Load ``path`` into ``model`` and ``optimizer`` in place; returns the saved extras
    (``extra`` names the keys to read, with template values of the right type)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no .metadata); pass a "
                         f"step_* directory or the run directory to resume from its newest one")
    return dcp_checkpoint.load(str(path), model=model, optimizer=optimizer, extra=extra)


def resolve_run(run: str | Path, checkpoint: str | Path | None = None) -> tuple[TrainConfig, Path]:
    """A training run's config and the checkpoint to use: ``checkpoint`` may be "best" (the
    default: the best validation AUC, or the newest checkpoint where none was recorded as
    best), "latest", or a step_* directory."""
    run = Path(run)
    config_path = run / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{run} is not a run directory (no config.json); pass the --out of "
                         f"`dlrm-app train`")
    root = run / "checkpoints"
    choice = str(checkpoint) if checkpoint else BEST
    if choice == BEST:
        path = best_checkpoint(root) or latest_checkpoint(root)
    elif choice == LATEST:
        path = latest_checkpoint(root)
    else:
        path = Path(choice)
    if path is None or not (path / ".metadata").is_file():
        raise ValueError(f"no complete checkpoint in {root} (or at --checkpoint {choice}); "
                         f"train first, or pass --checkpoint best, latest or a step_* directory")
    return TrainConfig.load(config_path), path
