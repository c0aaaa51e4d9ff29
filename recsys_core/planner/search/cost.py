"""Storage and cost of a candidate layout, per shard. Every constant of the model is here.

A shard of ``rows x cols`` of a table serves a share of the ids of the WHOLE global batch
(table-, column- and row-wise) or of its own rank's batch (data-parallel). Per training step:

storage (bytes)
    weights          rows * cols * bytes(data_type)
    optimizer state  rows * state bytes per row (from the fused optimizer: e.g. 4 for
                     EXACT_ROWWISE_ADAGRAD, 4 * cols for EXACT_ADAGRAD, 8 * cols for ADAM)
    buffers          received ids (+ weights) and lengths, pooled outputs and their gradients
                     (data-parallel: plus a dense gradient of the table)

    CUDA FUSED keeps everything in HBM; FUSED_UVM keeps weights and state in host memory; on a
    CPU topology FUSED keeps everything in host memory (DDR).

    FUSED_UVM_CACHING keeps every row of a shard in a slow tier and ``slots = cache_slots(rows,
    lf) = ceil(lf * rows)`` rows (at least 1, at most rows) in a cache in a fast tier:

    CUDA (FBGEMM's UVM cache)  HBM   buffers + slots * (cols * bytes(cache precision)
                                     + CACHE_SLOT_OVERHEAD_BYTES)
                               DDR   weights + optimizer state (UVM)
    CPU (the cached kernel)    DDR   buffers + rows * CPU_CACHE_ROW_BOOKKEEPING_BYTES
                                     + slots * (cols * bytes(cache precision) + state bytes
                                     per row + CPU_CACHE_SLOT_BOOKKEEPING_BYTES)
                               disk  weights + optimizer state (memory-mapped backing files)

cost (ms)
    lookup     (row reads + output writes) / memory bandwidth; backward =
               BWD_COMPUTE_MULTIPLIER x forward, plus the fused optimizer reading and writing
               each distinct touched row and its state once (``rows * (1 - exp(-ids / rows))``
               distinct rows for uniform ids), plus NS_PER_UPDATED_ROW per distinct row
    input      ids (+ weights) and lengths received, over the link each source rank uses
    output     pooled rows sent to every rank (reduce-scattered for row splits), and the same
               bytes again for their gradients in backward (BWD_COMM_MULTIPLIER)
    DP         no input/output all-to-all; an all-reduce of the whole table's gradient and a
               dense optimizer update instead (an upper bound: hence DP only for small tables)
    + SHARD_OVERHEAD_MS per shard

    Caching: the expected hit rate is the load factor (as if ids were uniform: real traffic is
    skewed, so this over-estimates misses). CUDA: a hit reads HBM, a miss host memory (the
    lookup and optimizer traffic above, at DDR instead of HBM bandwidth). CPU: every lookup reads
    the cache in DDR; each distinct row that misses is first read from disk (weights and
    optimizer state, ``row_bytes``) and, trained, written back when evicted: ``2 * misses *
    row_bytes / ssd_mem_bw`` (the copies' DDR side, ~50x faster, is left out).

Bandwidths are the topology's, "per rank", in bytes per ms (TorchRec's unit). Sources ids are spread evenly over ranks: a share
``(local - 1) / world`` arrives over the intra-host link, ``(world - local) / world`` over the
inter-host link, and the rank's own share is free.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from recsys_core.kernels.config import EmbOptimType
from recsys_core.modules.embedding_configs import DATA_TYPE_BITS, DataType
from recsys_core.plan.types import EmbeddingComputeKernel, ShardingType
from recsys_core.planner.search.types import Candidate, Placement, TableSpec
from recsys_core.planner.storage import Tier
from recsys_core.planner.topology import DEFAULT_BWD_COMPUTE_MULTIPLIER, GIB, Topology

# ---- Model constants ----------------------------------------------------------------------------
ID_BYTES = 8  # ids travel as int64 (the KJT values the sharded modules send)
LENGTH_BYTES = 8  # one int64 length per bag
ID_WEIGHT_BYTES = 4  # fp32 per-id weight of weighted features
OUTPUT_BYTES = 4  # fp32: data-parallel gradients (and outputs unless output_dtype says otherwise)
STATE_BYTES = 4  # fused optimizer state is fp32
# The backward's lookup traffic relative to the forward's is topology.bwd_compute_multiplier
# (TorchRec's BWD_COMPUTE_MULTIPLIER, 2 by default).
BWD_COMPUTE_MULTIPLIER = DEFAULT_BWD_COMPUTE_MULTIPLIER
BWD_COMM_MULTIPLIER = 1.0  # output gradients retrace the forward output all-to-all, same bytes
# Fixed ns per distinct row the backward updates, on top of its bytes. GPU kernels are
# bandwidth-bound (TorchRec models only bytes). FBGEMM-CPU 1.8's backward (sort ids, aggregate
# per row, fused optimizer) costs ~0.5 us per distinct row on the 2-vCPU development VM: a
# least-squares fit over 13 tables (1e2..1e7 rows, dims 32..256, 2k..41k ids) gave 480 ns, and
# with 500 ns and DDR at 51 GB/s every estimate is within 0.74x..1.3x of the measured step;
# bench/planner.py re-measures.
NS_PER_UPDATED_ROW = {"cuda": 0.0, "cpu": 500.0}
# Per shard per step: kernel launches and bookkeeping of one more table in a batched kernel
# (measured ~5 us per extra table on the development VM; a CUDA launch pair is similar).
SHARD_OVERHEAD_MS = 0.005
CACHE_SLOT_OVERHEAD_BYTES = 16  # FBGEMM cache: int64 slot -> row index + int64 LRU/LFU state
# The CPU cached kernel (recsys_core/kernels/cached_tbe.py): per slot an int64 row id, an int64
# last-use tick, an int32 lock count and a dirty flag (24 bytes rounded); per row of the shard,
# cached or not, an int32 row -> slot map and an int32 LFU count.
CPU_CACHE_SLOT_BOOKKEEPING_BYTES = 24
CPU_CACHE_ROW_BOOKKEEPING_BYTES = 8
DEFAULT_CACHE_LOAD_FACTOR = 0.2  # TorchRec's default cache_load_factor
MIN_CACHE_LOAD_FACTOR = 0.01  # below this a cache barely hits: FUSED_UVM (CUDA) instead
MAX_CACHE_LOAD_FACTOR = 1.0
# Load factors the partitioner picks have at most this many decimals (the plan stores 6).
LOAD_FACTOR_DECIMALS = 6
# Data-parallel replicates a table on every rank and all-reduces its gradient each step; the
# planner proposes it (unless constraints ask for it) only for tables at most this large.
DATA_PARALLEL_MAX_BYTES = 1024**2
DEFAULT_MIN_PARTITION = 32  # narrowest column-wise shard: narrower rows waste SIMD/warps
DEFAULT_OPTIMIZER = EmbOptimType.EXACT_ROWWISE_ADAGRAD  # when the sharder names none

ROW_SPLITS = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)


@functools.cache
def _state_layout(optimizer: EmbOptimType) -> tuple[int, int]:
    """(state values per row, state values per element) of ``optimizer``."""
    rowwise = [optimizer.state_is_rowwise(name) for name in optimizer.state_names]
    return sum(rowwise), len(rowwise) - sum(rowwise)


def state_bytes_per_row(optimizer: EmbOptimType, cols: np.ndarray | float) -> np.ndarray:
    """Optimizer-state bytes of one row of ``cols`` columns (fp32 state)."""
    per_row, per_element = _state_layout(optimizer)
    cols = np.asarray(cols, dtype=np.float64)
    return STATE_BYTES * per_row + STATE_BYTES * per_element * cols


def weights_and_state_bytes(
    rows: np.ndarray | float, cols: np.ndarray | float, data_type: DataType, optimizer: EmbOptimType
) -> np.ndarray:
    """Bytes of ``rows x cols`` of a table's weights plus its fused optimizer's state."""
    rows = np.asarray(rows, dtype=np.float64)
    cols = np.asarray(cols, dtype=np.float64)
    return rows * cols * (DATA_TYPE_BITS[data_type] / 8) + rows * state_bytes_per_row(optimizer, cols)


def estimate_option(
    table: TableSpec,
    sharding_type: ShardingType,
    kernel: EmbeddingComputeKernel,
    placement: Placement,
    shard_rows: np.ndarray,
    shard_cols: np.ndarray,
    topology: Topology,
    with_perf: bool = False,
) -> Candidate:
    """Per-shard storage and cost of ``table`` split into shards of ``shard_rows x shard_cols``."""
    config = table.config
    world, local = topology.world_size, topology.local_size
    rows = np.asarray(shard_rows, dtype=np.float64)
    cols = np.asarray(shard_cols, dtype=np.float64)
    elem = DATA_TYPE_BITS[config.data_type] / 8
    dp = sharding_type is ShardingType.DATA_PARALLEL
    scale = 1 if dp else world  # a sharded table serves every rank's batch
    share = rows / config.num_embeddings if sharding_type in ROW_SPLITS else np.ones_like(rows)
    ids = table.ids_per_batch * scale * share
    bags = np.full_like(rows, table.bags_per_batch * scale)
    out_rows = bags if table.pooled else ids  # sequence tables return one row per id
    id_bytes = ID_BYTES + (ID_WEIGHT_BYTES if table.is_weighted else 0)

    # ---- storage
    stored = weights_and_state_bytes(rows, cols, config.data_type, table.optimizer)  # weights + state
    out_bytes = out_rows * cols * table.output_bytes
    buffers = 2 * out_bytes + (rows * cols * OUTPUT_BYTES if dp else ids * id_bytes + bags * LENGTH_BYTES)

    # ---- compute: table-memory and compute-device traffic, forward + backward
    state_row = state_bytes_per_row(table.optimizer, cols)
    with np.errstate(divide="ignore", invalid="ignore"):  # empty row shards touch no rows
        unique = np.where(rows > 0, rows * -np.expm1(-ids / rows), 0.0)
    updated = rows if dp else unique  # data-parallel updates its whole replica (dense gradient)
    table_bytes = (
        ids * cols * elem * (1 + topology.bwd_compute_multiplier)
        + updated * (cols * elem + state_row) * 2  # optimizer: read and write row and state
    )
    local_bytes = out_bytes * (1 + topology.bwd_compute_multiplier)
    compute_bw = topology.hbm_mem_bw if topology.is_cuda else topology.ddr_mem_bw
    table_bw = {
        EmbeddingComputeKernel.FUSED: compute_bw,
        EmbeddingComputeKernel.DENSE: compute_bw,  # same memory, the dense optimizer steps it
        EmbeddingComputeKernel.FUSED_UVM: topology.ddr_mem_bw,
        EmbeddingComputeKernel.FUSED_UVM_CACHING: topology.tier_bw(topology.cache_tier),  # hits
    }[kernel]
    row_ms = NS_PER_UPDATED_ROW[topology.compute_device] * 1e-6
    compute_ms = updated * row_ms + table_bytes / table_bw + local_bytes / compute_bw

    # ---- communication
    intra = topology.intra_host_bw
    inter = topology.inter_host_bw
    spread_ms = ((local - 1) / world) / intra + ((world - local) / world) / inter  # per byte
    if dp:
        link = inter if topology.num_hosts > 1 else intra
        comm_ms = 2 * (world - 1) / world * rows * cols * OUTPUT_BYTES / link
    else:
        in_ms = (ids * id_bytes + bags * LENGTH_BYTES) * spread_ms
        if sharding_type is ShardingType.TABLE_ROW_WISE:
            # reduce-scatter inside the host, then each rank forwards its 1/local of the sums
            out_ms = out_bytes * (((local - 1) / local) / intra + ((world - local) / (world * local)) / inter)
        else:
            out_ms = out_bytes * spread_ms
        comm_ms = in_ms + out_ms * (1 + BWD_COMM_MULTIPLIER)

    cost = compute_ms + comm_ms + SHARD_OVERHEAD_MS
    perf = np.zeros((4, 0))
    fwd_table = ids * cols * elem
    if with_perf:  # the same cost by phase (TorchRec's Perf); only the enumerator asks for it
        fwd_compute = fwd_table / table_bw + out_bytes / compute_bw + SHARD_OVERHEAD_MS
        bwd_compute = compute_ms - (fwd_compute - SHARD_OVERHEAD_MS)
        fwd_comms = np.zeros_like(rows) if dp else in_ms + out_ms
        perf = np.stack([fwd_compute, fwd_comms, bwd_compute, comm_ms - fwd_comms])
    zeros = np.zeros_like(rows)
    caching = kernel is EmbeddingComputeKernel.FUSED_UVM_CACHING
    # Cache slots (caching) come on top of the fast tier, at the load factor the plan chooses.
    hbm, ddr, ssd = zeros, zeros, zeros
    if not topology.is_cuda:  # FUSED_UVM is never proposed on CPU
        if caching:  # a cache in RAM over backing files on disk
            ddr, ssd = buffers + rows * CPU_CACHE_ROW_BOOKKEEPING_BYTES, stored
        else:
            ddr = stored + buffers
    elif kernel in (EmbeddingComputeKernel.FUSED, EmbeddingComputeKernel.DENSE):
        hbm = stored + buffers
    else:  # UVM, or an HBM cache over UVM
        hbm, ddr = buffers, stored
    slot_bytes, miss_rows, row_bytes, miss_cost, miss_fwd = zeros, zeros, zeros, zeros, zeros
    load_factor = None
    if caching:
        params = table.constraints.cache_params
        precision = config.data_type if params is None or params.precision is None else params.precision
        cache_elem = DATA_TYPE_BITS[precision] / 8
        miss_rows = unique
        if topology.is_cuda:  # FBGEMM's cache holds weights; the state stays in host memory
            slot_bytes = cols * cache_elem + CACHE_SLOT_OVERHEAD_BYTES
            row_bytes = cols * cache_elem
            slower = 1 / topology.ddr_mem_bw - 1 / topology.hbm_mem_bw
            miss_cost, miss_fwd = table_bytes * slower, fwd_table * slower
        else:  # a slot holds a row's weights and state; a miss reads them, eviction writes back
            slot_bytes = cols * cache_elem + state_row + CPU_CACHE_SLOT_BOOKKEEPING_BYTES
            row_bytes = cols * elem + state_row
            miss_fwd = unique * row_bytes / topology.tier_bw(Tier.SSD)
            miss_cost = 2 * miss_fwd
        if params is not None:
            load_factor = params.load_factor
            if params.reserved_memory and topology.is_cuda:
                hbm = hbm + params.reserved_memory * GIB
            elif params.reserved_memory:
                ddr = ddr + params.reserved_memory * GIB
    return Candidate(
        table=table,
        sharding_type=sharding_type,
        compute_kernel=kernel,
        placement=placement,
        shard_rows=np.asarray(shard_rows, dtype=np.int64),
        shard_cols=np.asarray(shard_cols, dtype=np.int64),
        hbm=hbm,
        ddr=ddr,
        ssd=ssd,
        cost=cost,
        perf=perf,
        cache_tier=topology.cache_tier,
        backing_tier=topology.backing_tier,
        slot_bytes=slot_bytes,
        miss_rows=miss_rows,
        row_bytes=row_bytes,
        miss_cost=miss_cost,
        miss_fwd=miss_fwd,
        load_factor=load_factor,
    )


def fitting_load_factor(room: np.ndarray, rows: np.ndarray, slot_bytes: np.ndarray) -> np.ndarray:
    """The largest load factor whose cache fits in ``room`` bytes, per shard (broadcast): rounded
    down to LOAD_FACTOR_DECIMALS and leaving one slot to spare, so that the kernel's
    ``ceil(lf * rows)`` slots fit whatever the float rounding; inf for an empty shard, < 0 where
    not even one slot fits."""
    rows = np.asarray(rows, dtype=np.float64)
    scale = 10.0**LOAD_FACTOR_DECIMALS
    with np.errstate(divide="ignore", invalid="ignore"):
        spare = np.floor(room / slot_bytes) - 1.0
        lf = np.floor(spare / rows * scale) / scale
    return np.where(rows > 0, lf, np.inf)


# The cached kernel keeps the rows of the batch in flight locked while the pipeline brings the
# next batch's rows in: a cache must hold the distinct rows of two batches. A rank's batch sends
# a table ``ids_per_batch`` ids on average (its pooling factors), any one shard at most all of
# them; 2.5x leaves a quarter for batches with more ids than the average.
CACHE_BATCHES = 2.5


def least_load_factor(option: Candidate) -> float:
    """The smallest load factor the planner gives ``option``'s cache: the constraints' factor
    if fixed, else at least MIN_CACHE_LOAD_FACTOR and enough slots on every shard for
    ``CACHE_BATCHES`` x the ids a rank's batch sends the table (or all its rows)."""
    if option.load_factor:
        return option.load_factor
    rows = np.asarray(option.shard_rows, dtype=np.float64)
    if not option.is_caching or not rows.size:
        return MIN_CACHE_LOAD_FACTOR
    need = np.minimum(rows, np.ceil(CACHE_BATCHES * option.table.ids_per_batch))
    needed = float((need / np.maximum(rows, 1.0)).max())
    scale = 10.0**LOAD_FACTOR_DECIMALS
    return min(MAX_CACHE_LOAD_FACTOR, max(MIN_CACHE_LOAD_FACTOR, math.ceil(needed * scale) / scale))


def storage_bytes(option: Candidate, load_factor: float | None = None) -> float:
    """Total bytes (every tier) of all shards of ``option`` (cache at ``load_factor``; None: the
    constraints' load factor, else the smallest the planner gives)."""
    lf = load_factor if load_factor is not None else least_load_factor(option)
    return float(option.memory(lf).sum())
