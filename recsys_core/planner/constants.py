"""TorchRec's planner constants (``torchrec.distributed.planner.constants``), with its values.

Units as TorchRec's: bytes, bytes per millisecond. TorchRec counts bandwidths in GiB
(``897 * 1024**3 / 1000`` bytes/ms for HBM). These are the figures TorchRec's estimators and
proposers use; this library's own planner (``EmbeddingShardingPlanner`` without custom
components) keeps its calibrated defaults in ``topology.py`` (decimal GB, measured CPU figures).
"""

from __future__ import annotations

MAX_SIZE: int = (1 << 63) - 1

INTRA_NODE_BANDWIDTH: float = 600 * 1024**3 / 1000  # bytes/ms (NVLink)
CROSS_NODE_BANDWIDTH: float = 12.5 * 1024**3 / 1000  # bytes/ms (a 100 Gb/s NIC)

MIN_CW_DIM: int = 128  # narrowest column-wise shard TorchRec's enumerator proposes
POOLING_FACTOR: float = 1.0  # ids per bag when the constraints give none
NUM_POOLINGS: float = 1.0

BIGINT_DTYPE: int = 8  # bytes of an id (TBE converts int32 ids to int64)

HBM_CAP: int = 32 * 1024**3
DDR_CAP: int = 128 * 1024**3
SSD_CAP: int = 2 * 1024**4
DDR_MEM_BW: float = 51 * 1024**3 / 1000
HBM_MEM_BW: float = 897 * 1024**3 / 1000
SSD_MEM_BW: float = 100 * 1024**2 / 1000
HBM_TO_DDR_MEM_BW: float = 32 * 1024**3 / 1000
UVM_CACHING_RATIO: float = 0.2  # default cache load factor
KV_CACHING_RATIO: float = 0.2
BATCH_SIZE: int = 512

BATCHED_COPY_PERF_FACTOR: float = 2.455
FULL_BLOCK_EMB_DIM: int = 128
HALF_BLOCK_PENALTY: float = 1.15
QUARTER_BLOCK_PENALTY: float = 1.75
BWD_COMPUTE_MULTIPLIER: float = 2
WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER: float = 1
WEIGHTED_KERNEL_MULTIPLIER: float = 1.1
DP_ELEMENTWISE_KERNELS_PERF_FACTOR: float = 9.22

HUNDRED_GB: int = 100 * 1024**3

DEFAULT_PERF_ESTIMATOR: str = "default_estimator"

_CACHED = ("fused_uvm_caching", "quant_uvm_caching")


def kernel_bw_lookup(
    compute_device: str,
    compute_kernel: str,
    hbm_mem_bw: float,
    ddr_mem_bw: float,
    hbm_to_ddr_mem_bw: float,
    caching_ratio: float | None = None,
    prefetch_pipeline: bool = False,
    ssd_mem_bw: float = SSD_MEM_BW,
) -> float | None:
    """Bytes/ms a lookup of ``compute_kernel`` reads on ``compute_device`` (None: no such pair).

    TorchRec's table: CPU and MTIA kernels read at the memory's bandwidth (DENSE at half);
    CUDA UVM reads at a tenth of the HBM<->DDR link, a UVM cache at a tenth of the blend
    ``r * hbm + (1 - r) * hbm_to_ddr`` for caching ratio ``r`` (default 0.2), or at the full
    HBM bandwidth when the cache is prefetched by the pipeline.
    """
    ratio = UVM_CACHING_RATIO if caching_ratio is None else caching_ratio
    if prefetch_pipeline and compute_device == "cuda" and compute_kernel == "fused_uvm_caching":
        return hbm_mem_bw
    if compute_device in ("cpu", "mtia"):
        bw = ddr_mem_bw if compute_device == "cpu" else hbm_mem_bw
        return {"dense": 0.5 * bw, "fused": bw, "quant": bw}.get(str(compute_kernel))
    if compute_device != "cuda":
        return None
    cached = (ratio * hbm_mem_bw + (1 - ratio) * hbm_to_ddr_mem_bw) / 10
    return {
        "dense": 0.5 * hbm_mem_bw,
        "fused": hbm_mem_bw,
        "fused_triton": hbm_mem_bw,
        "fused_uvm": hbm_to_ddr_mem_bw / 10,
        "fused_uvm_caching": cached,
        "quant": hbm_mem_bw,
        "quant_uvm": hbm_to_ddr_mem_bw / 10,
        "quant_uvm_caching": cached,
        "key_value": ssd_mem_bw,
        "ssd_virtual_table": hbm_to_ddr_mem_bw,
        "dram_virtual_table": hbm_to_ddr_mem_bw,
        "dram_ssd_virtual_table": hbm_to_ddr_mem_bw,
    }.get(str(compute_kernel))

PIPELINE_TYPES = ("none", "train_base", "train_sparse_dist", "train_prefetch_sparse_dist")
"""The values of TorchRec's ``PipelineType`` (``recsys_core.distributed.types``): the pipelines
the storage estimator sizes inputs for (named by value in a ``PlannerConfig``)."""
