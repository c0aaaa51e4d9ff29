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

import numpy as np
import torch
from torch import nn

from recsys_core.modules.embedding_collection import EmbeddingCollection
from recsys_core.modules.embedding_configs import DATA_TYPE_BITS, DataType, EmbeddingBagConfig
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.plan.params import BoundsCheckMode, CacheParams, KeyValueParams
from recsys_core.plan.types import EmbeddingComputeKernel, ShardingType
from recsys_core.planner.constraints import ParameterConstraints
from recsys_core.planner.search.cost import (
    DEFAULT_CACHE_LOAD_FACTOR,
    DEFAULT_OPTIMIZER,
    estimate_option,
)
from recsys_core.planner.search.types import Placement, TableSpec
from recsys_core.planner.storage import Perf, Shard, Storage
from recsys_core.planner.topology import Topology

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
        stash_weights: bool = False,
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
        # TorchRec 1.9: the table config's stash_weights hint (memory stashing, which this
        # library does not do); data only, no estimate reads it (nor does TorchRec's).
        self.stash_weights = stash_weights
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


def estimate_perf(so: ShardingOption, topology: Topology,
                  constraints: Mapping[str, ParameterConstraints] | None = None) -> None:
    """Sets each shard's ``perf`` with this planner's cost model (``search/cost.py``), at the
    option's current kernel and cache load factor (a FUSED_UVM_CACHING option's expected misses
    included), split into TorchRec's phases.

    The table is read from the option: its weight's shape and dtype, ``input_lengths`` (pooling
    factors), ``num_poolings`` and per-feature ``batch_sizes`` from ``constraints``, the
    default optimizer's state. Kernels the model does not have are costed as the one with the
    same memory: HBM-resident ones (dense, quant, ...) as fused, UVM ones as fused_uvm, cached
    and key-value ones as fused_uvm_caching."""
    spec = _table_spec_of(so, constraints)
    placement = _PLACEMENT.get(so.partition_by, Placement.ANY_HOST)
    c = estimate_option(
        spec, ShardingType(so.sharding_type), _model_kernel(so.compute_kernel),
        placement, np.array([s.size[0] for s in so.shards]),
        np.array([s.size[1] for s in so.shards]), topology, with_perf=True,
    )
    lf = so.cache_load_factor if so.cache_load_factor is not None else DEFAULT_CACHE_LOAD_FACTOR
    for i, shard in enumerate(so.shards):
        miss = (1.0 - lf) * float(c.miss_cost[i]) if c.is_caching else 0.0
        miss_fwd = (1.0 - lf) * float(c.miss_fwd[i]) if c.is_caching else 0.0
        fwd_compute, fwd_comms, bwd_compute, bwd_comms = (float(v) for v in c.perf[:, i])
        shard.perf = Perf(fwd_compute=fwd_compute + miss_fwd, fwd_comms=fwd_comms,
                          bwd_compute=bwd_compute + miss - miss_fwd, bwd_comms=bwd_comms)


_PLACEMENT = {"device": Placement.ANY_RANKS, "host": Placement.ANY_HOST,
              "uniform": Placement.ALL_RANKS, "multi_host": Placement.ANY_HOST}
_DATA_TYPE = {torch.float32: DataType.FP32, torch.float16: DataType.FP16,
              torch.bfloat16: DataType.BF16, torch.uint8: DataType.INT8,
              torch.int8: DataType.INT8}


def _model_kernel(kernel: str) -> EmbeddingComputeKernel:
    if kernel in ("fused_uvm", "quant_uvm"):
        return EmbeddingComputeKernel.FUSED_UVM
    if "caching" in kernel or "key_value" in kernel or "virtual" in kernel:
        return EmbeddingComputeKernel.FUSED_UVM_CACHING
    return EmbeddingComputeKernel.FUSED


def _table_spec_of(so: ShardingOption,
                   constraints: Mapping[str, ParameterConstraints] | None) -> TableSpec:
    spec = getattr(so, "_table_spec", None)
    if spec is not None:
        return spec
    given = (constraints or {}).get(so.name)
    n = max(1, len(so.input_lengths))
    rows, cols = so.tensor.shape
    config = EmbeddingBagConfig(
        name=so.name, num_embeddings=int(rows), embedding_dim=int(cols),
        feature_names=list(so.feature_names or [f"{so.name}_f{i}" for i in range(n)]),
        data_type=_DATA_TYPE.get(so.tensor.dtype, DataType.FP32))
    lengths = [float(v) for v in so.input_lengths] or [1.0]
    poolings = list(so.num_poolings or (given.num_poolings if given is not None and
                                        given.num_poolings else [1.0] * n))
    batches = list(given.batch_sizes) if given is not None and given.batch_sizes \
        else [so.batch_size] * n
    poolings = _per_feature(poolings, n)
    batches = _per_feature(batches, n)
    bags = [b * p for b, p in zip(batches, poolings, strict=False)]
    return TableSpec(
        path=so.path, config=config, pooled=so.is_pooled, optimizer=DEFAULT_OPTIMIZER,
        constraints=ParameterConstraints(), is_weighted=bool(so.is_weighted),
        ids_per_batch=sum(b * v for b, v in zip(bags, lengths, strict=False)),
        bags_per_batch=sum(bags),
        output_bytes=DATA_TYPE_BITS[so.output_dtype or DataType.FP32] / 8,
    )


def _per_feature(values: Sequence[float], count: int) -> list[float]:
    return [float(values[0])] * count if len(values) == 1 else [float(v) for v in values]
