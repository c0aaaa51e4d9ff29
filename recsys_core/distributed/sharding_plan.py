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

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from recsys_core.distributed.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingType,
    ShardMetadata,
    device_placement,
)
from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection

# Kernels a training plan may use: each one fuses the optimizer into the backward pass.
TRAINING_KERNELS = frozenset({
    EmbeddingComputeKernel.FUSED,
    EmbeddingComputeKernel.FUSED_UVM,
    EmbeddingComputeKernel.FUSED_UVM_CACHING,
})

EmbeddingModule = EmbeddingBagCollection | EmbeddingCollection | FusedEmbeddingBagCollection


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


def _table_configs(
    module_or_configs: EmbeddingModule | Sequence[BaseEmbeddingConfig],
) -> list[BaseEmbeddingConfig]:
    if isinstance(module_or_configs, EmbeddingBagCollection | FusedEmbeddingBagCollection):
        return list(module_or_configs.embedding_bag_configs())
    if isinstance(module_or_configs, EmbeddingCollection):
        return list(module_or_configs.embedding_configs())
    if isinstance(module_or_configs, torch.nn.Module):
        raise TypeError(
            f"sharding plans cover EmbeddingBagCollection, FusedEmbeddingBagCollection and "
            f"EmbeddingCollection, got a {type(module_or_configs).__name__}; pass one of those "
            "(or its list of table configs)"
        )
    return list(module_or_configs)


def _resolve_local_size(world_size: int, local_size: int | None) -> int:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if local_size is None:
        # As TorchRec: the ranks per host that torchrun exports, else one host.
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local_size < 1 or world_size % local_size:
        raise ValueError(
            f"local_size {local_size} does not divide world_size {world_size}; pass the number "
            "of ranks per host as local_size"
        )
    return local_size


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
    configs = _table_configs(module)
    names = [c.name for c in configs]
    unknown = [name for name in per_param_sharding if name not in names]
    if unknown:
        raise ValueError(
            f"per_param_sharding names {unknown}, which are not tables of this "
            f"{type(module).__name__} (its tables: {names}); use these table names as keys"
        )
    local_size = _resolve_local_size(world_size, local_size)
    plan = EmbeddingModuleShardingPlan({
        c.name: per_param_sharding[c.name](c, local_size, world_size, device_type)
        for c in configs
        if c.name in per_param_sharding
    })
    validate_module_sharding_plan(configs, plan, world_size, local_size, inference=inference)
    return plan


def validate_module_sharding_plan(
    module_or_configs: EmbeddingModule | Sequence[BaseEmbeddingConfig],
    plan: EmbeddingModuleShardingPlan,
    world_size: int,
    local_size: int,
    *,
    inference: bool = False,
) -> None:
    """Raise ValueError, naming the table, for any plan entry a sharder could not execute.

    Checked, before any communication: the table exists; every rank (in ``ranks`` and in each
    placement) is in ``[0, world_size)``; ``ranks`` lists the shard placements in order; the
    shards tile the ``[rows, dim]`` table exactly, in order (row-wise: row ranges back to back
    over ``[0, rows)`` at full width, on ranks ``0..world_size-1``; table-row-wise: the same over
    all ranks of one host; column-wise: column ranges back to back over ``[0, dim)`` at full
    height; table-wise: one full shard; data-parallel: no spec, all ranks); table-row/column-wise
    shards stay on one host; training plans use fused kernels, inference plans QUANT.
    """
    local_size = _resolve_local_size(world_size, local_size)
    configs = {c.name: c for c in _table_configs(module_or_configs)}
    for name, sharding in plan.items():
        config = configs.get(name)
        if config is None:
            raise ValueError(
                f"the sharding plan has table {name!r}, which the module does not have (its "
                f"tables: {list(configs)}); remove it from the plan or fix its name"
            )
        where = f"table {name!r} ({sharding.sharding_type})"
        _check_kernel(where, sharding.compute_kernel, inference)
        _check_ranks(where, sharding, world_size)
        _CHECKS[sharding.sharding_type](where, config, sharding, world_size, local_size)


