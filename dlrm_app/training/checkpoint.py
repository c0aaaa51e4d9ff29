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

Integrity: before the rename, every file of the checkpoint is hashed (sha256, the ranks share
the files) into ``checksums.json``. Every load verifies sizes and checksums first, so damaged
bytes are never unpickled, and fails naming the file (:class:`CheckpointError`); ``--resume``
falls back to the newest intact checkpoint and says so. Pointer files must name a ``step_N``
directory of this run. Loading still unpickles DCP's ``.metadata`` (the extras are read with
``weights_only=True``): a run directory is trusted input, as any PyTorch checkpoint is.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from dlrm_app.data.schema import sha256_file
from dlrm_app.inputs import check_run
from dlrm_app.training.config import TrainConfig
from recsys_core.distributed import checkpoint as dcp_checkpoint

LATEST = "latest"
BEST = "best"
PARTIAL = ".partial"
MANIFEST = "checksums.json"
_STEP_NAME = re.compile(r"step_\d{8}")


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete or named wrongly (the message names the file)."""


SHARDED_TENSOR_NOTICE = "Please use DTensor instead and we are deprecating ShardedTensor."
"""torch's FutureWarning on every ShardedTensor operation; DCP performs such operations on the
sharded tables of a checkpoint (TorchRec's checkpoint format), once per rank and call site."""


@contextlib.contextmanager
def _without_sharded_tensor_notice() -> Iterator[None]:
    """Hide exactly that notice, only around our DCP calls: it asks nothing of a user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(SHARDED_TENSOR_NOTICE),
                                category=FutureWarning)
        yield


def _barrier(group: Any = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _pointed(root: Path, pointer: str) -> Path | None:
    """The complete checkpoint a pointer file names, or None. The name must be a ``step_N``
    directory inside ``root``: a pointer is never followed out of the run."""
    file = root / pointer
    if not file.is_file():
        return None
    name = file.read_text(errors="replace").strip()
    if not _STEP_NAME.fullmatch(name) or (root / name).is_symlink():
        raise CheckpointError(
            f"{file} names {name[:80]!r}, not a step_NNNNNNNN checkpoint directory of this run; "
            f"delete {file} (the newest checkpoint is then found without it)"
        )
    path = root / name
    return path if (path / ".metadata").is_file() else None


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
    state = dcp_checkpoint.checkpoint_state(model, optimizer, extra)
    return write_checkpoint(checkpoint_dir, step, state, keep=keep, best=best)


def write_checkpoint(checkpoint_dir: str | Path, step: int, state: dict[str, Any], *,
                     keep: int = 2, best: bool = False, group: Any = None) -> Path:
    """:func:`save_checkpoint` of a state already built (``dcp_checkpoint.staged_state``), its
    collectives on ``group`` (default: the default group): what a background save runs."""
    root = Path(checkpoint_dir)
    final = root / step_dir_name(step)
    partial = root / (final.name + PARTIAL)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)  # left by a crash during an earlier save of this step
    _barrier(group)
    with _without_sharded_tensor_notice():
        dcp_checkpoint.save_state(str(partial), state, process_group=group)
    _barrier(group)
    _write_manifest(partial, group)
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        for pointer in (LATEST, BEST) if best else (LATEST,):
            tmp = root / (pointer + ".tmp")
            tmp.write_text(final.name + "\n")
            tmp.replace(root / pointer)
        _prune(root, keep, final)
    _barrier(group)
    return final


WRITER_NICE = 10
"""How much nicer than training the background writer thread runs: on a host whose cores the ranks keep busy it
takes their idle time first (bench/background_checkpoint.py, 2 ranks on 2 cores, 3.2 GB: steps
during a save 1.40x the step time at 10, 2.23x at 0; the save takes about 2x as long)."""


class BackgroundSaver:
    """Checkpoints written while training goes on: :meth:`save` copies the state on the
    training thread (``dcp_checkpoint.staged_state``: a copy of this rank's tables and
    optimizer state, so memory for one more) and a thread writes it, hashes it and renames
    it, its collectives on a gloo process group of its own (made here: collective, every rank
    constructs it together). One save at a time: the next waits for the previous; call
    :meth:`wait` before reading checkpoints (loading the best, resuming, ending). An error of
    the background write is raised by the next :meth:`save` or :meth:`wait`."""

    def __init__(self) -> None:
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, checkpoint_dir: str | Path, step: int, *, model: nn.Module, optimizer: Any,
             extra: Mapping[str, Any], keep: int = 2, best: bool = False) -> None:
        self.wait()
        state = dcp_checkpoint.staged_state(model, optimizer, extra)

        def write() -> None:
            if WRITER_NICE:
                with contextlib.suppress(OSError):  # this thread only (Linux: per thread)
                    me = threading.get_native_id()  # nicer than the thread it came from
                    os.setpriority(os.PRIO_PROCESS, me,
                                   min(os.getpriority(os.PRIO_PROCESS, me) + WRITER_NICE, 19))
            try:
                write_checkpoint(checkpoint_dir, step, state, keep=keep, best=best,
                                 group=self._group)
            except BaseException as exc:  # noqa: BLE001  raised on the training thread
                self._error = exc

        self._thread = threading.Thread(target=write, name="dlrm-checkpoint", daemon=True)
        self._thread.start()

    @property
    def writing(self) -> bool:
        """A save is still being written."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Until the save in progress (if any) is complete; raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST)


def _shared(names: list[str], work: Any, group: Any = None) -> dict[str, Any]:
    """``work(name)`` for every name, the ranks splitting the names; every rank gets all."""
    rank, world = _rank(), dist.get_world_size() if dist.is_initialized() else 1
    mine = {name: work(name) for name in names[rank::world]}
    if world == 1:
        return mine
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine, group=group)
    return {k: v for part in parts for k, v in part.items()}


