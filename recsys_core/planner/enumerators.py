"""TorchRec's :class:`EmbeddingEnumerator`: every (sharding type, compute kernel) a table's
sharder offers that its constraints allow, as :class:`ShardingOption` with TorchRec's shard
geometry, then estimated by the given shard estimators.

This is the component TorchRec's pluggable planner loop runs (``pluggable.PluggableSearch``);
this library's own search enumerates its candidates itself (``search/enumerate.py``).

Rules, as TorchRec's:

- Modules are visited from a stack (last child first; ``use_exact_enumerate_order``: a queue,
  ``named_children`` order); a module with a sharder is not descended into.
- Sharding types: the sharder's, minus ``grid_shard`` unless a constraint names it, minus
  row-wise / table-row-wise / grid for feature-processed bag collections; with constraints
  naming types, the intersection (a warning when empty), in the sharder's order (TorchRec's
  comes from a set, so it changes from run to run).
- Kernels: the sharder's for that type intersected with the constraint's (default: every
  kernel but the key-value / virtual-table ones); ``key_value`` only with disk on some rank;
  ``dense`` dropped where ``fused`` is offered.
- Shards: ``plan.shard_sizes.calculate_shard_sizes_and_offsets`` over ``world_size`` and
  ``intra_group_size``; the constraint's ``min_partition`` is the column block width.
- A table with a ``device_group`` other than the topology's device is skipped; a table with
  no option left is a RuntimeError.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from recsys_core.modules.embedding_collection import EmbeddingCollection
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.plan.shard_sizes import calculate_shard_sizes_and_offsets
from recsys_core.plan.types import EmbeddingComputeKernel, ShardingType
from recsys_core.planner.constants import DEFAULT_PERF_ESTIMATOR, POOLING_FACTOR
from recsys_core.planner.constraints import ParameterConstraints
from recsys_core.planner.estimator import EmbeddingPerfEstimatorFactory
from recsys_core.planner.interfaces import Enumerator, PartitionByType, ShardEstimator
from recsys_core.planner.shard_estimators import EmbeddingStorageEstimator
from recsys_core.planner.sharding_option import ShardingOption
from recsys_core.planner.storage import Shard
from recsys_core.planner.topology import Topology
from recsys_core.planner.utils import build_sharder_data_map, sharder_name

logger = logging.getLogger(__name__)

GUARDED_COMPUTE_KERNELS = frozenset(
    k for k in EmbeddingComputeKernel
    if k.value in ("key_value", "ssd_virtual_table", "dram_virtual_table",
                   "dram_ssd_virtual_table")
)
"""Kernels proposed only when a constraint names them."""
GUARDED_SHARDING_TYPES_FOR_FP_MODULES = frozenset({"row_wise", "table_row_wise", "grid_shard"})
"""Sharding types a feature-processed bag collection gets only when a constraint names them."""


class EmbeddingEnumerator(Enumerator):
    """Lists every sharding option of a module's shardable tables (see the module docstring).

    ``estimator``: one ShardEstimator or a list (default: the perf estimator registered as
    ``DEFAULT_PERF_ESTIMATOR``, then :class:`EmbeddingStorageEstimator`).
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int = 512,
        constraints: dict[str, ParameterConstraints] | None = None,
        estimator: ShardEstimator | list[ShardEstimator] | None = None,
        use_exact_enumerate_order: bool | None = False,
    ) -> None:
        self._topology = topology
        self._compute_device = topology.compute_device
        self._world_size = topology.world_size
        self._local_world_size = topology.intra_group_size
        self._batch_size = batch_size
        self._constraints = constraints
        self._sharder_map: dict[str, Any] = {}
        self._sharder_data_map: dict[str, Any] = {}
        self._use_exact_enumerate_order = bool(use_exact_enumerate_order)
        memory = "hbm_cap" if topology.compute_device in ("cuda", "mtia") else "ddr_cap"
        custom = topology.custom_topology_data
        self._device_memory_sizes = (
            custom.get_data(memory) if custom is not None and custom.has_data(memory) else None
        )
        self._has_ssd = any(d.storage.ssd > 0 for d in topology.devices)
        if estimator:
            self._estimators = list(estimator) if isinstance(estimator, list) else [estimator]
        else:
            self._estimators = [
                EmbeddingPerfEstimatorFactory.create(DEFAULT_PERF_ESTIMATOR, topology=topology,
                                                     constraints=constraints),
                EmbeddingStorageEstimator(topology=topology, constraints=constraints),
            ]
        self._last_stored_search_space: list[ShardingOption] | None = None
        self._last_stored_module: nn.Module | None = None
        self._last_stored_sharders: list[Any] | None = None

    @property
    def sharder_map(self) -> dict[str, Any]:
        return self._sharder_map

    @property
    def last_stored_search_space(self) -> list[ShardingOption] | None:
        return self._last_stored_search_space

    def enumerate(self, module: nn.Module, sharders: Sequence[Any]) -> list[ShardingOption]:
        """Every sharding option of ``module``'s tables, estimated (a copy of the last result
        when called again with the same module and sharders)."""
        sharders = list(sharders)
        if self._last_stored_module is module and self._last_stored_sharders == sharders:
            assert self._last_stored_search_space is not None
            return copy.deepcopy(self._last_stored_search_space)
        self._sharder_map = {sharder_name(s.module_type): s for s in sharders}
        self._sharder_data_map = build_sharder_data_map(self._sharder_map)
        options: list[ShardingOption] = []
        queue: list[tuple[str, nn.Module]] = [("", module)]
        while queue:
            path, child = queue.pop(0) if self._use_exact_enumerate_order else queue.pop()
            key = sharder_name(type(child))
            sharder = self._sharder_map.get(key)
            if sharder is None:
                queue.extend((f"{path}.{n}" if path else n, m) for n, m in child.named_children())
                continue
            options.extend(self._table_options(path, child, sharder, key))
        self.populate_estimates(options)
        self._last_stored_module = module
        self._last_stored_sharders = sharders
        self._last_stored_search_space = copy.deepcopy(options)
        return options

    def _table_options(self, path: str, child: nn.Module, sharder: Any,
                       key: str) -> list[ShardingOption]:
        from recsys_core.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection

        is_pooled = ShardingOption.module_pooled(child, path)
        options: list[ShardingOption] = []
        for name, param in sharder.shardable_parameters(child).items():
            c = (self._constraints or {}).get(name)
            if c is not None and c.device_group and c.device_group != self._compute_device:
                continue
            num_buckets = self._get_num_buckets(name, child)
            per_table = []
            for sharding_type in self._filter_sharding_types(
                name, sharder.sharding_types(self._compute_device), key
            ):
                kernels = sharder.compute_kernels(sharding_type, self._compute_device)
                for kernel in self._filter_compute_kernels(name, kernels, sharding_type):
                    sizes, offsets = calculate_shard_sizes_and_offsets(
                        tensor=param, world_size=self._world_size,
                        local_world_size=self._local_world_size, sharding_type=sharding_type,
                        col_wise_shard_dim=None if c is None else c.min_partition,
                        device_memory_sizes=self._device_memory_sizes, num_buckets=num_buckets,
                    )
                    dependency = None
                    if isinstance(child, EmbeddingTower):
                        dependency = path
                    elif isinstance(child, EmbeddingTowerCollection):
                        dependency = f"{path}.tower_{_get_tower_index(name, child)}"
                    per_table.append(ShardingOption(
                        name=name, tensor=param, module=(path, child),
                        input_lengths=list(c.pooling_factors) if c is not None
                        and c.pooling_factors is not None else [POOLING_FACTOR],
                        batch_size=self._batch_size, sharding_type=_value(sharding_type),
                        partition_by=get_partition_by_type(_value(sharding_type)),
                        compute_kernel=_value(kernel),
                        shards=[Shard(size=list(s), offset=list(o))
                                for s, o in zip(sizes, offsets, strict=True)],
                        cache_params=None if c is None else copy.deepcopy(c.cache_params),
                        enforce_hbm=None if c is None else c.enforce_hbm,
                        stochastic_rounding=None if c is None else c.stochastic_rounding,
                        bounds_check_mode=None if c is None else c.bounds_check_mode,
                        dependency=dependency, is_pooled=is_pooled,
                        feature_names=None if c is None else c.feature_names,
                        output_dtype=None if c is None else c.output_dtype,
                        key_value_params=None if c is None else copy.deepcopy(c.key_value_params),
                        stash_weights=_stash_weights(name, child),
                    ))
            if not per_table:
                raise RuntimeError(
                    "No available sharding type and compute kernel combination after applying "
                    f"user provided constraints for {name}. Module: {key}, sharder: "
                    f"{type(sharder).__name__}, compute device: {self._compute_device}. To "
                    "debug, search above for warning logs about no available sharding "
                    f"types/compute kernels for table: {name}"
                )
            options.extend(per_table)
        return options

    def _get_num_buckets(self, parameter: str, module: nn.Module) -> int | None:
        """The table's bucket count when it is a virtual table (whole buckets per shard)."""
        if isinstance(module, EmbeddingBagCollection):
            configs = module.embedding_bag_configs()
        elif isinstance(module, EmbeddingCollection):
            configs = module.embedding_configs()
        else:
            mcc = getattr(module, "_managed_collision_collection", None)
            buckets = getattr(mcc, "table_to_number_buckets", None)
            if not callable(buckets):
                return None
            count = buckets().get(parameter)
            if count is None or count % self._world_size == 0:
                return None
            raise ValueError(
                f"Table '{parameter}' has uneven buckets per rank ({count} buckets across "
                f"{self._world_size} ranks); planning uneven buckets is not supported: give it "
                "a bucket count divisible by the world size"
            )
        for config in configs:
            if config.name == parameter and getattr(config, "use_virtual_table", False):
                return getattr(config, "total_num_buckets", None)
        return None

    def populate_estimates(self, sharding_options: list[ShardingOption]) -> None:
        for estimator in self._estimators:
            estimator.estimate(sharding_options, sharder_data_map=self._sharder_data_map)

    def _filter_sharding_types(self, name: str, allowed_sharding_types: list[str],
                               sharder_key: str = "") -> list[str]:
        allowed = [_value(t) for t in allowed_sharding_types]
        c = (self._constraints or {}).get(name)
        if c is None or not c.sharding_types:
            filtered = [t for t in allowed if t != ShardingType.GRID_SHARD.value]
            if "FeatureProcessedEmbeddingBagCollection" in sharder_key:
                filtered = [t for t in filtered if t not in GUARDED_SHARDING_TYPES_FOR_FP_MODULES]
            return filtered
        constrained = [_value(t) for t in c.sharding_types]
        filtered = [t for t in allowed if t in constrained]  # the sharder's order (TorchRec: a set's)
        if not filtered:
            logger.warning(
                f"No available sharding types after applying user provided constraints for "
                f"{name}. Constrained sharding types: {constrained}, allowed sharding types: "
                f"{allowed}, filtered sharding types: {filtered}. Please check if the "
                "constrained sharding types are too restrictive, if the sharder allows the "
                "sharding types, or if non-strings are passed in."
            )
        return filtered

    def _filter_compute_kernels(self, name: str, allowed_compute_kernels: list[str],
                                sharding_type: str) -> list[str]:
        allowed = [_value(k) for k in allowed_compute_kernels]
        c = (self._constraints or {}).get(name)
        if c is not None and c.compute_kernels:
            constrained = [_value(k) for k in c.compute_kernels]
        else:
            constrained = [k.value for k in EmbeddingComputeKernel
                           if k not in GUARDED_COMPUTE_KERNELS]
        filtered = [k for k in allowed if k in constrained]  # the sharder's order (TorchRec: a set's)
        if not self._has_ssd and "key_value" in filtered:
            filtered.remove("key_value")
        if "dense" in filtered and "fused" in filtered:
            filtered.remove("dense")
        if not filtered:
            logger.warning(
                f"No available compute kernels after applying user provided constraints for "
                f"{name}. Constrained compute kernels: {constrained}, allowed compute kernels: "
                f"{allowed}, filtered compute kernels: {filtered}, sharding type: "
                f"{sharding_type}. Please check if the constrained compute kernels are too "
                "restrictive, if the sharder allows the compute kernels, or if non-strings are "
                "passed in."
            )
        return filtered


