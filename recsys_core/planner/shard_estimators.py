"""TorchRec's shard estimators over :class:`ShardingOption` (its pluggable planner path).

:class:`EmbeddingStorageEstimator` sizes each shard by TorchRec's rule. For a shard of
``rows x cols`` of a ``R x C`` table, ``B`` samples per rank per feature, pooling factor
``L`` and ``W`` ranks, with ``T = ceil(table bytes * rows * cols / (R * C))``:

    tensor      T (+ optimizer state: T x the multiplier of the optimizer class attached to
                the weight, 0 when none is: the fused optimizer's state is NOT counted)
    input       ids received: ``ceil(sum(B * L * poolings) * W * 8 / k)`` with k = W for
                row-wise (every rank sends each shard its share), local ranks for
                table-row-wise, 1 otherwise
    output      rows sent: ``ceil(bags * W * cols * out bytes)`` (pooled: a bag per sample
                and feature, ``min(1, L)``; sequence: one per id); data-parallel: the rank's own
    cache       FUSED_UVM_CACHING: ``round(table bytes * load factor)`` of HBM (scaled as T),
                plus ``ceil(rows * (4 + 16 * load factor))`` of cache bookkeeping

    HBM (cuda/mtia) = tensor (or cache) + input + output; DDR (cpu) = tensor + input +
    output; UVM kernels keep the tensor in DDR.

Worked example (the figures our own planner gives differ; see ``search/cost.py``): a 10,000 x
64 fp32 table split row-wise over 2 CUDA ranks, batch 512, pooling 1, no optimizer class:
each shard is 5,000 x 64 -> T = 1,280,000; input = 512 * 8 = 4,096; output = 512 * 2 * 64 * 4
= 262,144: HBM 1,546,240 bytes (1.47 MiB). This library's planner counts, in addition, the
fused optimizer's state (row-wise Adagrad: 4 bytes per row, 20,000), the output gradients
(262,144 again), lengths (8 bytes per bag) and every rank's ids for row-wise shards, hence its
larger figure.

:class:`EmbeddingPerfEstimator` fills in ``Perf`` with this library's calibrated cost model
(``search/cost.py``: bandwidths of the topology, per-row update costs measured on CPU), split
into TorchRec's phases; it is not TorchRec's perf model, whose figures differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from recsys_core.plan.params import CacheStatistics, KeyValueParams
from recsys_core.plan.sharder import storage_usage
from recsys_core.plan.types import ShardingType
from recsys_core.planner.constants import (
    BIGINT_DTYPE,
    KV_CACHING_RATIO,
    UVM_CACHING_RATIO,
)
from recsys_core.planner.interfaces import SharderData, SharderDataMap, ShardEstimator
from recsys_core.planner.sharding_option import ShardingOption, estimate_perf
from recsys_core.planner.storage import Perf, Storage
from recsys_core.planner.topology import Topology
from recsys_core.planner.torchrec_perf import HardwarePerfConfig, shard_perfs
from recsys_core.planner.utils import get_num_poolings, prod

_CACHED_KERNELS = {"fused_uvm_caching", "quant_uvm_caching", "key_value", "ssd_virtual_table",
                   "dram_virtual_table", "dram_ssd_virtual_table"}
_KV_KERNELS = {"key_value", "ssd_virtual_table", "dram_virtual_table", "dram_ssd_virtual_table"}
_DTYPE_BITS = {"FP32": 32, "FP16": 16, "BF16": 16, "INT8": 8, "UINT8": 8, "INT4": 4, "INT2": 2}


def _validate_io_sizes(input_sizes: Sequence[float], output_sizes: Sequence[float],
                       sharding_type: str) -> None:
    """AssertionError naming the first NaN ("NaN detected in input_sizes[i]") or negative
    ("Negative value detected in output_sizes[i]=v") size, as TorchRec's."""
    for what, sizes in (("input_sizes", input_sizes), ("output_sizes", output_sizes)):
        for i, size in enumerate(sizes):
            problem = (f"NaN detected in {what}[{i}]" if math.isnan(size) else
                       f"Negative value detected in {what}[{i}]={size}" if size < 0 else None)
            if problem is not None:
                raise AssertionError(
                    f"[TorchRec Planner] {problem} for sharding_type={sharding_type}. "
                    f"input_sizes={input_sizes}, output_sizes={output_sizes}")


