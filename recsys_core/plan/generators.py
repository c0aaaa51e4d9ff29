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

from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.plan.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingType,
    ShardMetadata,
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


def _sharding(
    sharding_type: ShardingType,
    compute_kernel: EmbeddingComputeKernel,
    shards: list[_Shard],
    local_size: int,
    device_type: str,
) -> ParameterSharding:
    device_type = torch.device(device_type).type  # "cuda:0" -> "cuda": the index is per rank
    return ParameterSharding(
        sharding_type=sharding_type,
        compute_kernel=compute_kernel,
        ranks=[rank for _, _, rank in shards],
        sharding_spec=[
            ShardMetadata(offsets, sizes, _placement(rank, local_size, device_type))
            for offsets, sizes, rank in shards
        ],
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
            f"blocks (one per rank in {list(ranks)}); use a number of ranks that divides {dim}"
        )
    width = dim // n
    return [([0, j * width], [config.num_embeddings, width], r) for j, r in enumerate(ranks)]


def _row_shards(config: BaseEmbeddingConfig, ranks: Sequence[int]) -> list[_Shard]:
    blocks = row_blocks(config.num_embeddings, len(ranks))
    dim = config.embedding_dim
    return [([off, 0], [size, dim], r) for (off, size), r in zip(blocks, ranks, strict=True)]


def table_wise(
    rank: int, compute_kernel: EmbeddingComputeKernel = EmbeddingComputeKernel.FUSED
) -> ParameterShardingGenerator:
    """The whole table on ``rank``: a 4096 x 64 table -> one shard ``[0, 0] / [4096, 64]``."""

    def generate(
        config: BaseEmbeddingConfig, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        shard = ([0, 0], [config.num_embeddings, config.embedding_dim], rank)
        return _sharding(ShardingType.TABLE_WISE, compute_kernel, [shard], local_size, device_type)

    return generate


def row_wise(
    compute_kernel: EmbeddingComputeKernel = EmbeddingComputeKernel.FUSED,
) -> ParameterShardingGenerator:
    """Row blocks on ALL ranks (:func:`row_blocks`): 10 x 8 over 4 ranks -> rows 3, 3, 3, 1."""

    def generate(
        config: BaseEmbeddingConfig, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        shards = _row_shards(config, range(world_size))
        return _sharding(ShardingType.ROW_WISE, compute_kernel, shards, local_size, device_type)

    return generate


def column_wise(
    ranks: list[int], compute_kernel: EmbeddingComputeKernel = EmbeddingComputeKernel.FUSED
) -> ParameterShardingGenerator:
    """``embedding_dim`` in ``len(ranks)`` equal blocks, block ``j`` on ``ranks[j]``.

    A rank may appear twice (it then holds two blocks). 10 x 8 with ``ranks=[0, 1]`` ->
    ``[0, 0] / [10, 4]`` on rank 0 and ``[0, 4] / [10, 4]`` on rank 1.
    """
    if not ranks:
        raise ValueError("column_wise: ranks is empty; give at least one rank per column block")
    ranks = list(ranks)

    def generate(
        config: BaseEmbeddingConfig, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        shards = _column_shards(config, ranks)
        return _sharding(ShardingType.COLUMN_WISE, compute_kernel, shards, local_size, device_type)

    return generate


def data_parallel(
    compute_kernel: EmbeddingComputeKernel = EmbeddingComputeKernel.FUSED,
) -> ParameterShardingGenerator:
    """A full replica on every rank; ``sharding_spec`` is None (nothing is split)."""

    def generate(
        config: BaseEmbeddingConfig, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        return ParameterSharding(
            sharding_type=ShardingType.DATA_PARALLEL,
            compute_kernel=compute_kernel,
            ranks=list(range(world_size)),
            sharding_spec=None,
        )

    return generate


def table_row_wise(
    host_index: int, compute_kernel: EmbeddingComputeKernel = EmbeddingComputeKernel.FUSED
) -> ParameterShardingGenerator:
    """Row blocks (:func:`row_blocks`) over the ranks of one host, so row traffic stays local.

    World 4 with 2 ranks per host, ``host_index=1``: a 10-row table -> rows [0, 5) on rank 2,
    rows [5, 10) on rank 3.
    """

    def generate(
        config: BaseEmbeddingConfig, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        ranks = _host_ranks(host_index, local_size, world_size, config.name)
        shards = _row_shards(config, ranks)
        return _sharding(
            ShardingType.TABLE_ROW_WISE, compute_kernel, shards, local_size, device_type
        )

    return generate


def table_column_wise(
    host_index: int,
    compute_kernel: EmbeddingComputeKernel = EmbeddingComputeKernel.FUSED,
    ranks_per_table: int | None = None,
) -> ParameterShardingGenerator:
    """Equal column blocks on the first ``ranks_per_table`` ranks of one host (default: all).

    World 4, 2 ranks per host, ``host_index=1``: dim 8 -> columns [0, 4) on rank 2, [4, 8) on 3.
    """

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
        return _sharding(
            ShardingType.TABLE_COLUMN_WISE, compute_kernel, shards, local_size, device_type
        )

    return generate


def construct_module_sharding_plan(
    module: EmbeddingModule,
    per_param_sharding: Mapping[str, ParameterShardingGenerator],
    world_size: int,
    local_size: int | None = None,
    device_type: str = "cpu",
    *,
    inference: bool = False,
) -> EmbeddingModuleShardingPlan:
    """Apply a generator to each named table and validate the plan.

    Keys are table names. Tables without a generator are left out of the plan (not sharded).
    ``local_size`` defaults to ``LOCAL_WORLD_SIZE`` (set by torchrun), else ``world_size``.
    ``inference=True`` expects QUANT kernels (see :func:`validate_module_sharding_plan`).
    """
    configs = table_configs(module)
    names = [c.name for c in configs]
    unknown = [name for name in per_param_sharding if name not in names]
    if unknown:
        raise ValueError(
            f"per_param_sharding names {unknown}, which are not tables of this "
            f"{type(module).__name__} (its tables: {names}); use these table names as keys"
        )
    local_size = resolve_local_size(world_size, local_size)
    plan = EmbeddingModuleShardingPlan({
        c.name: per_param_sharding[c.name](c, local_size, world_size, device_type)
        for c in configs
        if c.name in per_param_sharding
    })
    validate_module_sharding_plan(configs, plan, world_size, local_size, inference=inference)
    return plan