def _value(kind: Any) -> str:
    return getattr(kind, "value", kind)


def get_partition_by_type(sharding_type: str) -> str:
    """How a partitioner places shards of ``sharding_type`` (a :class:`PartitionByType`
    value): table-/column-wise on any device, table-row/column-wise on one host, row-wise and
    data-parallel on every rank, grid over several hosts."""
    kind = _value(sharding_type)
    if kind in ("table_wise", "column_wise"):
        return PartitionByType.DEVICE.value
    if kind in ("table_row_wise", "table_column_wise"):
        return PartitionByType.HOST.value
    if kind in ("row_wise", "data_parallel"):
        return PartitionByType.UNIFORM.value
    if kind == "grid_shard":
        return PartitionByType.MULTI_HOST.value
    raise ValueError(f"Unrecognized or unsupported sharding type provided: {sharding_type}")


def _get_tower_index(name: str, child_module: nn.Module) -> int:
    for i, tower in enumerate(child_module.towers):
        for n, m in tower.named_modules():
            if isinstance(m, nn.Embedding | nn.EmbeddingBag) and n.split(".")[-1] == name:
                return i
    raise RuntimeError(
        f"couldn't get the tower index for table {name}, tower collection: {child_module}")


def _stash_weights(parameter: str, module: nn.Module) -> bool:
    """TorchRec 1.9: the ``stash_weights`` flag of the table's config (of the inner collection
    of a feature-processed one, or from a ``tables()`` accessor), False when none is found."""
    inner = getattr(module, "_embedding_bag_collection", None)
    if isinstance(inner, EmbeddingBagCollection):
        module = inner
    if isinstance(module, EmbeddingBagCollection):
        configs: list[Any] = list(module.embedding_bag_configs())
    elif isinstance(module, EmbeddingCollection):
        configs = list(module.embedding_configs())
    else:
        tables = getattr(module, "tables", None)
        if not callable(tables):
            return False
        configs = list(tables())
    return any(
        bool(getattr(config, "stash_weights", False))
        for config in configs if config.name == parameter
    )
