"""TorchRec's ``torchrec.distributed.shard``: shard modules in place, without the
``DistributedModelParallel`` wrapper (no DDP around the dense part, no combined optimizer).

    sharded_ebc = shard(ebc, table_row_wise(host_index=0))      # one collection
    model = shard_modules(model, plan=plan)                     # every planned submodule
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from recsys_core.distributed.sharding_plan import (
    ParameterShardingGenerator,
    construct_module_sharding_plan,
    get_executable_default_sharders,
    get_module_to_default_sharders,
)
from recsys_core.distributed.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ShardingEnv,
    ShardingPlan,
)
from recsys_core.planner.planner import plan_for_env


def _default_env(env: ShardingEnv | None) -> ShardingEnv:
    if env is not None:
        return env
    if not dist.is_initialized():
        raise ValueError(
            "shard: no ShardingEnv and no process group; initialize torch.distributed or pass "
            "env=ShardingEnv.from_local(1, 0) for one process"
        )
    return ShardingEnv.from_process_group(dist.GroupMember.WORLD)


def _default_device(device: torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def shard(
    module: nn.Module,
    plan: EmbeddingModuleShardingPlan
    | Mapping[str, ParameterShardingGenerator]
    | ParameterShardingGenerator,
    env: ShardingEnv | None = None,
    device: torch.device | None = None,
    sharder: ModuleSharder[nn.Module] | None = None,
) -> nn.Module:
    """The sharded form of ``module`` (an embedding collection). ``plan``: its module plan, or
    a generator per table, or one generator for every table; ``sharder`` defaults to the
    module type's default sharder."""
    env, device = _default_env(env), _default_device(device)
    if sharder is None:
        sharder = get_module_to_default_sharders().get(type(module))
        if sharder is None:
            raise ValueError(
                f"shard: no default sharder for {type(module).__name__}; pass sharder="
            )
    if callable(plan) and not isinstance(plan, Mapping):
        generators = {name: plan for name in sharder.shardable_parameters(module)}
        plan = construct_module_sharding_plan(
            module, generators, sharder, None, env.world_size, device.type)  # type: ignore[arg-type]
    elif plan and all(callable(g) for g in plan.values()):
        plan = construct_module_sharding_plan(
            module, plan, sharder, None, env.world_size, device.type)  # type: ignore[arg-type]
    return sharder.shard(module, EmbeddingModuleShardingPlan(plan), env, device)  # type: ignore[arg-type]


def shard_modules(
    module: nn.Module,
    env: ShardingEnv | None = None,
    device: torch.device | None = None,
    plan: ShardingPlan | None = None,
    sharders: Sequence[ModuleSharder[nn.Module]] | None = None,
    init_params: bool = False,
) -> nn.Module:
    """Replace every submodule that ``plan`` names (default: the planner's plan for ``env``) by
    its sharded form; returns the sharded module itself when the top module is planned."""
    return _shard_modules(module, env, device, plan, sharders, init_params)


def _shard_modules(
    module: nn.Module,
    env: ShardingEnv | None = None,
    device: torch.device | None = None,
    plan: ShardingPlan | None = None,
    sharders: Sequence[ModuleSharder[nn.Module]] | None = None,
    init_params: bool | None = False,
) -> nn.Module:
    env, device = _default_env(env), _default_device(device)
    sharders = list(sharders) if sharders is not None else get_executable_default_sharders()
    by_type = {s.module_type: s for s in sharders}
    if plan is None:
        plan = plan_for_env(module, env, sharders, device)
    if type(module) in by_type and plan.get_plan_for_module("") is not None:
        return by_type[type(module)].shard(module, plan.plan[""], env, device)

    def replace(parent: nn.Module, path: str) -> None:
        for name, child in parent.named_children():
            child_path = f"{path}.{name}" if path else name
            module_plan = plan.get_plan_for_module(child_path)
            if type(child) in by_type and module_plan is not None:
                setattr(parent, name, by_type[type(child)].shard(child, module_plan, env, device))
            else:
                replace(child, child_path)

    replace(module, "")
    if init_params:
        for sub in module.modules():
            if any(p.is_meta for p in sub.parameters(recurse=False)):
                sub.to_empty(device=device, recurse=False)
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
    return module


__all__ = ["shard", "shard_modules"]