def _validate_perf(perf: Perf, table_name: str, sharding_type: str) -> None:
    """AssertionError naming the first NaN or negative field of ``perf``, in TorchRec's order
    and words."""
    for name in ("fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms", "input_dist_comms",
                 "prefetch_compute"):
        value = getattr(perf, name)
        problem = (f"NaN detected in Perf.{name}" if math.isnan(value) else
                   f"Negative value detected in Perf.{name}={value}" if value < 0 else None)
        if problem is not None:
            raise AssertionError(
                f"[TorchRec Planner] {problem} for table={table_name}, "
                f"sharding_type={sharding_type}. perf={perf}")


def _batch_io(batch_sizes: list[int], input_lengths: list[float], num_poolings: list[float],
              is_pooled: bool) -> tuple[float, float]:
    inputs = sum(x * y * z for x, y, z in zip(input_lengths, num_poolings, batch_sizes, strict=False))
    if not is_pooled:
        return inputs, inputs
    return inputs, sum(min(1.0, il) * x * y
                       for il, x, y in zip(input_lengths, num_poolings, batch_sizes, strict=False))


def _calculate_dp_shard_io_sizes(
    batch_sizes: list[int], input_lengths: list[float], emb_dim: int, num_shards: int,
    input_data_type_size: float, output_data_type_size: float, num_poolings: list[float],
    is_pooled: bool,
) -> tuple[list[int], list[int]]:
    inputs, outputs = _batch_io(batch_sizes, input_lengths, num_poolings, is_pooled)
    return ([math.ceil(inputs * input_data_type_size)] * num_shards,
            [math.ceil(outputs * emb_dim * output_data_type_size)] * num_shards)


def _calculate_tw_shard_io_sizes(
    batch_sizes: list[int], world_size: int, input_lengths: list[float], emb_dim: int,
    input_data_type_size: float, output_data_type_size: float, num_poolings: list[float],
    is_pooled: bool,
) -> tuple[list[int], list[int]]:
    inputs, outputs = _batch_io(batch_sizes, input_lengths, num_poolings, is_pooled)
    return ([math.ceil(inputs * world_size * input_data_type_size)],
            [math.ceil(outputs * world_size * emb_dim * output_data_type_size)])


def _calculate_cw_shard_io_sizes(
    batch_sizes: list[int], world_size: int, input_lengths: list[float],
    shard_sizes: list[list[int]], input_data_type_size: float, output_data_type_size: float,
    num_poolings: list[float], is_pooled: bool,
) -> tuple[list[int], list[int]]:
    inputs, outputs = _batch_io(batch_sizes, input_lengths, num_poolings, is_pooled)
    return ([math.ceil(inputs * world_size * input_data_type_size)] * len(shard_sizes),
            [math.ceil(outputs * world_size * s[1] * output_data_type_size) for s in shard_sizes])


def _split_io(
    inputs: float, outputs: float, world_size: int, shard_sizes: list[list[int]],
    input_data_type_size: float, output_data_type_size: float,
) -> tuple[list[int], list[int]]:
    return (
        [math.ceil(inputs * world_size * input_data_type_size) if prod(s) else 0
         for s in shard_sizes],
        [math.ceil(outputs * world_size * s[1] * output_data_type_size) if prod(s) else 0
         for s in shard_sizes],
    )


