"""Hand-written sharding plans: per-table generators and a checked module plan builder.

TorchRec's ``torchrec.distributed.sharding_plan`` names. A generator says how one table is split;
:func:`construct_module_sharding_plan` applies generators to a module's tables and checks the
result with :func:`validate_module_sharding_plan`, which a sharder also runs before any
communication, so a bad plan fails with a message instead of a hang or a wrong answer.

Example (2 ranks on one host)::

    plan = construct_module_sharding_plan(
        ebc,
        {"product_table": row_wise(), "user_table": table_wise(rank=1)},
        world_size=2,
    )
    # product_table 4096 x 64 -> rows [0, 2048) on rank 0, rows [2048, 4096) on rank 1
    # user_table    4096 x 64 -> the whole table on rank 1

Everything here is pure: no process group, no tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.plan.sharder import Sharder
from recsys_core.plan.spec import EnumerableShardingSpec, ShardMetadata
from recsys_core.plan.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingType,
    device_placement,
)
from recsys_core.plan.validation import (
    EmbeddingModule,
    resolve_local_size,
    table_configs,
    validate_module_sharding_plan,
)


class ParameterShardingGenerator(Protocol):
    """Makes one table's :class:`ParameterSharding` once the topology is known."""

    def __call__(
        self, config: BaseEmbeddingConfig, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding: ...


# One shard before placement: (offsets [row, col], sizes [rows, cols], rank).
_Shard = tuple[list[int], list[int], int]


def row_blocks(rows: int, num_shards: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of each row block under TorchRec's rule: blocks of ``ceil(rows / n)``.

    Shard ``i`` covers ``[i * block, min((i + 1) * block, rows))``. Trailing shards may be
    smaller or EMPTY; an empty shard is kept (at offset ``rows``) so that every rank has one::

        row_blocks(10, 4) == [(0, 3), (3, 3), (6, 3), (9, 1)]   # block 3, last one short
        row_blocks(2, 4)  == [(0, 1), (1, 1), (2, 0), (2, 0)]   # ranks 2 and 3 hold no rows
    """
    if num_shards < 1:
        raise ValueError(f"row_blocks: num_shards must be >= 1, got {num_shards}")
    block = -(-rows // num_shards)
    return [
        (min(i * block, rows), max(0, min((i + 1) * block, rows) - i * block))
        for i in range(num_shards)
    ]


def _placement(rank: int, local_size: int, device_type: str) -> str:
    # device_placement() would use the global rank as the CUDA index; on a multi-host job a
    # rank's GPU is its local rank, so pass the index explicitly.
    if device_type == "cuda":
        return device_placement(rank, torch.device("cuda", rank % local_size))
    return device_placement(rank, device_type)


def _kernel(value: EmbeddingComputeKernel | str | None) -> EmbeddingComputeKernel:
    """A generator's compute kernel: an enum or its value, None for FUSED."""
    return EmbeddingComputeKernel.FUSED if value is None else EmbeddingComputeKernel(value)


def _sharding(
    sharding_type: ShardingType,
    compute_kernel: EmbeddingComputeKernel,
    shards: list[_Shard],
    local_size: int,
    device_type: str | Sequence[str],
) -> ParameterSharding:
    """``device_type``: one for all shards, or one per shard ("cuda:0" counts as "cuda": the
    index is each rank's local index)."""
    types = [device_type] * len(shards) if isinstance(device_type, str) else list(device_type)
    types = [torch.device(t).type for t in types]
    return ParameterSharding(
        sharding_type=sharding_type,
        compute_kernel=compute_kernel,
        ranks=[rank for _, _, rank in shards],
        sharding_spec=EnumerableShardingSpec([
            ShardMetadata(offsets, sizes, _placement(rank, local_size, kind))
            for (offsets, sizes, rank), kind in zip(shards, types, strict=True)
        ]),
    )


def _host_ranks(host_index: int, local_size: int, world_size: int, table: str) -> list[int]:
    num_hosts = world_size // local_size
    if not 0 <= host_index < num_hosts:
        raise ValueError(
            f"table {table!r}: host_index {host_index} is outside [0, {num_hosts}) "
            f"(world_size {world_size}, {local_size} ranks per host); pick an existing host"
        )
    return list(range(host_index * local_size, (host_index + 1) * local_size))


def _column_shards(config: BaseEmbeddingConfig, ranks: Sequence[int]) -> list[_Shard]:
    dim, n = config.embedding_dim, len(ranks)
    if dim % n:
        raise ValueError(
            f"table {config.name!r}: embedding_dim {dim} does not split into {n} equal column "
            f"blocks (one per rank in {list(ranks)}); use a number of ranks that divides {dim}, "
            "or give size_per_rank"
        )
    width = dim // n
    return [([0, j * width], [config.num_embeddings, width], r) for j, r in enumerate(ranks)]


def _row_shards(config: BaseEmbeddingConfig, ranks: Sequence[int]) -> list[_Shard]:
    blocks = row_blocks(config.num_embeddings, len(ranks))
    dim = config.embedding_dim
    return [([off, 0], [size, dim], r) for (off, size), r in zip(blocks, ranks, strict=True)]


def _given_blocks(total: int, sizes: Sequence[int], table: str, what: str) -> list[tuple[int, int]]:
    """``(offset, size)`` of consecutive blocks of the given sizes, the last ones cut at
    ``total`` (as TorchRec); an error if they do not reach it."""
    blocks, end = [], 0
    for size in sizes:
        start, end = end, min(end + int(size), total)
        blocks.append((start, end - start))
    if end < total:
        raise ValueError(
            f"table {table!r}: {what} {list(sizes)} cover {end} of its {total}; give sizes that "
            f"add up to at least {total}"
        )
    return blocks


def table_wise(
    rank: int,
    device: str | None = None,
    compute_kernel: EmbeddingComputeKernel | str | None = None,
) -> ParameterShardingGenerator:
    """The whole table on ``rank``: a 4096 x 64 table -> one shard ``[0, 0] / [4096, 64]``.

    ``device`` ("cpu" or "cuda") overrides the plan's device type for this table;
    ``compute_kernel`` defaults to FUSED. (A kernel as second positional argument is read as
    ``compute_kernel``, this library's earlier order.)
    """
    if isinstance(device, EmbeddingComputeKernel):
        device, compute_kernel = None, device
    kernel = _kernel(compute_kernel)

    def generate(
        config: BaseEmbeddingConfig, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        shard = ([0, 0], [config.num_embeddings, config.embedding_dim], rank)
        return _sharding(
            ShardingType.TABLE_WISE, kernel, [shard], local_size, device or device_type
        )

    return generate


def row_wise(
    sizes_placement: tuple[Sequence[int], str | Sequence[str]] | None = None,
    compute_kernel: EmbeddingComputeKernel | str | None = None,
) -> ParameterShardingGenerator:
    """Row blocks on ALL ranks (:func:`row_blocks`): 10 x 8 over 4 ranks -> rows 3, 3, 3, 1.

    ``sizes_placement=(sizes, device)`` (TorchRec's, for inference): rank ``i`` holds the next
    ``sizes[i]`` rows (cut at the table's end) on ``device`` (one for all, or one per rank),
    with the QUANT kernel: ``([6, 4], "cpu")`` on a 10-row table -> rows [0, 6) on rank 0, [6, 10)
    on rank 1. (A kernel as first positional argument is read as ``compute_kernel``.)
    """
    if isinstance(sizes_placement, EmbeddingComputeKernel):
        sizes_placement, compute_kernel = None, sizes_placement
    if sizes_placement is not None:
        sizes, devices = sizes_placement
        if not isinstance(devices, str) and len(devices) != len(sizes):
            raise ValueError(
                f"row_wise: sizes_placement has {len(sizes)} sizes but {len(devices)} devices; "
                "give one device per size, or one for all"
            )
        compute_kernel = EmbeddingComputeKernel.QUANT  # as TorchRec: uneven rows are inference
    kernel = _kernel(compute_kernel)

    def generate(
        config: BaseEmbeddingConfig, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        if sizes_placement is None:
            shards = _row_shards(config, range(world_size))
            return _sharding(ShardingType.ROW_WISE, kernel, shards, local_size, device_type)
        blocks = _given_blocks(config.num_embeddings, sizes, config.name, "row sizes")
        dim = config.embedding_dim
        shards = [([off, 0], [size, dim], r) for r, (off, size) in enumerate(blocks)]
        return _sharding(ShardingType.ROW_WISE, kernel, shards, local_size, devices)

    return generate


def column_wise(
    ranks: Sequence[int] | None = None,
    size_per_rank: Sequence[int] | None = None,
    compute_kernel: EmbeddingComputeKernel | str | None = None,
    device_types: Sequence[str] | None = None,
) -> ParameterShardingGenerator:
    """Column blocks, block ``j`` on ``ranks[j]`` (a rank may appear twice).

    Without ``size_per_rank``: ``len(ranks)`` equal blocks; 10 x 8 with ``ranks=[0, 1]`` ->
    ``[0, 0] / [10, 4]`` on rank 0 and ``[0, 4] / [10, 4]`` on rank 1. With it: block ``j`` is
    the next ``size_per_rank[j]`` columns (cut at the table's width), on ``ranks[j]`` (default
    ``j``); 10 x 8 with ``size_per_rank=[2, 6]`` -> ``[10, 2]`` on rank 0, ``[10, 6]`` at
    column 2 on rank 1. ``device_types`` gives each block's device type. (A kernel as second
    positional argument is read as ``compute_kernel``.)
    """
    if isinstance(size_per_rank, EmbeddingComputeKernel):
        size_per_rank, compute_kernel = None, size_per_rank
    if size_per_rank is None and not ranks:
        raise ValueError("column_wise: ranks is empty; give at least one rank per column block")
    count = len(size_per_rank) if size_per_rank is not None else len(ranks or [])
    block_ranks = list(ranks) if ranks else list(range(count))
    if len(block_ranks) != count:
        raise ValueError(
            f"column_wise: {len(block_ranks)} ranks for {count} sizes in size_per_rank; give "
            "one rank per size"
        )
    if device_types is not None and len(device_types) != count:
        raise ValueError(
            f"column_wise: {len(device_types)} device_types for {count} column blocks; give one "
            "per block"
        )
    kernel = _kernel(compute_kernel)

    def generate(
        config: BaseEmbeddingConfig, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        if size_per_rank is None:
            shards = _column_shards(config, block_ranks)
        else:
            blocks = _given_blocks(config.embedding_dim, size_per_rank, config.name, "column sizes")
            rows = config.num_embeddings
            shards = [([0, off], [rows, size], r)
                      for (off, size), r in zip(blocks, block_ranks, strict=True)]
        devices = device_types if device_types is not None else device_type
        return _sharding(ShardingType.COLUMN_WISE, kernel, shards, local_size, devices)

    return generate


def data_parallel(
    compute_kernel: EmbeddingComputeKernel | str | None = None,
) -> ParameterShardingGenerator:
    """A full replica on every rank; ``sharding_spec`` is None (nothing is split)."""
    kernel = _kernel(compute_kernel)

    def generate(
        config: BaseEmbeddingConfig, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        return ParameterSharding(
            sharding_type=ShardingType.DATA_PARALLEL,
            compute_kernel=kernel,
            ranks=list(range(world_size)),
            sharding_spec=None,
        )

    return generate


def table_row_wise(
    host_index: int, compute_kernel: EmbeddingComputeKernel | str | None = None
) -> ParameterShardingGenerator:
    """Row blocks (:func:`row_blocks`) over the ranks of one host, so row traffic stays local.

    World 4 with 2 ranks per host, ``host_index=1``: a 10-row table -> rows [0, 5) on rank 2,
    rows [5, 10) on rank 3.
    """
    kernel = _kernel(compute_kernel)

    def generate(
        config: BaseEmbeddingConfig, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        ranks = _host_ranks(host_index, local_size, world_size, config.name)
        shards = _row_shards(config, ranks)
        return _sharding(ShardingType.TABLE_ROW_WISE, kernel, shards, local_size, device_type)

    return generate


def table_column_wise(
    host_index: int,
    compute_kernel: EmbeddingComputeKernel | str | None = None,
    ranks_per_table: int | None = None,
) -> ParameterShardingGenerator:
    """Equal column blocks on the first ``ranks_per_table`` ranks of one host (default: all).

    World 4, 2 ranks per host, ``host_index=1``: dim 8 -> columns [0, 4) on rank 2, [4, 8) on 3.
    """
    kernel = _kernel(compute_kernel)

    def generate(
        config: BaseEmbeddingConfig, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        ranks = _host_ranks(host_index, local_size, world_size, config.name)
        count = local_size if ranks_per_table is None else ranks_per_table
        if not 1 <= count <= local_size:
            raise ValueError(
                f"table {config.name!r}: ranks_per_table {count} is outside [1, {local_size}] "
                f"(the ranks of one host); use at most {local_size}"
            )
        shards = _column_shards(config, ranks[:count])
        return _sharding(ShardingType.TABLE_COLUMN_WISE, kernel, shards, local_size, device_type)

    return generate


def construct_module_sharding_plan(
    module: EmbeddingModule | Sequence[BaseEmbeddingConfig],
    per_param_sharding: Mapping[str, ParameterShardingGenerator],
    sharder: Sharder | int | None = None,
    local_size: int | None = None,
    world_size: int | str | None = None,
    device_type: str | None = None,
    *,
    inference: bool | None = None,
) -> EmbeddingModuleShardingPlan:
    """Apply a generator to each named table and validate the plan (TorchRec's arguments).

    Keys are table names; tables without a generator are left out of the plan (not sharded).
    ``sharder``, if given, must handle the module. ``local_size`` defaults to
    ``LOCAL_WORLD_SIZE`` (set by torchrun), else ``world_size``; ``world_size`` to the default
    process group's size; ``device_type`` to "cuda" when CUDA is available, else "cpu".
    ``inference`` (default: whether any table uses the QUANT kernel) expects QUANT kernels for
    every table (see :func:`validate_module_sharding_plan`).

    This library's earlier order ``(module, per_param_sharding, world_size, local_size,
    device_type)`` is still read: an int third argument is the world size.
    """
    if isinstance(sharder, int) and not isinstance(sharder, bool):
        legacy_device = world_size if isinstance(world_size, str) else device_type
        sharder, world_size, device_type = None, sharder, legacy_device
    configs = table_configs(module)
    if sharder is not None and isinstance(module, torch.nn.Module):
        if not isinstance(module, sharder.module_type):
            raise ValueError(
                f"construct_module_sharding_plan: {type(sharder).__name__} shards "
                f"{sharder.module_type.__name__}, not {type(module).__name__}; pass its sharder "
                "or none"
            )
    names = [c.name for c in configs]
    unknown = [name for name in per_param_sharding if name not in names]
    if unknown:
        raise ValueError(
            f"per_param_sharding names {unknown}, which are not tables of this "
            f"{type(module).__name__} (its tables: {names}); use these table names as keys"
        )
    if world_size is None:
        if not dist.is_initialized():
            raise ValueError(
                "construct_module_sharding_plan: no world_size and no process group to take it "
                "from; pass world_size (and local_size for several hosts)"
            )
        world_size = dist.get_world_size()
    if isinstance(world_size, str):
        raise ValueError(f"construct_module_sharding_plan: world_size {world_size!r} is not an int")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    local_size = resolve_local_size(world_size, local_size)
    plan = EmbeddingModuleShardingPlan({
        c.name: per_param_sharding[c.name](c, local_size, world_size, device_type)
        for c in configs
        if c.name in per_param_sharding
    })
    if inference is None:
        inference = any(ps.compute_kernel is EmbeddingComputeKernel.QUANT for ps in plan.values())
    validate_module_sharding_plan(configs, plan, world_size, local_size, inference=inference)
    return plan