def _check_kernel(where: str, kernel: EmbeddingComputeKernel, inference: bool) -> None:
    if inference:
        if kernel is not EmbeddingComputeKernel.QUANT:
            raise ValueError(
                f"{where}: compute kernel {kernel} in an inference plan; quantized inference "
                "shards use EmbeddingComputeKernel.QUANT"
            )
        return
    if kernel is EmbeddingComputeKernel.QUANT:
        raise ValueError(
            f"{where}: compute kernel quant is for inference (quantized tables cannot train); "
            "use EmbeddingComputeKernel.FUSED for training"
        )
    if kernel not in TRAINING_KERNELS:
        raise ValueError(
            f"{where}: compute kernel {kernel} is not supported; only fused kernels are supported "
            "for training: use EmbeddingComputeKernel.FUSED (or FUSED_UVM / FUSED_UVM_CACHING)"
        )


def _check_ranks(where: str, sharding: ParameterSharding, world_size: int) -> None:
    for rank in sharding.ranks:
        if not 0 <= rank < world_size:
            raise ValueError(
                f"{where}: rank {rank} in ranks {sharding.ranks} is outside [0, {world_size}); "
                f"place shards on ranks 0..{world_size - 1}"
            )
    if sharding.sharding_spec is None:
        return
    placed = []
    for i, shard in enumerate(sharding.sharding_spec):
        try:
            rank = shard.rank
        except ValueError as exc:
            raise ValueError(
                f"{where}: shard {i} has placement {shard.placement!r}; write it as "
                "'rank:<r>/<device>', e.g. 'rank:0/cpu'"
            ) from exc
        if not 0 <= rank < world_size:
            raise ValueError(
                f"{where}: shard {i} is placed on rank {rank} ({shard.placement!r}), outside "
                f"[0, {world_size}); place shards on ranks 0..{world_size - 1}"
            )
        placed.append(rank)
    if placed != sharding.ranks:
        raise ValueError(
            f"{where}: ranks {sharding.ranks} do not match the shard placements {placed}; "
            "ranks must list each shard's rank in shard order"
        )


def _check_data_parallel(
    where: str, config: BaseEmbeddingConfig, sharding: ParameterSharding, world_size: int, _: int
) -> None:
    if sharding.sharding_spec is not None:
        raise ValueError(f"{where}: a data-parallel table has no shards; set sharding_spec=None")
    if sharding.ranks != list(range(world_size)):
        raise ValueError(
            f"{where}: data-parallel ranks are {sharding.ranks}; a replica lives on every rank, "
            f"so ranks must be {list(range(world_size))}"
        )


def _check_table_wise(
    where: str, config: BaseEmbeddingConfig, sharding: ParameterSharding, _: int, __: int
) -> None:
    full = [config.num_embeddings, config.embedding_dim]
    shards = sharding.shards
    if len(shards) != 1 or shards[0].shard_offsets != [0, 0] or shards[0].shard_sizes != full:
        got = [(s.shard_offsets, s.shard_sizes) for s in shards]
        raise ValueError(
            f"{where}: shards (offsets, sizes) are {got}; a table-wise table is one shard "
            f"[0, 0] / {full}; build it with table_wise(rank)"
        )


def _check_row_wise(
    where: str, config: BaseEmbeddingConfig, sharding: ParameterSharding, world_size: int, _: int
) -> None:
    # Ids are routed by row range to rank i = shard i, so every rank needs its (maybe empty) shard.
    if sharding.ranks != list(range(world_size)):
        raise ValueError(
            f"{where}: ranks are {sharding.ranks} but row-wise shards go on every rank in order, "
            f"{list(range(world_size))}; use table_row_wise(host_index) to use one host's ranks"
        )
    _check_tiling(where, config, sharding, axis=0)


