"""Candidate layouts of one table: every allowed sharding type x compute kernel x shard geometry.

What is allowed is the intersection of what the sharder executes, what the table's constraints
permit and what is meaningful on the topology:

- table-wise: one shard; the partitioner picks the rank.
- column-wise: ``k`` equal column blocks (``dim % k == 0``, width >= min_partition, widths that
  are a multiple of 4 when any is), each on a rank the partitioner picks.
- table-column-wise: ``k`` column blocks on local ranks ``0..k-1`` of a host it picks.
- row-wise: row blocks (``row_blocks(rows, world_size)``) on every rank.
- table-row-wise: row blocks over the ranks of a host it picks.
- data-parallel: a replica per rank; proposed unprompted only for tables of at most
  ``DATA_PARALLEL_MAX_BYTES`` (it all-reduces the whole table's gradient every step).

Splits that repeat another layout are dropped: on one rank nothing is split, and on one host
the table-row/column-wise layouts are row/column-wise. Column splits are dropped for optimizers
whose state or update spans a whole row (row-wise Adagrad, partial row-wise Adam, LAMB): a
column block would compute it over its own columns only, so training would differ from the
unsharded module. Constraints that name a type bring it back.

Kernels, in order of preference (:func:`planner_kernels`):

- CUDA: FUSED (HBM), FUSED_UVM_CACHING (an HBM cache over host memory), FUSED_UVM (host memory).
- CPU with disk (``Topology.ssd_cap > 0``): FUSED (RAM), FUSED_UVM_CACHING (a RAM cache over
  files on local disk). No FUSED_UVM: with the table on disk and no cache, every lookup would
  read the disk.
- CPU without disk: FUSED only.

``enforce_hbm`` keeps FUSED only; data-parallel replicas are never cached (FUSED only).
"""

from __future__ import annotations

import numpy as np

from recsys_core.kernels.config import EmbOptimType
from recsys_core.modules.embedding_configs import DATA_TYPE_BITS
from recsys_core.plan.sharder import Sharder
from recsys_core.plan.types import EmbeddingComputeKernel, ShardingType
from recsys_core.planner.errors import PlannerError, PlannerErrorType
from recsys_core.planner.search.cost import (
    DATA_PARALLEL_MAX_BYTES,
    DEFAULT_MIN_PARTITION,
    estimate_option,
)
from recsys_core.planner.search.types import Candidate, Placement, TableSpec
from recsys_core.planner.topology import Topology

# Also the tie-break order between equally good options: simplest layout first.
SHARDING_TYPE_ORDER = (
    ShardingType.TABLE_WISE,
    ShardingType.COLUMN_WISE,
    ShardingType.TABLE_COLUMN_WISE,
    ShardingType.TABLE_ROW_WISE,
    ShardingType.ROW_WISE,
    ShardingType.DATA_PARALLEL,
)
# Optimizers whose update of an element depends only on that element (and the step): column
# blocks then train exactly like the whole table.
COLUMN_SPLIT_EXACT = frozenset({EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.ADAM})
UVM_KERNELS = (EmbeddingComputeKernel.FUSED_UVM_CACHING, EmbeddingComputeKernel.FUSED_UVM)
TRAINING_KERNELS = (EmbeddingComputeKernel.FUSED, *UVM_KERNELS)


def planner_kernels(topology: Topology) -> tuple[EmbeddingComputeKernel, ...]:
    """The kernels the planner may choose on ``topology``, in order of preference (fastest
    memory first; see the module docstring)."""
    if topology.is_cuda:
        return TRAINING_KERNELS
    if topology.ssd_per_rank > 0:
        return (EmbeddingComputeKernel.FUSED, EmbeddingComputeKernel.FUSED_UVM_CACHING)
    return (EmbeddingComputeKernel.FUSED,)


