"""TorchRec's view of the search space: :class:`ShardingOption` (one layout of one table, with
per-shard :class:`Shard` estimates) and :class:`EmbeddingEnumerator`, which lists every layout
this planner considers, with its estimates, for inspection.

The planner searches the same candidates internally (``types.Candidate``, numpy arrays per
shard); these are their TorchRec-shaped copies. Storage is in bytes per shard and tier (a cache at
``cache_params.load_factor`` when the constraints fix one, else TorchRec's default 0.2, in HBM
on CUDA and host memory on CPU; a cached table's rows in host memory on CUDA and on disk, ``ssd``,
on CPU);
``Perf`` splits each shard's estimated ms per step by phase and sums to the planner's cost.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from recsys_core.modules.embedding_collection import EmbeddingCollection
from recsys_core.modules.embedding_configs import DataType
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.plan.params import BoundsCheckMode, CacheParams, KeyValueParams
from recsys_core.plan.sharder import Sharder
from recsys_core.plan.types import EmbeddingComputeKernel, ShardingType
from recsys_core.planner.constraints import ParameterConstraints
from recsys_core.planner.enumerators import enumerate_options
from recsys_core.planner.estimators import DEFAULT_CACHE_LOAD_FACTOR, estimate_option
from recsys_core.planner.plan_builder import collections_of
from recsys_core.planner.storage import Perf, Shard, Storage
from recsys_core.planner.table_specs import table_specs
from recsys_core.planner.topology import Topology
from recsys_core.planner.types import Candidate, Placement

DEFAULT_BATCH_SIZE = 512  # TorchRec's BATCH_SIZE
_PARTITION_BY = {Placement.ANY_RANKS: "device", Placement.ANY_HOST: "host",
                 Placement.ALL_RANKS: "uniform"}
_TORCH_DTYPE = {DataType.FP32: torch.float32, DataType.FP16: torch.float16,
                DataType.BF16: torch.bfloat16}


class ShardingOption:
    """One way to shard one table (TorchRec's attributes; strings for the enum values)."""

    def __init__(
        self,
        name: str,
        tensor: torch.Tensor,
        module: tuple[str, nn.Module],
        input_lengths: list[float],
        batch_size: int,
        sharding_type: str,
        partition_by: str,
        compute_kernel: str,
        shards: list[Shard],
        cache_params: CacheParams | None = None,
        enforce_hbm: bool | None = None,
        stochastic_rounding: bool | None = None,
        bounds_check_mode: BoundsCheckMode | None = None,
        dependency: str | None = None,
        is_pooled: bool | None = None,
        feature_names: list[str] | None = None,
        output_dtype: DataType | None = None,
        key_value_params: KeyValueParams | None = None,
        num_poolings: list[float] | None = None,
    ) -> None:
        self.name = name
        self._tensor = tensor
        self._module = module
        self.input_lengths = input_lengths
        self.batch_size = batch_size
        self.sharding_type = sharding_type
        self.partition_by = partition_by
        self.compute_kernel = compute_kernel
        self.shards = shards
        self.cache_params = cache_params
        self.enforce_hbm = enforce_hbm
        self.stochastic_rounding = stochastic_rounding
        self.bounds_check_mode = bounds_check_mode
        self.dependency = dependency
        self._is_pooled = (
            bool(is_pooled) if is_pooled is not None else ShardingOption.module_pooled(module[1], name)
        )
        self.is_weighted: bool | None = None
        self.feature_names = feature_names
        self.output_dtype = output_dtype
        self.key_value_params = key_value_params
        self.num_poolings = num_poolings
        child = module[1]
        self._module_type_key = f"{type(child).__module__}.{type(child).__name__}"
        processors = getattr(getattr(child, "_feature_processor", None),
                             "feature_processor_modules", None)
        self._has_feature_processor = isinstance(processors, nn.ModuleDict) and name in processors
        if isinstance(child, EmbeddingBagCollection):
            self.is_weighted = child.is_weighted()

    @staticmethod
    def module_pooled(module: nn.Module, sharding_option_name: str) -> bool:
        """False where the table belongs to an EmbeddingCollection (one output row per id)."""
        if isinstance(module, EmbeddingCollection):
            return False
        for sub in module.modules():
            if isinstance(sub, EmbeddingCollection):
                if any(sharding_option_name in n for n, _ in sub.named_parameters()):
                    return False
        return True

    module_type_key = property(lambda self: self._module_type_key)
    has_feature_processor = property(lambda self: self._has_feature_processor)

    def storage_hash(self) -> int:
        """Identifies this option in a stored plan: fqn, sharding type, kernel, cache load
        factor and shard count (a 56-bit BLAKE2b digest, as TorchRec's)."""
        key = (f"{self.fqn}|{self.sharding_type}|{self.compute_kernel}|"
               f"{self.cache_load_factor}|{self.num_shards}")
        return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=7).digest(), "big")

    def __deepcopy__(self, memo: dict[int, object] | None) -> ShardingOption:
        # The tensor and module are shared, everything else copied.
        result = self.__class__.__new__(self.__class__)
        for key, value in self.__dict__.items():
            setattr(result, key, value if key in ("_tensor", "_module") else copy.deepcopy(value, memo))
        return result

    tensor = property(lambda self: self._tensor)
    module = property(lambda self: self._module)
    path = property(lambda self: self._module[0])
    is_pooled = property(lambda self: self._is_pooled)

    @property
    def fqn(self) -> str:
        return f"{self.path}.{self.name}"

    @property
    def cache_load_factor(self) -> float | None:
        return None if self.cache_params is None else self.cache_params.load_factor

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def num_inputs(self) -> int:
        return len(self.input_lengths)

    @property
    def total_storage(self) -> Storage:
        total = Storage(0, 0, 0)
        for shard in self.shards:
            total += shard.storage or Storage(0, 0, 0)
        return total

    @property
    def total_perf(self) -> float:
        return sum(s.perf.total for s in self.shards if s.perf is not None)

    def get_shards_assignment(self) -> list[int | None]:
        return [s.rank for s in self.shards]

    def __hash__(self) -> int:
        return hash((self.fqn, self.sharding_type, self.compute_kernel, tuple(self.shards),
                     self.cache_params))

    def __str__(self) -> str:
        lines = [f"name: {self.name}", f"sharding type: {self.sharding_type}",
                 f"compute kernel: {self.compute_kernel}", f"num shards: {len(self.shards)}"]
        return "\n".join(lines + [f"\t{s}" for s in self.shards])


