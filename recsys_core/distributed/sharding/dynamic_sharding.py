"""TorchRec's ``torchrec.distributed.sharding.dynamic_sharding`` plan arithmetic: which tables a
new plan moves. (Resharding a live model is not implemented by this library.)"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from recsys_core.distributed.types import EmbeddingModuleShardingPlan


def output_sharding_plan_delta_single(
    old_plan: EmbeddingModuleShardingPlan,
    new_plan: EmbeddingModuleShardingPlan,
    return_data_volume: bool = False,
) -> tuple[float, EmbeddingModuleShardingPlan]:
    """The entries of ``new_plan`` whose ranks differ from ``old_plan``'s, and (with
    ``return_data_volume``) the MiB their shards hold as float32: a moved 1024 x 256 table is
    1 MiB."""
    if set(old_plan) != set(new_plan):
        raise ValueError(
            f"output_sharding_plan_delta_single: the plans cover different tables "
            f"({sorted(old_plan)} vs {sorted(new_plan)}); compare plans of one module"
        )
    diff = EmbeddingModuleShardingPlan({
        name: copy.deepcopy(ps) for name, ps in new_plan.items() if ps.ranks != old_plan[name].ranks
    })
    volume = 0.0
    if return_data_volume:
        for ps in diff.values():
            for shard in ps.shards:
                volume += shard.shard_sizes[0] * shard.shard_sizes[1] * 4 / (1024 * 1024)
    return volume, diff


def output_sharding_plans_delta(
    old_plan: Mapping[str, EmbeddingModuleShardingPlan],
    new_plan: Mapping[str, EmbeddingModuleShardingPlan],
    return_data_volume: bool = False,
) -> dict[str, tuple[float, EmbeddingModuleShardingPlan]]:
    """:func:`output_sharding_plan_delta_single` for every module path of ``old_plan``."""
    missing = [path for path in old_plan if path not in new_plan]
    if missing:
        raise ValueError(f"output_sharding_plans_delta: the new plan lacks modules {missing}")
    return {
        path: output_sharding_plan_delta_single(plan, new_plan[path], return_data_volume)
        for path, plan in old_plan.items()
    }


__all__ = ["output_sharding_plan_delta_single", "output_sharding_plans_delta"]