def enumerate_options(
    table: TableSpec, sharder: Sharder, topology: Topology, with_perf: bool = False,
    memory_only: bool = False,
) -> list[Candidate]:
    """Every candidate of ``table`` with its per-shard estimates, in preference order
    (``with_perf``: also its cost by phase, ``Candidate.perf``). ``memory_only``: leave out the
    kernels over slower memory (cached, UVM) unless the table's constraints name its kernels:
    the planner's first try where memory clearly suffices."""
    options = []
    refused: dict[ShardingType, list[str]] = {}  # types whose sharder runs none of the kernels
    for sharding_type in allowed_sharding_types(table, sharder, topology):
        kernels = allowed_kernels(table, sharding_type, sharder, topology)
        if memory_only and table.constraints.compute_kernels is None:
            kernels = [k for k in kernels if k not in UVM_KERNELS] or kernels
        if not kernels:
            refused[sharding_type] = sharder.compute_kernels(
                sharding_type.value, topology.compute_device
            )
        for placement, rows, cols in _geometries(table, sharding_type, topology):
            for kernel in kernels:
                options.append(
                    estimate_option(
                        table, sharding_type, kernel, placement, rows, cols, topology, with_perf
                    )
                )
    requested = table.constraints.compute_kernels
    if not options and requested is not None and refused:
        runs = "; ".join(f"{t.value}: {sorted(k)}" for t, k in refused.items())
        hbm = " with enforce_hbm (fused only)" if table.constraints.enforce_hbm else ""
        raise PlannerError(
            f"table {table.name!r}: constraints allow compute kernels "
            f"{[k.value for k in requested]}{hbm}, but no allowed sharding type runs one: "
            f"{type(sharder).__name__} runs only ({runs}) on {topology.compute_device}, and "
            "data-parallel replicas are never cached; allow one of those",
            PlannerErrorType.STRICT_CONSTRAINTS
        )
    if not options:
        raise PlannerError(
            f"table {table.name!r}: no layout satisfies its constraints and sharder on this "
            f"topology ({topology.world_size} ranks, {topology.local_size} per host); relax "
            "ParameterConstraints.sharding_types / compute_kernels for it",
            PlannerErrorType.STRICT_CONSTRAINTS
        )
    return options


def allowed_sharding_types(
    table: TableSpec, sharder: Sharder, topology: Topology
) -> list[ShardingType]:
    device = topology.compute_device
    supported = [ShardingType(t) for t in sharder.sharding_types(device)]
    requested = table.constraints.sharding_types
    if requested is not None:
        unsupported = [t.value for t in requested if t not in supported]
        if unsupported:
            raise PlannerError(
                f"table {table.name!r}: constraints ask for sharding types {unsupported}, which "
                f"{type(sharder).__name__} does not support on {device} (it supports "
                f"{[t.value for t in supported]}); choose among those",
                PlannerErrorType.STRICT_CONSTRAINTS
            )
        return [t for t in SHARDING_TYPE_ORDER if t in requested]
    config = table.config
    table_bytes = config.num_embeddings * config.embedding_dim * DATA_TYPE_BITS[config.data_type] / 8
    dropped = set()
    if table_bytes > DATA_PARALLEL_MAX_BYTES:
        dropped.add(ShardingType.DATA_PARALLEL)
    if topology.world_size == 1:
        dropped |= {ShardingType.ROW_WISE, ShardingType.COLUMN_WISE}
    if topology.num_hosts == 1:
        dropped |= {ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE}
    if table.optimizer.canonical not in COLUMN_SPLIT_EXACT:
        dropped |= {ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE}
    kept = [t for t in SHARDING_TYPE_ORDER if t in supported and t not in dropped]
    # A sharder that runs only dropped types (e.g. column-wise on one rank) still gets them,
    # as TorchRec's planner gives them: better a redundant layout than no plan.
    return kept or [t for t in SHARDING_TYPE_ORDER if t in supported]


def allowed_kernels(
    table: TableSpec, sharding_type: ShardingType, sharder: Sharder, topology: Topology
) -> list[EmbeddingComputeKernel]:
    """The kernels ``table`` may use split by ``sharding_type``, in order of preference: the
    planner's (:func:`planner_kernels`) that its constraints allow and its sharder runs.

    Raises PlannerError when the constraints ask for a kernel the topology cannot have."""
    device = topology.compute_device
    constraints = table.constraints
    requested = constraints.compute_kernels
    if requested is not None:
        _check_requested(table.name, requested, topology)
    kernels = [k for k in planner_kernels(topology) if requested is None or k in requested]
    if constraints.enforce_hbm or sharding_type is ShardingType.DATA_PARALLEL:
        kernels = [k for k in kernels if k is EmbeddingComputeKernel.FUSED]
    supported = {
        EmbeddingComputeKernel(k) for k in sharder.compute_kernels(sharding_type.value, device)
    }
    chosen = [k for k in kernels if k in supported]
    dense = EmbeddingComputeKernel.DENSE
    if not chosen and dense in supported and (requested is None or dense in requested):
        # TorchRec's rule: DENSE (weights as parameters, stepped by the dense optimizer) when
        # the sharder offers it and no fused kernel (e.g. a sharder of DENSE only)
        return [dense]
    return chosen


