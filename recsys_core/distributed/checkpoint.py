"""Save and load a sharded model (and its optimizer) with ``torch.distributed.checkpoint``.

Tables are ShardedTensors in the model's state dict, so a checkpoint written with one plan or
world size loads into another: DCP reads whatever slices each rank now owns.

    save(path, model=dmp, optimizer=combined_optimizer)
    load(path, model=dmp2, optimizer=combined_optimizer2)   # any plan, any world size

DCP's ``flatten_sharded_tensors`` (for 2-D FSDP + tensor-parallel nesting) is turned off: it
drops a table that has no shard on a rank, which DCP then reads as a checkpoint in its pre-2.4
format and fails to load.
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException


class CheckpointLoadError(ValueError):
    """DCP could not read a checkpoint (names it and the first rank's error). DCP itself raises
    a ``BaseException``, which ``except Exception`` would not catch."""


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but non-tensor items (``extra``) are unpickled with
    ``weights_only=True``: plain containers, numbers, strings and tensors, never arbitrary
    objects. (DCP's ``.metadata`` is still a pickle: a checkpoint directory is trusted input.)"""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def checkpoint_state(
    model: nn.Module, optimizer: Any | None, extra: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The dict DCP writes or fills in place (model and optimizer state are views)."""
    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        with _param_groups_saved(optimizer):
            state["optimizer"] = optimizer.state_dict()
    if extra:
        state["extra"] = dict(extra)
    return state


@contextlib.contextmanager
def _param_groups_saved(optimizer: Any) -> Iterator[None]:
    """A checkpoint keeps the learning rates and the fused optimizers' step (Adam's bias
    correction): a KeyedOptimizer's ``param_groups`` are saved and loaded here whatever its
    ``save_param_groups`` says (TorchRec's default, off, is what a raw ``state_dict()`` gives)."""
    toggle = getattr(optimizer, "save_param_groups", None)
    before = getattr(optimizer, "defaults", {}).get("_save_param_groups")
    if not callable(toggle) or before is None:
        yield
        return
    toggle(True)
    try:
        yield
    finally:
        toggle(before)


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Without a process group DCP warns on every call that it assumes a single process,
    which is exactly what a 1-rank run means; keep that out of the user's log."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def staged_state(
    model: nn.Module, optimizer: Any | None = None, extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What :func:`save` would write, copied: every tensor (each ShardedTensor's local shards
    too) cloned, so that training may go on changing the model while :func:`save_state`
    writes the copy (from another thread, on a process group of its own). Costs a copy of
    this rank's tables and optimizer state in memory."""
    return _cloned(checkpoint_state(model, optimizer, extra))


def _cloned(value: Any) -> Any:
    if isinstance(value, ShardedTensor):
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in value.local_shards()]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ShardedTensor's deprecation notice
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, value.metadata(), process_group=value._process_group)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cloned(v) for v in value)
    return copy.deepcopy(value)


def save(
    checkpoint_id: str,
    *,
    model: nn.Module,
    optimizer: Any | None = None,
    extra: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Write ``model`` (and ``optimizer``, a KeyedOptimizer) to the directory ``checkpoint_id``.

    ``extra`` holds small picklable values (step counters, config) saved alongside.
    """
    save_state(checkpoint_id, checkpoint_state(model, optimizer, extra), process_group)


def save_state(checkpoint_id: str, state: dict[str, Any],
               process_group: dist.ProcessGroup | None = None) -> None:
    """Write a state built by :func:`staged_state` (or :func:`save`'s own) to ``checkpoint_id``;
    collective over ``process_group`` (default: the default group).

    DCP reports any failure as a ``CheckpointException`` (a ``BaseException``, which an
    application's error handling does not catch): a Ctrl-C during the write is raised here as
    ``KeyboardInterrupt``, any other failure as the failing rank's own exception (a full disk:
    its ``OSError``), the ``CheckpointException`` chained."""
    try:
        _run_dcp(dcp.save, state, checkpoint_id, process_group,
                 DefaultSavePlanner(flatten_sharded_tensors=False))
    except CheckpointException as exc:
        _, error = _failure(exc, process_group)
        raise error from exc


def _run_dcp(operation: Callable[..., Any], state: dict[str, Any], checkpoint_id: str,
             process_group: dist.ProcessGroup | None, planner: Any) -> None:
    """``operation`` (``dcp.save`` or ``dcp.load``) of ``state`` at ``checkpoint_id`` with
    ``planner``, without DCP's one-process warnings."""
    with _quiet_single_process():
        operation(state, checkpoint_id=checkpoint_id, process_group=process_group, planner=planner)


def _failure(
    exc: CheckpointException, process_group: dist.ProcessGroup | None
) -> tuple[int, BaseException]:
    """The failure DCP wrapped in ``exc``: a Ctrl-C on any rank is raised as
    ``KeyboardInterrupt``; else ``(rank, error)`` of this rank's (in ``process_group``) failure
    if it has one (another rank's error comes back as a RuntimeError naming it), else the
    first rank's."""
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    errors = [error for error, _ in exc.failures.values()]
    if any(isinstance(e, KeyboardInterrupt) for e in errors):
        raise KeyboardInterrupt from exc
    if rank in exc.failures:
        return rank, exc.failures[rank][0]
    failed_rank, (error, _) = next(iter(exc.failures.items()))
    return failed_rank, RuntimeError(
        f"rank {failed_rank} failed: {type(error).__name__}: {str(error)[:300]}")


def load(
    checkpoint_id: str,
    *,
    model: nn.Module,
    optimizer: Any | None = None,
    extra: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``) in place.

    ``extra`` gives the keys (with default values) to read back; returns the loaded extras
    (unpickled with ``weights_only=True``: numbers, strings, containers and tensors only).
    """
    state = checkpoint_state(model, optimizer, extra)
    try:
        _run_dcp(dcp.load, state, checkpoint_id, process_group,
                 _WeightsOnlyLoadPlanner(flatten_sharded_tensors=False))
    except CheckpointException as exc:
        rank, error = _failure(exc, process_group)
        first_line = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise CheckpointLoadError(
            f"cannot load checkpoint {checkpoint_id} (rank {rank}): {type(error).__name__}: "
            f"{first_line}"
        ) from error
    model.load_state_dict(state["model"])
    if optimizer is not None:
        with _param_groups_saved(optimizer):
            optimizer.load_state_dict(state["optimizer"])
    return dict(state.get("extra", {}))