def _check_one_host(where: str, sharding: ParameterSharding, local_size: int) -> list[int]:
    hosts = sorted({rank // local_size for rank in sharding.ranks})
    if len(hosts) != 1:
        raise ValueError(
            f"{where}: shards on ranks {sharding.ranks} span hosts {hosts} ({local_size} ranks "
            "per host); keep a table-row/column-wise table on the ranks of one host"
        )
    return list(range(hosts[0] * local_size, (hosts[0] + 1) * local_size))


def _check_table_row_wise(
    where: str, config: BaseEmbeddingConfig, sharding: ParameterSharding, _: int, local_size: int
) -> None:
    host_ranks = _check_one_host(where, sharding, local_size)
    if sharding.ranks != host_ranks:
        raise ValueError(
            f"{where}: ranks are {sharding.ranks} but table-row-wise shards go on every rank of "
            f"the host in order, {host_ranks}; build it with table_row_wise(host_index)"
        )
    _check_tiling(where, config, sharding, axis=0)


def _check_column_wise(
    where: str, config: BaseEmbeddingConfig, sharding: ParameterSharding, _: int, __: int
) -> None:
    _check_tiling(where, config, sharding, axis=1)


def _check_table_column_wise(
    where: str, config: BaseEmbeddingConfig, sharding: ParameterSharding, _: int, local_size: int
) -> None:
    _check_one_host(where, sharding, local_size)
    _check_tiling(where, config, sharding, axis=1)


def _check_tiling(
    where: str, config: BaseEmbeddingConfig, sharding: ParameterSharding, axis: int
) -> None:
    """Shards split ``axis`` (0 rows, 1 columns) back to back and span the other axis fully.

    An exact cover in shard order: e.g. rows of a 10-row table as [0, 3) [3, 6) [6, 9) [9, 10).
    Row shards may be empty (trailing ranks of :func:`row_blocks`; their offset is not checked);
    column shards may not.
    """
    shape = [config.num_embeddings, config.embedding_dim]
    other = 1 - axis
    unit = ("row", "rows") if axis == 0 else ("column", "columns")
    makers = "row_wise()/table_row_wise()" if axis == 0 else "column_wise()/table_column_wise()"
    fix = f"regenerate the plan with {makers}"
    if not sharding.shards:
        raise ValueError(f"{where}: the plan has no shards; {fix}")
    covered = 0
    for i, shard in enumerate(sharding.shards):
        offsets, sizes = shard.shard_offsets, shard.shard_sizes
        values = [*offsets, *sizes]
        if len(values) != 4 or any(type(v) is not int or v < 0 for v in values):
            raise ValueError(
                f"{where}: shard {i} has offsets {offsets} and sizes {sizes}; both must be two "
                f"non-negative ints [row, column]; {fix}"
            )
        if offsets[other] != 0 or sizes[other] != shape[other]:
            across = ("columns", "rows")[axis]
            raise ValueError(
                f"{where}: shard {i} spans {across} [{offsets[other]}, "
                f"{offsets[other] + sizes[other]}); each shard of a {unit[0]} split must span "
                f"all {shape[other]} {across}; {fix}"
            )
        start, size = offsets[axis], sizes[axis]
        if size == 0:
            if axis == 1:
                raise ValueError(f"{where}: shard {i} has 0 columns; drop it or {fix}")
            # An empty row shard holds nothing, wherever it claims to start: TorchRec puts
            # trailing ones at `rows`, a literal `i * block` rule may put them past it.
            continue
        if start != covered:
            kind = "overlaps the previous shard" if start < covered else "leaves a gap"
            raise ValueError(
                f"{where}: shard {i} starts at {unit[0]} {start} but the shards before it end at "
                f"{covered}: it {kind}; shards must cover {unit[1]} back to back; {fix}"
            )
        covered += size
        if covered > shape[axis]:
            raise ValueError(
                f"{where}: shard {i} ends at {unit[0]} {covered}, past the table's "
                f"{shape[axis]} {unit[1]}; {fix}"
            )
    if covered != shape[axis]:
        raise ValueError(
            f"{where}: the shards cover {unit[1]} [0, {covered}) of {shape[axis]}; "
            f"{unit[1]} [{covered}, {shape[axis]}) are in no shard; {fix}"
        )


_Check = Callable[[str, BaseEmbeddingConfig, ParameterSharding, int, int], None]

_CHECKS: dict[ShardingType, _Check] = {
    ShardingType.DATA_PARALLEL: _check_data_parallel,
    ShardingType.TABLE_WISE: _check_table_wise,
    ShardingType.ROW_WISE: _check_row_wise,
    ShardingType.COLUMN_WISE: _check_column_wise,
    ShardingType.TABLE_ROW_WISE: _check_table_row_wise,
    ShardingType.TABLE_COLUMN_WISE: _check_table_column_wise,
}
