"""TorchRec's shard perf formulas (its ``EmbeddingPerfEstimator``), for TorchRec-style planner
components: what a custom proposer or partitioner written against TorchRec reads in
``Shard.perf``. This library's own search keeps its calibrated model (``search/cost.py``).

Per shard of ``hash_size x emb_dim``, with ``B = sum(batch x pooling factor x poolings)`` ids and
``O`` output rows (pooled: ``sum(batch x poolings x min(1, pooling factor))``; sequence: ``B``)
per rank, ``W`` ranks, ``bw`` the kernel's read bandwidth (``constants.kernel_bw_lookup``) and
element sizes in bytes (ids 8, table, comms):

    fwd_compute = (ids read + rows looked up + rows written) x block penalty / bw
    bwd_compute = fwd_compute x bwd multiplier (x weighted multiplier, + 1.1 x fwd if weighted)
    fwd/bwd_comms: the output over the collective of the sharding type

========  =============================  ===========================  ======================
type      ids read / rows looked up      fwd comms                    bwd comms
========  =============================  ===========================  ======================
TW, CW    B W x 8 / B W x max(32, d)     all-to-all of O W d          all-to-all of O W d
RW        B x 8 / B d (each rank 1/W)    reduce-scatter of O W d      all-gather + 2.455 x copy
TWRW      B W / g x 8 / B W / g x d      RS in the group + A2A        A2A + AG + copy
DP        B x 8 / B d                    0                            all-reduce + 9.22 x table
========  =============================  ===========================  ======================

(``d`` the shard's columns, ``g`` the group size ``intra_group_size``; table-wise and
column-wise also take the FBGEMM block penalty 1.15 below 128 columns, 1.75 below 64.) A cached
table with :class:`CacheStatistics` adds ``prefetch_compute``: expected misses x row bytes /
the HBM<->DDR bandwidth. Bandwidths a Topology was not given are TorchRec's constants.

Differences from TorchRec: a data-parallel all-reduce counts at least one host (TorchRec's
estimate turns negative when ``local_world_size > world_size``); this library's CPU
FUSED_UVM_CACHING reads its RAM cache at the DDR bandwidth (TorchRec has no such kernel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from recsys_core.modules.embedding_configs import DATA_TYPE_NUM_BITS
from recsys_core.planner.comms import CollectiveType, GeneralizedCommsBandwidth
from recsys_core.planner.constants import (
    BATCHED_COPY_PERF_FACTOR,
    BIGINT_DTYPE,
    BWD_COMPUTE_MULTIPLIER,
    DP_ELEMENTWISE_KERNELS_PERF_FACTOR,
    FULL_BLOCK_EMB_DIM,
    HALF_BLOCK_PENALTY,
    QUARTER_BLOCK_PENALTY,
    WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER,
    WEIGHTED_KERNEL_MULTIPLIER,
    kernel_bw_lookup,
)
from recsys_core.planner.interfaces import SharderData
from recsys_core.planner.sharding_option import ShardingOption
from recsys_core.planner.storage import Perf
from recsys_core.planner.topology import Topology
from recsys_core.planner.utils import (
    extract_comm_data_type_size,
    get_num_poolings,
    is_prefetch_pipelined,
)


@dataclass(frozen=True)
class PerfCoefficient:
    """Weights of the byte counts in a compute estimate (TorchRec's defaults: 1, 1, 1, 0)."""

    input_read_size_multiplier: float = 1.0
    lookup_size_multiplier: float = 1.0
    embedding_output_multiplier: float = 1.0
    hash_size_multiplier: float = 0.0


@dataclass(frozen=True)
class EstimatorPerfCoefficients:
    """Forward coefficients, and backward ones (None: backward = forward x multiplier)."""

    fwd: PerfCoefficient = field(default_factory=PerfCoefficient)
    bwd: PerfCoefficient | None = None


class HardwarePerfConfig:
    """TorchRec's per-hardware knobs: bandwidth overrides (``device_bw``,
    ``kernel_device_bandwidths[(device, kernel)]``, ``hbm_to_ddr_mem_bw``), coefficients per
    sharding type (``coefficients_by_type``), multipliers. Subclass to describe a machine and
    register it with ``EmbeddingPerfEstimatorFactory.register(name)``."""

    name = "default"
    device_bw: float | None = None
    hbm_to_ddr_mem_bw: float | None = None
    kernel_device_bandwidths: dict[tuple[str, str], float] = {}  # noqa: RUF012 (read-only)
    coefficients_by_type: dict[str, EstimatorPerfCoefficients] = {}  # noqa: RUF012
    bwd_compute_multiplier: float | None = None
    weighted_feature_bwd_compute_multiplier: float | None = None
    weighted_kernel_multiplier: float = WEIGHTED_KERNEL_MULTIPLIER

    def coefficients_for(self, sharding_type: str) -> EstimatorPerfCoefficients:
        kind = "column_wise" if sharding_type == "table_column_wise" else (
            "table_row_wise" if sharding_type == "grid_shard" else sharding_type)
        return self.coefficients_by_type.get(kind, EstimatorPerfCoefficients())

    def get_device_bw(self, topology: Topology, compute_kernel: str,
                      caching_ratio: float | None = None,
                      prefetch_pipeline: bool = False) -> float:
        device = topology.compute_device
        kernel = compute_kernel
        if prefetch_pipeline and device == "cuda" and kernel == "fused_uvm_caching":
            kernel = "fused"
        if (device, kernel) in self.kernel_device_bandwidths:
            return self.kernel_device_bandwidths[(device, kernel)]
        if self.device_bw is not None:
            return self.device_bw
        if device == "cpu" and kernel == "fused_uvm_caching":
            # this library's CPU cache (TorchRec has none): hits read RAM; the disk behind it
            # is not modelled here
            return topology.torchrec_bw("ddr_mem_bw")
        bw = kernel_bw_lookup(device, compute_kernel, topology.torchrec_bw("hbm_mem_bw"),
                              topology.torchrec_bw("ddr_mem_bw"), float(topology.hbm_to_ddr_mem_bw),
                              caching_ratio, prefetch_pipeline, float(topology.ssd_mem_bw))
        if bw is None:
            raise ValueError(f"Unrecognized or unsupported compute kernel: {compute_kernel} on "
                             f"{device} for the perf estimator")
        return bw


@dataclass
class ShardPerfContext:
    """Everything one shard's perf depends on (TorchRec's field names)."""

    sharding_type: str
    compute_kernel: str
    hash_size: int
    emb_dim: int
    batch_sizes: list[float]
    num_poolings: list[float]
    input_lengths: list[float]
    world_size: int
    local_world_size: int
    intra_group_size: int
    table_data_type_size: float
    fwd_a2a_comm_data_type_size: float
    bwd_a2a_comm_data_type_size: float
    fwd_sr_comm_data_type_size: float
    bwd_sr_comm_data_type_size: float
    device_bw: float
    hbm_to_ddr_mem_bw: float
    comms_bandwidths: GeneralizedCommsBandwidth
    is_inference: bool = False
    is_weighted: bool = False
    is_pooled: bool = True
    bwd_compute_multiplier: float = BWD_COMPUTE_MULTIPLIER
    weighted_feature_bwd_compute_multiplier: float = WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER
    input_data_type_size: float = BIGINT_DTYPE
    caching_ratio: float | None = None
    cache_stats_expected_lookups: float | None = None
    expected_miss_rate: float | None = None

    @property
    def batch_inputs(self) -> float:
        return sum(x * y * z for x, y, z in zip(self.input_lengths, self.num_poolings,
                                                self.batch_sizes, strict=False))

    @property
    def batch_outputs(self) -> float:
        if not self.is_pooled:
            return self.batch_inputs
        return sum(min(1.0, x) * y * z for x, y, z in zip(self.input_lengths, self.num_poolings,
                                                          self.batch_sizes, strict=False))

    @property
    def num_twrw_groups(self) -> int:
        return max(1, self.world_size // self.intra_group_size)


def shard_contexts(so: ShardingOption, topology: Topology, constraints: dict | None,
                   sharder_data: SharderData, config: HardwarePerfConfig,
                   is_inference: bool = False) -> list[ShardPerfContext]:
    """One :class:`ShardPerfContext` per shard of ``so``."""
    caching_ratio = so.cache_load_factor
    if caching_ratio is None:
        caching_ratio = sharder_data.fused_params.get("cache_load_factor")
    fwd_a2a, bwd_a2a, fwd_sr, bwd_sr = extract_comm_data_type_size(so, sharder_data)
    num_poolings = get_num_poolings(constraints, so)
    given = (constraints or {}).get(so.name)
    batch_sizes = (list(given.batch_sizes) if given is not None and given.batch_sizes
                   else [so.batch_size] * so.num_inputs)
    if not len(so.input_lengths) == len(num_poolings) == len(batch_sizes):
        raise ValueError(
            f"table {so.name!r}: pooling_factors ({len(so.input_lengths)}), num_poolings "
            f"({len(num_poolings)}) and batch_sizes ({len(batch_sizes)}) constraints must have "
            "one value per feature each")
    weighted = so.is_weighted if so.is_weighted is not None else bool(
        given is not None and given.is_weighted)
    weighted = weighted or so.has_feature_processor
    stats = so.cache_params.stats if so.cache_params is not None else None
    lookups = miss = None
    if caching_ratio is not None and stats is not None and so.compute_kernel == "fused_uvm_caching":
        lookups, miss = stats.expected_lookups, stats.expected_miss_rate(caching_ratio)
    device_bw = config.get_device_bw(topology, so.compute_kernel, caching_ratio,
                                     is_prefetch_pipelined(so, sharder_data))
    hbm_to_ddr = config.hbm_to_ddr_mem_bw or float(topology.hbm_to_ddr_mem_bw)
    return [
        ShardPerfContext(
            sharding_type=so.sharding_type, compute_kernel=so.compute_kernel,
            hash_size=shard.size[0], emb_dim=shard.size[1], batch_sizes=batch_sizes,
            num_poolings=num_poolings, input_lengths=list(so.input_lengths),
            world_size=topology.world_size, local_world_size=int(topology.local_world_size or 1),
            intra_group_size=topology.intra_group_size,
            table_data_type_size=so.tensor.element_size(),
            fwd_a2a_comm_data_type_size=fwd_a2a, bwd_a2a_comm_data_type_size=bwd_a2a,
            fwd_sr_comm_data_type_size=fwd_sr, bwd_sr_comm_data_type_size=bwd_sr,
            device_bw=device_bw, hbm_to_ddr_mem_bw=hbm_to_ddr,
            comms_bandwidths=topology.torchrec_comms_bandwidths, is_inference=is_inference,
            is_weighted=weighted, is_pooled=so.is_pooled,
            bwd_compute_multiplier=topology.bwd_compute_multiplier,
            weighted_feature_bwd_compute_multiplier=topology.weighted_feature_bwd_compute_multiplier,
            caching_ratio=caching_ratio, cache_stats_expected_lookups=lookups,
            expected_miss_rate=miss,
        )
        for shard in so.shards
    ]


def compute_block_usage_penalty(embedding_dim: int) -> float:
    """FBGEMM's cost of partly filled thread blocks: 1.75 below 64 columns, 1.15 below 128."""
    if embedding_dim < FULL_BLOCK_EMB_DIM:
        return HALF_BLOCK_PENALTY if embedding_dim >= 64 else QUARTER_BLOCK_PENALTY
    return 1.0


def _output_dtype_size(so: ShardingOption) -> float:
    return DATA_TYPE_NUM_BITS[so.output_dtype] / 8 if so.output_dtype else so.tensor.element_size()


class _Evaluator:
    """Table-wise / column-wise rules; the other sharding types override pieces."""

    min_dim = True  # lookups cost at least 32 columns (kernel efficiency)
    block_penalty = True

    def divisor(self, ctx: ShardPerfContext) -> int:
        return 1

    def input_read(self, ctx: ShardPerfContext) -> float:
        size = math.ceil(ctx.batch_inputs / self.divisor(ctx) * ctx.world_size
                         * ctx.input_data_type_size)
        return size * 2 if ctx.is_weighted else size

    def lookup(self, ctx: ShardPerfContext, use_min_dim: bool) -> float:
        dim = max(ctx.emb_dim, 32) if use_min_dim else ctx.emb_dim
        return ctx.batch_inputs / self.divisor(ctx) * ctx.world_size * dim * ctx.table_data_type_size

    def output(self, ctx: ShardPerfContext, dtype_size: float) -> float:
        return ctx.batch_outputs * ctx.world_size * ctx.emb_dim * dtype_size

    def comm_size(self, ctx: ShardPerfContext, fwd: bool) -> float:
        return ctx.fwd_a2a_comm_data_type_size if fwd else ctx.bwd_a2a_comm_data_type_size

    def fwd_compute(self, ctx: ShardPerfContext, config: HardwarePerfConfig) -> float:
        c = config.coefficients_for(ctx.sharding_type).fwd
        penalty = compute_block_usage_penalty(ctx.emb_dim) if self.block_penalty else 1.0
        size = (c.input_read_size_multiplier * self.input_read(ctx)
                + c.lookup_size_multiplier * self.lookup(ctx, self.min_dim)
                + c.embedding_output_multiplier * self.output(ctx, self.comm_size(ctx, True))
                + c.hash_size_multiplier * ctx.hash_size)
        return size * penalty / ctx.device_bw

    def bwd_compute(self, ctx: ShardPerfContext, config: HardwarePerfConfig) -> float:
        fwd = self.fwd_compute(ctx, config)
        c = config.coefficients_for(ctx.sharding_type).bwd
        if c is not None:
            bwd = (c.input_read_size_multiplier * self.input_read(ctx)
                   + c.lookup_size_multiplier * self.lookup(ctx, False)
                   + c.embedding_output_multiplier * self.output(ctx, self.comm_size(ctx, False))
                   + c.hash_size_multiplier * ctx.hash_size) / ctx.device_bw
        else:
            multiplier = config.bwd_compute_multiplier
            bwd = fwd * (ctx.bwd_compute_multiplier if multiplier is None else multiplier)
        if not ctx.is_weighted:
            return bwd
        weighted = config.weighted_feature_bwd_compute_multiplier
        weighted = ctx.weighted_feature_bwd_compute_multiplier if weighted is None else weighted
        return bwd * weighted + fwd * config.weighted_kernel_multiplier

    def comms(self, ctx: ShardPerfContext, size: float, kind: CollectiveType,
              world: int | None = None, local: int | None = None) -> float:
        bw = ctx.comms_bandwidths.get_bw(
            local_world_size=ctx.local_world_size if local is None else local,
            world_size=ctx.world_size if world is None else world, collective_type=kind)
        return size / bw

    def copy(self, ctx: ShardPerfContext, size: float) -> float:
        return size * BATCHED_COPY_PERF_FACTOR / ctx.device_bw

    def fwd_comms(self, ctx: ShardPerfContext) -> float:
        return self.comms(ctx, self.output(ctx, self.comm_size(ctx, True)), CollectiveType.ALL_TO_ALL)

    def bwd_comms(self, ctx: ShardPerfContext) -> float:
        return self.comms(ctx, self.output(ctx, self.comm_size(ctx, False)),
                          CollectiveType.ALL_TO_ALL)

    def prefetch_divisor(self, ctx: ShardPerfContext) -> int:
        return 1

    def prefetch(self, ctx: ShardPerfContext) -> float:
        fetches = 0.0
        if (ctx.caching_ratio is not None and ctx.cache_stats_expected_lookups is not None
                and ctx.expected_miss_rate is not None
                and ctx.compute_kernel == "fused_uvm_caching"):
            fetches = ctx.expected_miss_rate * ctx.cache_stats_expected_lookups
        fetches /= self.prefetch_divisor(ctx)
        size = fetches * ctx.emb_dim * ctx.table_data_type_size
        return size / ctx.hbm_to_ddr_mem_bw if ctx.hbm_to_ddr_mem_bw > 0 else 0.0

    def input_dist(self, ctx: ShardPerfContext) -> float:
        size = math.ceil(ctx.batch_inputs * ctx.world_size * ctx.input_data_type_size)
        return self.comms(ctx, size, CollectiveType.ALL_TO_ALL)

    def perf(self, ctx: ShardPerfContext, config: HardwarePerfConfig) -> Perf:
        train = not ctx.is_inference
        return Perf(
            fwd_compute=self.fwd_compute(ctx, config), fwd_comms=self.fwd_comms(ctx),
            bwd_compute=self.bwd_compute(ctx, config) if train else 0.0,
            bwd_comms=self.bwd_comms(ctx) if train else 0.0,
            prefetch_compute=self.prefetch(ctx), input_dist_comms=self.input_dist(ctx))


class _RowWise(_Evaluator):
    min_dim = False
    block_penalty = False

    def divisor(self, ctx: ShardPerfContext) -> int:
        return ctx.world_size

    def output(self, ctx: ShardPerfContext, dtype_size: float) -> float:
        rows = ctx.batch_outputs if ctx.is_pooled else ctx.batch_outputs / self.divisor(ctx)
        return rows * ctx.world_size * ctx.emb_dim * dtype_size

    def comm_size(self, ctx: ShardPerfContext, fwd: bool) -> float:
        if not ctx.is_pooled:
            return super().comm_size(ctx, fwd)
        return ctx.fwd_sr_comm_data_type_size if fwd else ctx.bwd_sr_comm_data_type_size

    def fwd_comms(self, ctx: ShardPerfContext) -> float:
        return self.comms(ctx, self.output(ctx, self.comm_size(ctx, True)),
                          CollectiveType.REDUCE_SCATTER)

    def bwd_comms(self, ctx: ShardPerfContext) -> float:
        size = self.output(ctx, self.comm_size(ctx, False))
        return self.comms(ctx, size, CollectiveType.ALL_GATHER) + self.copy(ctx, size)

    def prefetch_divisor(self, ctx: ShardPerfContext) -> int:
        return ctx.world_size


class _TableRowWise(_RowWise):
    def divisor(self, ctx: ShardPerfContext) -> int:
        return ctx.intra_group_size

    def comm_size(self, ctx: ShardPerfContext, fwd: bool) -> float:
        return ctx.fwd_sr_comm_data_type_size if fwd else ctx.bwd_sr_comm_data_type_size

    def _groups(self, ctx: ShardPerfContext, fwd: bool) -> float:
        groups = ctx.num_twrw_groups
        if groups <= 1:
            return 0.0
        size = ctx.fwd_a2a_comm_data_type_size if fwd else ctx.bwd_a2a_comm_data_type_size
        return self.comms(ctx, ctx.batch_outputs * groups * ctx.emb_dim * size,
                          CollectiveType.ALL_TO_ALL, world=groups, local=1)

    def fwd_comms(self, ctx: ShardPerfContext) -> float:
        size = self.output(ctx, self.comm_size(ctx, True))
        local = min(ctx.intra_group_size, ctx.local_world_size)
        return self.comms(ctx, size, CollectiveType.REDUCE_SCATTER, ctx.intra_group_size,
                          local) + self._groups(ctx, True)

    def bwd_comms(self, ctx: ShardPerfContext) -> float:
        size = self.output(ctx, self.comm_size(ctx, False))
        local = min(ctx.intra_group_size, ctx.local_world_size)
        return (self._groups(ctx, False) + self.comms(
            ctx, size, CollectiveType.ALL_GATHER, ctx.intra_group_size, local)
            + self.copy(ctx, size))


class _DataParallel(_Evaluator):
    min_dim = False
    block_penalty = False

    def input_read(self, ctx: ShardPerfContext) -> float:
        size = math.ceil(ctx.batch_inputs * ctx.input_data_type_size)
        return size * 2 if ctx.is_weighted else size

    def lookup(self, ctx: ShardPerfContext, use_min_dim: bool) -> float:
        return ctx.batch_inputs * ctx.emb_dim * ctx.table_data_type_size

    def output(self, ctx: ShardPerfContext, dtype_size: float) -> float:
        return ctx.batch_outputs * ctx.emb_dim * ctx.table_data_type_size

    def fwd_comms(self, ctx: ShardPerfContext) -> float:
        return 0.0

    def bwd_comms(self, ctx: ShardPerfContext) -> float:
        table = ctx.hash_size * ctx.emb_dim * ctx.table_data_type_size
        # TorchRec's min(W / local, 2) goes below 1 (and the estimate negative) when the
        # topology's local_world_size exceeds its world size: one host then, as it is
        nodes = min(max(ctx.world_size / ctx.local_world_size, 1.0), 2)
        bw = ctx.comms_bandwidths.get_bw(local_world_size=ctx.local_world_size,
                                         world_size=ctx.world_size,
                                         collective_type=CollectiveType.ALL_REDUCE)
        all_reduce = table * (2 * nodes - 1) / nodes / bw if bw > 0 else 0.0
        if ctx.world_size > 2 * ctx.local_world_size:
            all_reduce *= 2
        return all_reduce + table * DP_ELEMENTWISE_KERNELS_PERF_FACTOR / ctx.device_bw

    def prefetch(self, ctx: ShardPerfContext) -> float:
        return 0.0

    def input_dist(self, ctx: ShardPerfContext) -> float:
        return 0.0


EVALUATORS: dict[str, _Evaluator] = {
    "table_wise": _Evaluator(), "column_wise": _Evaluator(), "table_column_wise": _Evaluator(),
    "row_wise": _RowWise(), "table_row_wise": _TableRowWise(), "grid_shard": _TableRowWise(),
    "data_parallel": _DataParallel(),
}


def shard_perfs(so: ShardingOption, topology: Topology, constraints: dict | None,
                sharder_data: SharderData, config: HardwarePerfConfig,
                is_inference: bool = False) -> list[Perf]:
    """TorchRec's perf of each shard of ``so`` (see the module docstring)."""
    evaluator = EVALUATORS.get(so.sharding_type, EVALUATORS["table_wise"])
    return [evaluator.perf(ctx, config) for ctx in shard_contexts(
        so, topology, constraints, sharder_data, config, is_inference)]