def _calculate_rw_shard_io_sizes(
    batch_sizes: list[int], world_size: int, input_lengths: list[float],
    shard_sizes: list[list[int]], input_data_type_size: float, output_data_type_size: float,
    num_poolings: list[float], is_pooled: bool, domain_size: int | None = None,
) -> tuple[list[int], list[int]]:
    """Row-wise shards: each gets its share of the ids, split over the ``domain_size`` ranks
    holding the table's rows (the world for ROW_WISE, one host's ``local_world_size`` for
    TABLE_ROW_WISE)."""
    inputs, outputs = _batch_io(batch_sizes, input_lengths, num_poolings, is_pooled)
    inputs /= domain_size or world_size
    outputs = outputs if is_pooled else inputs
    return _split_io(inputs, outputs, world_size, shard_sizes, input_data_type_size,
                     output_data_type_size)


def _calculate_shard_io_sizes(
    sharding_type: str, batch_sizes: list[int], world_size: int, local_world_size: int,
    input_lengths: list[float], emb_dim: int, shard_sizes: list[list[int]],
    input_data_type_size: float, output_data_type_size: float, num_poolings: list[float],
    is_pooled: bool,
) -> tuple[list[int], list[int]]:
    """Bytes of ids received and of embeddings sent by each shard per step (TorchRec's rule,
    see the module docstring)."""
    st = str(sharding_type)
    common: dict[str, Any] = dict(
        batch_sizes=batch_sizes, input_lengths=input_lengths, num_poolings=num_poolings,
        input_data_type_size=input_data_type_size, output_data_type_size=output_data_type_size,
        is_pooled=is_pooled)
    if st == ShardingType.DATA_PARALLEL.value:
        sizes = _calculate_dp_shard_io_sizes(emb_dim=emb_dim, num_shards=len(shard_sizes), **common)
    elif st == ShardingType.TABLE_WISE.value:
        sizes = _calculate_tw_shard_io_sizes(world_size=world_size, emb_dim=emb_dim, **common)
    elif st in (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value):
        sizes = _calculate_cw_shard_io_sizes(world_size=world_size, shard_sizes=shard_sizes,
                                             **common)
    elif st == ShardingType.ROW_WISE.value:
        sizes = _calculate_rw_shard_io_sizes(world_size=world_size, shard_sizes=shard_sizes,
                                             **common)
    elif st in (ShardingType.TABLE_ROW_WISE.value, "grid_shard"):
        sizes = _calculate_rw_shard_io_sizes(world_size=world_size, shard_sizes=shard_sizes,
                                             domain_size=local_world_size, **common)
    else:
        raise ValueError(f"Unrecognized or unsupported sharding type provided: {sharding_type}")
    _validate_io_sizes(*sizes, st)
    return sizes


def _get_optimizer_multipler(optimizer_class: type | None, shape: torch.Size) -> float:
    """Optimizer state as a multiple of the weights: SGD 0, Adam 2, row-wise Adagrad one
    value per row, others (Adagrad ...) 1; 0 when no optimizer class is attached."""
    if not optimizer_class:
        return 0.0
    from recsys_core import optim as rc_optim

    if optimizer_class in (torch.optim.SGD, getattr(rc_optim, "SGD", None)):
        return 0
    if optimizer_class in (torch.optim.Adam, getattr(rc_optim, "Adam", None)):
        return 2
    if optimizer_class is getattr(rc_optim, "RowWiseAdagrad", ()):
        return 1 / shape[-1]
    return 1


def _calculate_storage_specific_sizes(
    storage: int, shape: torch.Size, shard_sizes: list[list[int]], sharding_type: str,
    optimizer_class: type | None = None, is_inference: bool = False, clf: float | None = None,
) -> list[int]:
    """Per shard: its share of ``storage`` bytes (all of it for data-parallel), plus optimizer
    state and, with a cache load factor ``clf``, cache bookkeeping (training only)."""
    dp = str(sharding_type) == ShardingType.DATA_PARALLEL.value
    tensors = [storage if dp else math.ceil(storage * prod(s) / prod(shape)) for s in shard_sizes]
    multiplier = _get_optimizer_multipler(optimizer_class, shape)
    optimizer = [math.ceil(t * multiplier) for t in tensors]
    aux = [0 if clf is None else math.ceil(s[0] * (4 + clf * 16)) for s in shard_sizes]
    return [t if is_inference else t + o + a for t, o, a in zip(tensors, optimizer, aux, strict=False)]


