"""Checks that a module's sharding plan is executable, before any communication.

:func:`validate_module_sharding_plan` names the table and the fix for every entry a sharder could
not execute (so a bad plan fails with a message instead of a hang or a wrong answer). Pure: no
process group, no tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from recsys_core.plan.kernels import TRAINING_KERNELS as TRAINING_KERNELS
from recsys_core.plan.kernels import check_runnable_kernel
from recsys_core.plan.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingType,
    ShardMetadata,
)

EmbeddingModule = EmbeddingBagCollection | EmbeddingCollection | FusedEmbeddingBagCollection


def table_configs(
    module_or_configs: EmbeddingModule | Sequence[BaseEmbeddingConfig],
) -> list[BaseEmbeddingConfig]:
    """The table configs of an embedding collection (any module with TorchRec's
    ``embedding_bag_configs()`` or ``embedding_configs()``), or the given list."""
    if isinstance(module_or_configs, torch.nn.Module):
        for getter in ("embedding_bag_configs", "embedding_configs"):
            configs = getattr(module_or_configs, getter, None)
            if callable(configs):
                return list(configs())
        raise TypeError(
            f"sharding plans cover embedding collections (EmbeddingBagCollection, "
            f"EmbeddingCollection and their fused and quantized forms), got a "
            f"{type(module_or_configs).__name__}; pass one of those (or its list of table "
            "configs)"
        )
    return list(module_or_configs)


def resolve_local_size(world_size: int, local_size: int | None) -> int:
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


def validate_module_sharding_plan(
    module_or_configs: EmbeddingModule | Sequence[BaseEmbeddingConfig],
    plan: EmbeddingModuleShardingPlan,
    world_size: int,
    local_size: int,
    *,
    inference: bool = False,
    placements: bool = True,
) -> None:
    """Raise ValueError, naming the table, for any plan entry a sharder could not execute.

    Checked, before any communication: the table exists; every rank (in ``ranks`` and in each
    placement) is in ``[0, world_size)``; ``ranks`` lists the shard placements in order
    (``placements=False`` skips this one: TorchRec's explicit-device generators place every
    host shard on ``rank:0/cpu``, a plan for one process); the
    shards tile the ``[rows, dim]`` table exactly, in order (row-wise: row ranges back to back
    over ``[0, rows)`` at full width, on ranks ``0..world_size-1``; table-row-wise: the same over
    all ranks of one host; column-wise: column ranges back to back over ``[0, dim)`` at full
    height; table-wise: one full shard; data-parallel: no spec, all ranks); table-row/column-wise
    shards stay on one host; grid shards are equal column blocks, each row-split over one host;
    training plans use kernels that train here (DENSE or fused), inference plans QUANT
    (:func:`recsys_core.plan.kernels.check_runnable_kernel`).
    """
    local_size = resolve_local_size(world_size, local_size)
    configs = {c.name: c for c in table_configs(module_or_configs)}
    for name, sharding in plan.items():
        config = configs.get(name)
        if config is None:
            raise ValueError(
                f"the sharding plan has table {name!r}, which the module does not have (its "
                f"tables: {list(configs)}); remove it from the plan or fix its name"
            )
        where = f"table {name!r} ({sharding.sharding_type})"
        _check_kernel(where, sharding.compute_kernel, inference)
        if inference and not placements and sharding.sharding_type in _TILINGS:
            # TorchRec's inference plans for one process number shards by device (a host shard
            # and two GPUs are "ranks" 0-2 of a world of 2): only the geometry is checked here
            _check_tiling(where, config, sharding, axis=_TILINGS[sharding.sharding_type])
            continue
        _check_ranks(where, sharding, world_size, placements)
        _CHECKS[sharding.sharding_type](where, config, sharding, world_size, local_size)


def _check_kernel(where: str, kernel: EmbeddingComputeKernel, inference: bool) -> None:
    check_runnable_kernel(where, kernel, inference=inference)


def _check_ranks(
    where: str, sharding: ParameterSharding, world_size: int, placements: bool = True
) -> None:
    for rank in sharding.ranks:
        if not 0 <= rank < world_size:
            raise ValueError(
                f"{where}: rank {rank} in ranks {sharding.ranks} is outside [0, {world_size}); "
                f"place shards on ranks 0..{world_size - 1}"
            )
    if sharding.sharding_spec is None:
        return
    placed = []
    for i, shard in enumerate(sharding.shards):
        try:
            rank = shard.rank
        except ValueError as exc:
            raise ValueError(
                f"{where}: shard {i} has placement {str(shard.placement)!r}; write it as "
                "'rank:<r>/<device>', e.g. 'rank:0/cpu'"
            ) from exc
        if not 0 <= rank < world_size:
            raise ValueError(
                f"{where}: shard {i} is placed on rank {rank} ({str(shard.placement)!r}), outside "
                f"[0, {world_size}); place shards on ranks 0..{world_size - 1}"
            )
        placed.append(rank)
    if placements and placed != sharding.ranks:
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


def _check_grid_shard(
    where: str, config: BaseEmbeddingConfig, sharding: ParameterSharding, _: int, local_size: int
) -> None:
    """Column blocks of equal width, each split into row blocks over the ranks of one host."""
    shards = sharding.shards
    if not shards:
        raise ValueError(f"{where}: the plan has no shards; build it with grid_shard(host_indexes)")
    widths = sorted({s.shard_sizes[1] for s in shards})
    starts = sorted({s.shard_offsets[1] for s in shards})
    width = widths[0]
    if len(widths) != 1 or starts != list(range(0, config.embedding_dim, width)):
        raise ValueError(
            f"{where}: column blocks start at {starts} with widths {widths}; a grid shard splits "
            f"the {config.embedding_dim} columns into equal blocks; build it with "
            "grid_shard(host_indexes)"
        )
    for start in starts:
        block = [s for s in shards if s.shard_offsets[1] == start]
        rows = ParameterSharding(
            sharding_type=ShardingType.TABLE_ROW_WISE,
            compute_kernel=sharding.compute_kernel,
            ranks=[s.rank for s in block],
            sharding_spec=[
                ShardMetadata([s.shard_offsets[0], 0], [s.shard_sizes[0], config.embedding_dim],
                              s.placement)
                for s in block
            ],
        )
        _check_one_host(f"{where}, column block at {start}", rows, local_size)
        _check_tiling(f"{where}, column block at {start}", config, rows, axis=0)


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
    ShardingType.GRID_SHARD: _check_grid_shard,
}

_TILINGS = {ShardingType.ROW_WISE: 0, ShardingType.COLUMN_WISE: 1}