def _write_manifest(path: Path, group: Any = None) -> None:
    """Collective: the size and sha256 of every file of the checkpoint in ``path``."""
    names = _files(path) if _rank() == 0 else []
    if dist.is_initialized():
        box = [names]
        dist.broadcast_object_list(box, src=0, group=group)
        names = box[0]
    sums = _shared(names, lambda name: {"bytes": (path / name).stat().st_size,
                                         "sha256": sha256_file(path / name)}, group)
    if _rank() == 0:
        tmp = path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({"format": 1, "files": sums}, indent=1, sort_keys=True))
        tmp.replace(path / MANIFEST)


def verify_checkpoint(path: str | Path) -> None:
    """Collective where a process group exists (the ranks share the hashing). Raise
    :class:`CheckpointError` naming the first missing, resized or altered file of the
    checkpoint ``path``. A checkpoint written before checksums existed loads with a warning."""
    path = Path(path)
    manifest = path / MANIFEST
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no .metadata); pass a "
                              f"step_* directory, or the run to use its newest checkpoint")
    if not manifest.is_file():
        print(f"warning: {path} has no {MANIFEST} (written by an older version): its files "
              f"are not verified", file=sys.stderr)
        return
    try:
        files = json.loads(manifest.read_text())["files"]
        expected = {str(k): (int(v["bytes"]), str(v["sha256"])) for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{manifest} is damaged ({type(exc).__name__}); use an older "
                              f"checkpoint (--checkpoint step_N) or delete {path}") from None

    def problem(name: str) -> str | None:
        file = path / name
        size, sha = expected[name]
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} has {file.stat().st_size} bytes, {size} were written"
        if sha256_file(file) != sha:
            return f"{file} does not match its checksum (the bytes changed after saving)"
        return None

    problems = [p for p in _shared(sorted(expected), problem).values() if p is not None]
    if problems:
        raise CheckpointError(f"damaged checkpoint: {sorted(problems)[0]}"
                              + (f" (and {len(problems) - 1} more file(s))" if len(problems) > 1
                                 else "")
                              + f"; use an older one (--checkpoint step_N) or delete {path}")


def newest_intact_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """Collective where a process group exists. The newest checkpoint that verifies (for
    ``--resume``): damaged ones are skipped, saying so on stderr. None if there is none at
    all; :class:`CheckpointError` if every one is damaged."""
    root = Path(checkpoint_dir)
    candidates = sorted((p for p in root.glob("step_*")
                         if not p.name.endswith(PARTIAL) and (p / ".metadata").is_file()),
                        reverse=True)
    try:
        pointed = _pointed(root, LATEST)
    except CheckpointError as exc:
        pointed = None
        if _rank() == 0:
            print(f"warning: {exc}; ignoring it", file=sys.stderr)
    if pointed is not None and pointed in candidates:
        candidates.remove(pointed)
        candidates.insert(0, pointed)
    damaged: list[str] = []
    for path in candidates:
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            damaged.append(str(exc))
            if _rank() == 0:
                print(f"warning: {exc}; trying an older checkpoint", file=sys.stderr)
            continue
        if damaged and _rank() == 0:
            print(f"resuming from {path} (the newer checkpoint(s) are damaged)", file=sys.stderr)
        return path
    if damaged:
        raise CheckpointError(f"every checkpoint in {root} is damaged ({damaged[0]}); start a "
                              f"new run (--overwrite, or another --out)")
    return None


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
    extra: Mapping[str, Any], verified: bool = False,
) -> dict[str, Any]:
    """Load ``path`` into ``model`` and ``optimizer`` in place; returns the saved extras
    (``extra`` names the keys to read, with template values of the right type). The files are
    verified against ``checksums.json`` first, unless the caller just did (``verified``)."""
    path = Path(path)
    if not verified:
        verify_checkpoint(path)
    with _without_sharded_tensor_notice():
        return dcp_checkpoint.load(str(path), model=model, optimizer=optimizer, extra=extra)


def resolve_run(run: str | Path, checkpoint: str | Path | None = None) -> tuple[TrainConfig, Path]:
    """A training run's config and the checkpoint to use: ``checkpoint`` may be "best" (the
    default: the best validation AUC, or the newest checkpoint where none was recorded as
    best), "latest", or a step_* directory."""
    run = Path(run)
    config_path = check_run(run)
    root = run / "checkpoints"
    choice = str(checkpoint) if checkpoint else BEST
    if choice == BEST:
        path = best_checkpoint(root) or latest_checkpoint(root)
    elif choice == LATEST:
        path = latest_checkpoint(root)
    else:
        path = Path(choice)
        if not path.exists() and (root / choice).exists():
            path = root / choice  # a step_* name of this run
    if path is None or not (path / ".metadata").is_file():
        raise CheckpointError(f"no complete checkpoint in {root} (or at --checkpoint {choice}); "
                         f"train first, or pass --checkpoint best, latest or a step_* directory")
    return TrainConfig.load(config_path), path