def calculate_pipeline_io_cost(
    input_size: int, output_size: int, prefetch_size: int, pipeline_type: Any,
    multipass_prefetch_max_pass: int | None, count_ephemeral_storage_cost: bool = False,
    is_inference: bool = False,
) -> int:
    """HBM for a shard's inputs and outputs under a training pipeline (TorchRec's factors:
    sparse-dist pipelines hold 2 batches of inputs, prefetch pipelines 3 plus a prefetch burst)."""
    if is_inference:
        return 0
    ephemeral = output_size if count_ephemeral_storage_cost else 0
    name = getattr(pipeline_type, "name", str(pipeline_type)).upper()
    if name == "TRAIN_SPARSE_DIST":
        return 2 * input_size + ephemeral
    if name == "TRAIN_PREFETCH_SPARSE_DIST":
        passes = multipass_prefetch_max_pass or 1
        return 3 * input_size + int((1 + 6 / passes) * prefetch_size) + ephemeral
    return input_size + output_size


def calculate_shard_storages(
    sharder_data: Any, sharding_type: str, tensor: torch.Tensor, compute_device: str,
    compute_kernel: str, shard_sizes: list[list[int]], batch_sizes: list[int], world_size: int,
    local_world_size: int, input_lengths: list[float], num_poolings: list[float],
    caching_ratio: float, is_pooled: bool, input_data_type_size: float,
    output_data_type_size: float, pipeline_type: Any = None,
    count_ephemeral_storage_cost: bool = False, is_inference: bool = False,
    multipass_prefetch_max_pass: int | None = None,
    key_value_params: KeyValueParams | None = None,
    kv_cache_load_factor: float = KV_CACHING_RATIO, use_virtual_table: bool = False,
) -> list[Storage]:
    """Each shard's :class:`Storage` by TorchRec's rule (module docstring)."""
    kernel = str(compute_kernel)
    inputs, outputs = _calculate_shard_io_sizes(
        sharding_type, batch_sizes, world_size, local_world_size, input_lengths,
        tensor.shape[1], shard_sizes, input_data_type_size, output_data_type_size,
        num_poolings, is_pooled)
    usage = storage_usage(tensor, compute_device, kernel, sharder_data.storage_usage_type)
    hbm, ddr = usage.get("hbm", 0), usage.get("ddr", 0)
    cached = kernel in _CACHED_KERNELS
    if cached:
        hbm = round(ddr * caching_ratio)
    optimizer_class = getattr(tensor, "_optimizer_classes", [None])[0]

    def sizes(storage: int, clf: float | None = None) -> list[int]:
        return _calculate_storage_specific_sizes(storage, tensor.shape, shard_sizes,
                                                 sharding_type, optimizer_class, is_inference, clf)

    hbm_specific = sizes(hbm, caching_ratio if cached else None)
    ddr_specific = sizes(ddr)
    ssd_specific = [h + d for h, d in zip(sizes(usage.get("hbm", 0),
                                                caching_ratio if cached else None),
                                          sizes(usage.get("ddr", 0)), strict=False)]
    if kernel in _KV_KERNELS or use_virtual_table:
        params = key_value_params or KeyValueParams()
        l1 = (getattr(params, "max_l1_cache_size", None) or 0) * 1024 * 1024
        cache = math.ceil(tensor.shape[0] * kv_cache_load_factor * tensor.element_size()
                          * tensor.shape[1])
        hbm_specific = [min(l1, cache) for _ in hbm_specific]
        ddr_specific = [0 for _ in ddr_specific]
    on_device = compute_device in ("cuda", "mtia")
    result = []
    for i, o, h, d, s in zip(inputs, outputs, hbm_specific, ddr_specific, ssd_specific, strict=False):
        hbm_size = h + calculate_pipeline_io_cost(
            i, o, i if cached else 0, pipeline_type, multipass_prefetch_max_pass,
            count_ephemeral_storage_cost, is_inference) if on_device else 0
        ddr_size = i + o + d if compute_device == "cpu" and not is_inference else d
        result.append(Storage(hbm=hbm_size, ddr=ddr_size, ssd=s if kernel == "key_value" else 0))
    return result