def _check_requested(
    name: str, requested: list[EmbeddingComputeKernel], topology: Topology
) -> None:
    allowed = (*TRAINING_KERNELS, EmbeddingComputeKernel.DENSE)
    not_fused = [k.value for k in requested if k not in allowed]
    if not_fused:
        raise PlannerError(
            f"table {name!r}: constraints ask for compute kernels {not_fused}; training plans "
            "use fused kernels: fused, fused_uvm_caching, or fused_uvm (CUDA only), or dense "
            "(where the sharder offers it)",
            PlannerErrorType.STRICT_CONSTRAINTS
        )
    if topology.is_cuda:
        return
    if EmbeddingComputeKernel.FUSED_UVM in requested:
        raise PlannerError(
            f"table {name!r}: constraints ask for compute kernel fused_uvm on a CPU topology; "
            "on CPU a table too large for memory lives on local disk, and without a cache every "
            "lookup would read the disk: use fused_uvm_caching (a cache in RAM over files on "
            "disk; give the Topology an ssd_cap) or EmbeddingComputeKernel.FUSED",
            PlannerErrorType.STRICT_CONSTRAINTS
        )
    if EmbeddingComputeKernel.FUSED_UVM_CACHING in requested and topology.ssd_per_rank == 0:
        raise PlannerError(
            f"table {name!r}: constraints ask for compute kernel fused_uvm_caching on a CPU "
            "topology without disk (ssd_cap 0); on CPU the cached kernel keeps the table in "
            "files on local disk behind a cache in RAM: give the Topology an ssd_cap (bytes of "
            "disk per rank) or use detect_topology(offload_dir=...), or use "
            "EmbeddingComputeKernel.FUSED",
            PlannerErrorType.STRICT_CONSTRAINTS
        )


def column_counts(dim: int, min_partition: int, max_shards: int) -> list[int]:
    """Numbers of equal column blocks ``k >= 2`` (``dim % k == 0``, width >= min_partition,
    ``k <= max_shards``); widths that are a multiple of 4 only, when there are any.

    ``column_counts(128, 32, 8) == [2, 4]``; ``column_counts(24, 4, 8) == [2, 3, 6]``.
    """
    counts = [
        k for k in range(2, min(max_shards, dim) + 1) if dim % k == 0 and dim // k >= min_partition
    ]
    aligned = [k for k in counts if (dim // k) % 4 == 0]
    return aligned or counts


def torchrec_column_block(dim: int, min_partition: int) -> int:
    """TorchRec's column block width: the narrowest divisor of ``dim`` that is at least
    ``min_partition`` and a multiple of 4, else ``dim``: ``torchrec_column_block(24, 4) == 4``,
    ``torchrec_column_block(24, 5) == 8``, ``torchrec_column_block(10, 4) == 10``."""
    for width in range(min_partition, dim):
        if dim % width == 0 and width % 4 == 0:
            return width
    return dim


def row_block_sizes(rows: int, num_shards: int) -> np.ndarray:
    """The sizes of :func:`row_blocks` (blocks of ``ceil(rows / n)``, trailing ones short or
    empty), computed with numpy: ``row_block_sizes(10, 4) == [3, 3, 3, 1]``."""
    block = -(-rows // num_shards)
    starts = np.minimum(np.arange(num_shards) * block, rows)
    return np.minimum(starts + block, rows) - starts


def _geometries(
    table: TableSpec, sharding_type: ShardingType, topology: Topology
) -> list[tuple[Placement, np.ndarray, np.ndarray]]:
    """(placement, shard rows, shard cols) of each candidate geometry of ``sharding_type``."""
    rows, dim = table.config.num_embeddings, table.config.embedding_dim
    world, local = topology.world_size, topology.local_size
    min_partition = table.constraints.min_partition or DEFAULT_MIN_PARTITION

    def blocks(n: int) -> np.ndarray:
        return row_block_sizes(rows, n)

    def columns(k: int) -> tuple[np.ndarray, np.ndarray]:
        return np.full(k, rows), np.full(k, dim // k)

    if sharding_type is ShardingType.TABLE_WISE:
        return [(Placement.ANY_RANKS, np.array([rows]), np.array([dim]))]
    if sharding_type in (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE):
        limit = world if sharding_type is ShardingType.COLUMN_WISE else local
        # One block (the whole width) only when no split is possible: it is a table-wise shard.
        counts = column_counts(dim, min_partition, limit) or [1]
        if world == 1 and sharding_type is ShardingType.COLUMN_WISE and table.constraints.min_partition:
            # One rank (asked for column-wise anyway): TorchRec's blocks of the narrowest
            # width >= min_partition that divides dim and is a multiple of 4, all on that rank.
            counts = [dim // torchrec_column_block(dim, table.constraints.min_partition)]
        placement = (
            Placement.ANY_RANKS if sharding_type is ShardingType.COLUMN_WISE else Placement.ANY_HOST
        )
        return [(placement, *columns(k)) for k in counts]
    if sharding_type is ShardingType.ROW_WISE:
        return [(Placement.ALL_RANKS, blocks(world), np.full(world, dim))]
    if sharding_type is ShardingType.TABLE_ROW_WISE:
        return [(Placement.ANY_HOST, blocks(local), np.full(local, dim))]
    return [(Placement.ALL_RANKS, np.full(world, rows), np.full(world, dim))]  # data-parallel
