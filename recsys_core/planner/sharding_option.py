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

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from recsys_core.modules.embedding_configs import DataType
from recsys_core.plan.params import BoundsCheckMode, CacheParams, KeyValueParams
from recsys_core.plan.sharder import Sharder
from recsys_core.planner.constraints import ParameterConstraints
from recsys_core.planner.enumerators import enumerate_options
from recsys_core.planner.estimators import DEFAULT_CACHE_LOAD_FACTOR
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
        self._is_pooled = bool(is_pooled) if is_pooled is not None else True
        self.feature_names = feature_names
        self.output_dtype = output_dtype
        self.key_value_params = key_value_params
        self.num_poolings = num_poolings

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
    """Every layout the planner considers for each table, as TorchRec's ShardingOptions."""

    def __init__(
        self,
        topology: Topology,
        batch_size: int = DEFAULT_BATCH_SIZE,
        constraints: Mapping[str, ParameterConstraints] | None = None,
    ) -> None:
        self._topology = topology
        self._batch_size = batch_size
        self._constraints = dict(constraints or {})

    def enumerate(self, module: nn.Module, sharders: Sequence[Sharder]) -> list[ShardingOption]:
        collections = collections_of(module, sharders)
        options = []
        for spec in table_specs(collections, self._constraints, self._batch_size, self._topology):
            sub = collections[spec.path][0]
            sharder = collections[spec.path][1]
            for candidate in enumerate_options(spec, sharder, self._topology, with_perf=True):
                options.append(self._option(candidate, spec.path, sub))
        return options

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
        memory = c.memory(lf)  # [tier, shard], the cache (if caching) at lf
        shards = []
        for i in range(c.num_shards):
            miss = (1.0 - lf) * float(c.miss_cost[i]) if c.is_caching else 0.0
            miss_fwd = (1.0 - lf) * float(c.miss_fwd[i]) if c.is_caching else 0.0
            fwd_compute, fwd_comms, bwd_compute, bwd_comms = (float(v) for v in c.perf[:, i])
            hbm, ddr, ssd = (round(float(v)) for v in memory[:, i])
            shards.append(Shard(
                size=[rows[i], cols[i]],
                offset=[sum(rows[:i]) if row_split else 0, sum(cols[:i]) if col_split else 0],
                storage=Storage(hbm, ddr, ssd),
                perf=Perf(fwd_compute=fwd_compute + miss_fwd, fwd_comms=fwd_comms,
                          bwd_compute=bwd_compute + miss - miss_fwd, bwd_comms=bwd_comms),
            ))
        return ShardingOption(
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


def _per_feature(values: Sequence[float], count: int) -> list[float]:
    return [float(values[0])] * count if len(values) == 1 else [float(v) for v in values]