class EmbeddingStorageEstimator(ShardEstimator):
    """Sets each shard's ``storage`` by TorchRec's rule (see the module docstring).

    Args:
        topology: ranks and their device.
        constraints: per table, its batch sizes, poolings and key-value params.
        pipeline_type: the training pipeline (sets how many batches of inputs are held).
        run_embedding_at_peak_memory: count outputs as held at peak memory.
        is_inference: count weights only.
    """

    def __init__(
        self,
        topology: Topology,
        constraints: dict[str, Any] | None = None,
        pipeline_type: Any = None,
        run_embedding_at_peak_memory: bool = False,
        is_inference: bool = False,
    ) -> None:
        self._topology = topology
        self._constraints = constraints
        self._pipeline_type = pipeline_type
        self._run_embedding_at_peak_memory = run_embedding_at_peak_memory
        self._is_inference = is_inference

    def estimate(
        self, sharding_options: list[ShardingOption], sharder_data_map: SharderDataMap
    ) -> None:
        for so in sharding_options:
            sharder_data = sharder_data_map[so.module_type_key]
            clf = so.cache_load_factor
            if clf is None:
                clf = sharder_data.fused_params.get("cache_load_factor")
            constraints = (self._constraints or {}).get(so.name)
            batch_sizes = (constraints.batch_sizes if constraints and constraints.batch_sizes
                           else [so.batch_size] * so.num_inputs)
            output_size = (_DTYPE_BITS[so.output_dtype.name] / 8 if so.output_dtype
                           else so.tensor.element_size())
            mpp = getattr(so.cache_params, "multipass_prefetch_config", None)
            if mpp is None:
                mpp = sharder_data.fused_params.get("multipass_prefetch_config")
            try:
                storages = calculate_shard_storages(
                    sharder_data=sharder_data, sharding_type=so.sharding_type,
                    tensor=so.tensor, compute_device=self._topology.compute_device,
                    compute_kernel=so.compute_kernel, shard_sizes=[s.size for s in so.shards],
                    batch_sizes=batch_sizes, world_size=self._topology.world_size,
                    local_world_size=self._topology.intra_group_size,
                    input_lengths=so.input_lengths,
                    num_poolings=get_num_poolings(self._constraints, so),
                    caching_ratio=clf if clf else UVM_CACHING_RATIO, is_pooled=so.is_pooled,
                    input_data_type_size=BIGINT_DTYPE, output_data_type_size=output_size,
                    pipeline_type=self._pipeline_type,
                    count_ephemeral_storage_cost=self._run_embedding_at_peak_memory,
                    is_inference=self._is_inference,
                    multipass_prefetch_max_pass=getattr(mpp, "num_passes", None),
                    key_value_params=constraints.key_value_params if constraints else None,
                    kv_cache_load_factor=sharder_data.fused_params.get(
                        "cache_load_factor", KV_CACHING_RATIO),
                    use_virtual_table=bool(constraints and constraints.use_virtual_table),
                )
            except ZeroDivisionError as e:
                raise ValueError(
                    f"Failed to calculate sharding plan: {e} Context: table_name='{so.name}', "
                    f"module_path='{so.path}', tensor.shape={so.tensor.shape}, sharding_type="
                    f"'{so.sharding_type}', compute_kernel='{so.compute_kernel}'") from e
            for shard, storage in zip(so.shards, storages, strict=False):
                shard.storage = storage