class EmbeddingEnumerator:
    """Every layout the planner considers for each table, as TorchRec's ShardingOptions.

    The layouts are this planner's (``enumerators.py``). Estimates come from ``estimator``
    (one ShardEstimator or a list; default: this library's ``EmbeddingPerfEstimator`` then
    TorchRec's storage rule, ``EmbeddingStorageEstimator``); :meth:`populate_estimates`
    re-runs them on changed options (a proposer that changes a kernel or load factor).
    ``last_stored_search_space`` holds the last ``enumerate`` result (for context hashes).
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int = DEFAULT_BATCH_SIZE,
        constraints: Mapping[str, ParameterConstraints] | None = None,
        estimator: Any = None,
        use_exact_enumerate_order: bool | None = False,
    ) -> None:
        from recsys_core.planner.shard_estimators import (
            EmbeddingPerfEstimator,
            EmbeddingStorageEstimator,
        )

        self._topology = topology
        self._batch_size = batch_size
        self._constraints = dict(constraints or {})
        if estimator is None:
            estimator = [EmbeddingPerfEstimator(topology, self._constraints),
                         EmbeddingStorageEstimator(topology, self._constraints)]
        self._estimators = list(estimator) if isinstance(estimator, list | tuple) else [estimator]
        self._use_exact_enumerate_order = bool(use_exact_enumerate_order)
        self._sharder_map: dict[str, Any] = {}
        self.last_stored_search_space: list[ShardingOption] | None = None

    def enumerate(self, module: nn.Module, sharders: Sequence[Sharder]) -> list[ShardingOption]:
        from recsys_core.planner.utils import sharder_name

        collections = collections_of(module, sharders)
        self._sharder_map = {sharder_name(s.module_type): s for s in sharders}
        options = []
        for spec in table_specs(collections, self._constraints, self._batch_size, self._topology):
            sub = collections[spec.path][0]
            sharder = collections[spec.path][1]
            self._sharder_map[sharder_name(type(sub))] = sharder
            for candidate in enumerate_options(spec, sharder, self._topology, with_perf=True):
                options.append(self._option(candidate, spec.path, sub))
        self.populate_estimates(options)
        self.last_stored_search_space = options
        return options

    def populate_estimates(self, sharding_options: list[ShardingOption]) -> None:
        """Runs every estimator on ``sharding_options`` (in place)."""
        from recsys_core.planner.utils import build_sharder_data_map

        data = build_sharder_data_map(self._sharder_map)
        for estimator in self._estimators:
            estimator.estimate(sharding_options, data)

    def _option(self, c: Candidate, path: str, sub: nn.Module) -> ShardingOption:
        spec, config, constraints = c.table, c.table.config, c.table.constraints
        features = constraints.feature_names or list(config.feature_names)
        lf = c.load_factor if c.load_factor is not None else DEFAULT_CACHE_LOAD_FACTOR
        cache = constraints.cache_params
        if c.is_caching:
            cache = CacheParams(load_factor=lf) if cache is None else cache
        rows, cols = c.shard_rows.tolist(), c.shard_cols.tolist()
        row_split = c.sharding_type.value in ("row_wise", "table_row_wise")
        col_split = c.sharding_type.value in ("column_wise", "table_column_wise")
        shards = [
            Shard(size=[rows[i], cols[i]],
                  offset=[sum(rows[:i]) if row_split else 0, sum(cols[:i]) if col_split else 0])
            for i in range(c.num_shards)
        ]
        option = ShardingOption(
            name=config.name,
            tensor=torch.empty(config.num_embeddings, config.embedding_dim, device="meta",
                               dtype=_TORCH_DTYPE.get(config.data_type, torch.uint8)),
            module=(path, sub),
            input_lengths=_per_feature(constraints.pooling_factors, len(features)),
            batch_size=self._batch_size,
            sharding_type=c.sharding_type.value,
            partition_by=_PARTITION_BY[c.placement],
            compute_kernel=c.compute_kernel.value,
            shards=shards,
            cache_params=cache,
            enforce_hbm=constraints.enforce_hbm,
            stochastic_rounding=constraints.stochastic_rounding,
            bounds_check_mode=constraints.bounds_check_mode,
            is_pooled=spec.pooled,
            feature_names=list(features),
            output_dtype=constraints.output_dtype,
            num_poolings=None if constraints.num_poolings is None
            else _per_feature(constraints.num_poolings, len(features)),
        )
        option._table_spec = spec  # what this library's perf model needs (estimate_perf)
        option._placement = c.placement
        return option


def estimate_perf(so: ShardingOption, topology: Topology) -> None:
    """Sets each shard's ``perf`` of an option listed by :class:`EmbeddingEnumerator` with
    this planner's cost model, at the option's current kernel and cache load factor (a
    FUSED_UVM_CACHING option's expected misses included). Options of other enumerators are
    left as they are."""
    spec = getattr(so, "_table_spec", None)
    if spec is None:
        return
    c = estimate_option(
        spec, ShardingType(so.sharding_type), EmbeddingComputeKernel(so.compute_kernel),
        so._placement, np.array([s.size[0] for s in so.shards]),
        np.array([s.size[1] for s in so.shards]), topology, with_perf=True,
    )
    lf = so.cache_load_factor if so.cache_load_factor is not None else DEFAULT_CACHE_LOAD_FACTOR
    for i, shard in enumerate(so.shards):
        miss = (1.0 - lf) * float(c.miss_cost[i]) if c.is_caching else 0.0
        miss_fwd = (1.0 - lf) * float(c.miss_fwd[i]) if c.is_caching else 0.0
        fwd_compute, fwd_comms, bwd_compute, bwd_comms = (float(v) for v in c.perf[:, i])
        shard.perf = Perf(fwd_compute=fwd_compute + miss_fwd, fwd_comms=fwd_comms,
                          bwd_compute=bwd_compute + miss - miss_fwd, bwd_comms=bwd_comms)


def _per_feature(values: Sequence[float], count: int) -> list[float]:
    return [float(values[0])] * count if len(values) == 1 else [float(v) for v in values]
