"""Plumbing shared by the keyed optimizers: name-keyed param groups, in-place loads, and the
optional TorchRec 1.9 hooks that wrappers pass on to the optimizers they hold."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from copy import deepcopy
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor


class StateShapeMismatchError(ValueError, RuntimeError):
    """A state tensor in a state_dict does not have the shape of the optimizer's own.

    A ValueError (ours) and a RuntimeError (what ``Tensor.copy_`` raises in TorchRec)."""


def init_optimizer_attributes(optimizer: torch.optim.Optimizer) -> None:
    """The attributes ``torch.optim.Optimizer.__init__`` sets, without its parameter checks
    (a rank that holds no embedding shard has an empty parameter list)."""
    torch._C._log_api_usage_once(f"recsys_core.optim.{type(optimizer).__name__}")
    for hooks in (
        "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
        "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
        "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
    ):
        setattr(optimizer, hooks, OrderedDict())
    optimizer._patch_step_function()


def inner_scratch_buffers(optimizers: Iterable[torch.optim.Optimizer]) -> tuple[torch.Tensor, ...]:
    """The scratch buffers of ``optimizers``, in order (``scratch_buffers()``, TorchRec 1.9);
    an optimizer without the method has none."""
    return tuple(
        buffer for opt in optimizers if hasattr(opt, "scratch_buffers")
        for buffer in opt.scratch_buffers()
    )


def set_inner_optimizer_step(optimizers: Iterable[torch.optim.Optimizer], step: int) -> None:
    """``set_optimizer_step(step)`` on each of ``optimizers`` that has it."""
    for opt in optimizers:
        if hasattr(opt, "set_optimizer_step"):
            opt.set_optimizer_step(step)


def update_inner_hyper_parameters(
    optimizers: Iterable[torch.optim.Optimizer], params_dict: dict[str, Any]
) -> None:
    """``update_hyper_parameters(params_dict)`` on each of ``optimizers`` that has it."""
    for opt in optimizers:
        if hasattr(opt, "update_hyper_parameters"):
            opt.update_hyper_parameters(params_dict)


def state_content(value: dict[str, Any]) -> dict[str, Any]:
    """A param's state with nested dicts recursed and stateful objects replaced by their
    ``state_dict()``; tensors are the optimizer's own (not copies)."""
    out: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(item, dict):
            out[key] = state_content(item)
        elif callable(getattr(item, "state_dict", None)):
            out[key] = item.state_dict()
        else:
            out[key] = item
    return out


def param_name_map(params: Mapping[str, Any]) -> dict[int, str]:
    return {id(p): name for name, p in params.items()}