class EmbeddingPerfEstimator(ShardEstimator):
    """Sets each shard's ``perf`` by TorchRec's formulas (``torchrec_perf.py``), with a
    ``HardwarePerfConfig`` (default: TorchRec's OSS coefficients). ``sharder_data_map`` is
    keyed by the options' ``module_type_key``."""

    def __init__(
        self, topology: Topology, constraints: dict[str, Any] | None = None,
        is_inference: bool = False, config: Any = None,
    ) -> None:
        self._topology = topology
        self._constraints = constraints
        self._is_inference = is_inference
        self._config = config if config is not None else HardwarePerfConfig()

    @property
    def config(self) -> Any:
        return self._config

    @property
    def is_inference(self) -> bool:
        return self._is_inference

    def estimate(
        self, sharding_options: list[ShardingOption], sharder_data_map: SharderDataMap | None = None
    ) -> None:
        plain = SharderData(fused_params={}, qcomm_dtype_sizes={}, storage_usage_type=None)
        for so in sharding_options:
            data = (sharder_data_map or {}).get(so.module_type_key, plain)
            perfs = shard_perfs(so, self._topology, self._constraints, data, self._config,
                                self._is_inference)
            for shard, perf in zip(so.shards, perfs, strict=True):
                _validate_perf(perf, so.name, so.sharding_type)
                shard.perf = perf


class CalibratedPerfEstimator(ShardEstimator):
    """Sets each shard's ``perf`` with this library's calibrated cost model (what its own
    search ranks layouts by: ``search/cost.py``), split into TorchRec's phases. Registered with
    ``EmbeddingPerfEstimatorFactory`` as ``"recsys_core"``."""

    def __init__(
        self, topology: Topology, constraints: dict[str, Any] | None = None,
        is_inference: bool = False,
    ) -> None:
        self._topology = topology
        self._constraints = constraints
        self._is_inference = is_inference

    def estimate(
        self, sharding_options: list[ShardingOption], sharder_data_map: SharderDataMap | None = None
    ) -> None:
        for so in sharding_options:
            estimate_perf(so, self._topology, self._constraints)
            for shard in so.shards:
                if shard.perf is not None:
                    _validate_perf(shard.perf, so.name, so.sharding_type)


class EmbeddingOffloadStats(CacheStatistics):
    """Cache statistics of a FUSED_UVM_CACHING table (TorchRec's ``CacheStatistics``):
    ``cacheability`` (area under the miss-ratio curve), ``expected_lookups`` (distinct ids per
    global batch) and an LRU miss-ratio-curve histogram over ``height`` rows: bin i of n counts
    the lookups that hit once the cache holds at least i/n of the rows."""

    def __init__(self, cacheability: float, expected_lookups: int,
                 mrc_hist_counts: torch.Tensor, height: int) -> None:
        if mrc_hist_counts.dim() != 1:
            raise ValueError(f"expected 1d tensor, got {mrc_hist_counts.dim()}d")
        if mrc_hist_counts.size()[0] == 0:
            raise ValueError("expected non-empty tensor")
        self._cacheability = cacheability
        self._expected_lookups = expected_lookups
        self.height = height
        self.hist: torch.Tensor = mrc_hist_counts
        self.bins: torch.Tensor = torch.linspace(0, height, len(mrc_hist_counts) + 1)

    @property
    def expected_lookups(self) -> int:
        return self._expected_lookups

    @property
    def cacheability(self) -> float:
        return self._cacheability

    def expected_miss_rate(self, clf: float) -> float:
        """The miss rate of a cache of ``clf * height`` rows."""
        return EmbeddingOffloadStats.estimate_cache_miss_rate(
            torch.tensor(clf * self.height), self.hist, self.bins).item()

    @staticmethod
    def estimate_cache_miss_rate(cache_sizes: torch.Tensor, hist: torch.Tensor,
                                 bins: torch.Tensor) -> torch.Tensor:
        """Miss ratio of caches of ``cache_sizes`` rows: a cache of k rows hits every reuse at
        stack distance < k, i.e. the histogram's bins below k (0 misses without data)."""
        hits = hist.cumsum(dim=0)
        if hits[-1] == 0:
            return torch.zeros_like(cache_sizes, dtype=torch.float32)
        misses = 1 - hits / hits[-1]
        index = torch.bucketize(cache_sizes - 1, bins, right=True)
        # index 0 (below every bin) reads the appended 1.0 through -1; past the end reads 0.0
        return torch.cat((misses, torch.tensor([0.0, 1.0])))[index - 1]