def named_param_groups(
    param_groups: Collection[Mapping[str, Any]], params: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Groups with ``params`` as sorted names and the other entries deep-copied."""
    names = param_name_map(params)
    out = []
    for group in param_groups:
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(
                f"a param group holds tensors of shapes {missing} that are not in params; "
                "name every grouped tensor in params"
            )
        named: dict[str, Any] = {"params": sorted(names[id(p)] for p in group["params"])}
        named.update({k: deepcopy(v) for k, v in group.items() if k != "params"})
        out.append(named)
    return out


def _copy_into(current: torch.Tensor, new: Any, path: list[Any]) -> None:
    if not isinstance(new, torch.Tensor):
        raise ValueError(
            f"optimizer state {json.dumps(path)}: expected a tensor in the state_dict, got "
            f"{type(new).__name__}"
        )
    if current.shape != new.shape:
        raise StateShapeMismatchError(
            f"optimizer state {json.dumps(path)}: shape {tuple(new.shape)} in the state_dict, "
            f"{tuple(current.shape)} here; it was saved from a parameter of another shape"
        )
    with torch.no_grad():
        current.detach().copy_(new)


def _copy_sharded(current: ShardedTensor, new: Any, path: list[Any]) -> None:
    if not isinstance(new, ShardedTensor):
        raise ValueError(
            f"optimizer state {json.dumps(path)}: expected a ShardedTensor in the state_dict, "
            f"got {type(new).__name__}"
        )
    mine, theirs = current.local_shards(), new.local_shards()
    if len(mine) != len(theirs):
        raise ValueError(
            f"Different number of shards {len(mine)} vs {len(theirs)} for the path of "
            f"{json.dumps(path)}; load through torch.distributed.checkpoint to reshard"
        )
    for shard, new_shard in zip(mine, theirs, strict=True):
        if shard.tensor.shape != new_shard.tensor.shape:
            shard.tensor.resize_(new_shard.tensor.shape)  # column-wise shards may differ in size
        with torch.no_grad():
            shard.tensor.detach().copy_(new_shard.tensor)


def load_param_state(current: dict[str, Any], new: Mapping[str, Any], path: list[Any]) -> None:
    """Copy ``new`` into ``current`` key by key: tensors in place, stateful objects through
    their ``load_state_dict``, everything else deep-copied."""
    for key, value in current.items():
        if key not in new:
            raise ValueError(
                f"optimizer state {json.dumps(path)} has no entry {key!r} in the state_dict "
                f"(it has {sorted(map(str, new))}); it was saved by a different optimizer"
            )
        new_value = new[key]
        sub_path = [*path, key]
        if isinstance(value, dict):
            load_param_state(value, new_value, sub_path)
        elif callable(getattr(value, "load_state_dict", None)):
            value.load_state_dict(new_value)
        elif isinstance(value, ShardedTensor):
            _copy_sharded(value, new_value, sub_path)
        elif isinstance(value, DTensor):
            local = new_value.to_local() if isinstance(new_value, DTensor) else new_value
            _copy_into(value.to_local(), local, sub_path)
        elif isinstance(value, torch.Tensor):
            _copy_into(value, new_value, sub_path)
        else:
            current[key] = deepcopy(new_value)


def load_param_groups(
    param_groups: Collection[Any], new_groups: Collection[Mapping[str, Any]],
    params: Mapping[str, Any],
) -> None:
    """Match groups by their sorted parameter names and copy their other entries."""
    if len(param_groups) != len(new_groups):
        raise ValueError(
            f"Different param_groups count: {len(param_groups)} vs {len(new_groups)}; the "
            "state_dict was saved with other param groups (or call save_param_groups(False) to "
            "keep the current ones)"
        )
    names = param_name_map(params)
    mine = {"/".join(sorted(names[id(p)] for p in g["params"])): g for g in param_groups}
    theirs = {"/".join(sorted(g["params"])): g for g in new_groups}
    for key, group in mine.items():
        if key not in theirs:
            raise ValueError(f"Group {key} not found in the state_dict (it has {sorted(theirs)})")
        new_group = theirs[key]
        if len(group) != len(new_group):
            raise ValueError(
                f"Different param_group size: {len(group)} vs {len(new_group)} for group {key} "
                f"(here {sorted(group)}, in the state_dict {sorted(new_group)})"
            )
        for entry in group:
            if entry not in new_group:
                raise ValueError(f"Group key {entry} not found for group {key}")
            if entry != "params":
                group[entry] = deepcopy(new_group[entry])


def route_key(key: str, members: list[tuple[str, Mapping[str, Any]]]) -> tuple[int, str]:
    """(member index, member-local name) of a CombinedOptimizer state-dict key.

    ``members`` are ``(prefix, params)`` pairs. The longest matching prefix wins; among members
    with the same prefix, the one whose ``params`` holds the name.
    """
    best: list[int] = []
    best_len = -1
    for index, (prefix, _) in enumerate(members):
        if prefix and key != prefix and not key.startswith(prefix + "."):
            continue
        if len(prefix) > best_len:
            best, best_len = [index], len(prefix)
        elif len(prefix) == best_len:
            best.append(index)
    if not best:
        raise ValueError(
            f"Parameter {key} of the state_dict belongs to none of the optimizers (prefixes "
            f"{[p for p, _ in members]}); it was saved from a different model"
        )
    prefix = members[best[0]][0]
    name = key if not prefix else ("" if key == prefix else key[len(prefix) + 1:])
    if len(best) > 1:
        named = [i for i in best if name in members[i][1]]
        if len(named) != 1:
            raise ValueError(
                f"Parameter {key} of the state_dict matches {len(named)} of the optimizers "
                f"with prefix {prefix!r}; give them distinct prefixes"
            )
        best = named
    return best[0], name
