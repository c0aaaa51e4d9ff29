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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.plan.shard_sizes import (
    MIN_CW_DIM as MIN_CW_DIM,
)
from recsys_core.plan.shard_sizes import (
    _calculate_rw_shard_sizes_and_offsets,
    calculate_shard_sizes_and_offsets,
    placement,
    placement_helper,
)
from recsys_core.plan.sharder import Sharder
from recsys_core.plan.spec import EnumerableShardingSpec, ShardMetadata
from recsys_core.plan.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingType,
)
from recsys_core.plan.validation import (
    EmbeddingModule,
    resolve_local_size,
    table_configs,
    validate_module_sharding_plan,
)


class ParameterShardingGenerator(Protocol):
    """Makes one table's :class:`ParameterSharding` once the topology is known.

    Called as TorchRec calls it, ``(param, local_size, world_size, device_type, sharder)`` with
    the table's weight, or with the table's config in place of the weight."""

    def __call__(
        self,
        param: torch.Tensor | BaseEmbeddingConfig,
        local_size: int,
        world_size: int,
        device_type: str,
        sharder: Sharder | None = None,
    ) -> ParameterSharding: ...


@dataclass(frozen=True)
class _Table:
    """What a generator needs of a table: its name (for messages), shape, and whether an
    optimizer is applied in backward to its weight (TorchRec's default-kernel rule)."""

    name: str
    rows: int
    cols: int
    in_backward_optimizer: bool

    @classmethod
    def of(cls, param: torch.Tensor | BaseEmbeddingConfig) -> _Table:
        if isinstance(param, BaseEmbeddingConfig):
            return cls(param.name, param.num_embeddings, param.embedding_dim, False)
        if param.dim() != 2:
            raise ValueError(
                f"a sharding generator needs a table's 2-D weight, got shape {list(param.shape)}"
            )
        rows, cols = param.shape
        name = getattr(param, "_table_name", "?")
        return cls(name, int(rows), int(cols), hasattr(param, "_in_backward_optimizers"))

    @property
    def shape(self) -> torch.Tensor:
        return torch.empty(self.rows, self.cols, device="meta")


# One shard before placement: (sizes [rows, cols], offsets [row, col], rank).
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
    sizes, offsets = _calculate_rw_shard_sizes_and_offsets(rows, num_shards, 1)
    return [(o[0], s[0]) for s, o in zip(sizes, offsets, strict=True)]


def _default_kernel(table: _Table, sharding_type: ShardingType) -> EmbeddingComputeKernel:
    """TorchRec's default: DENSE for data-parallel tables; otherwise FUSED when an optimizer is
    applied in backward to the table's weight (``apply_optimizer_in_backward``), else DENSE."""
    if sharding_type is not ShardingType.DATA_PARALLEL and table.in_backward_optimizer:
        return EmbeddingComputeKernel.FUSED
    return EmbeddingComputeKernel.DENSE


def _sharding(
    table: _Table,
    sharding_type: ShardingType,
    compute_kernel: EmbeddingComputeKernel | str | None,
    shards: list[_Shard],
    local_size: int,
    device_type: str,
    placements: Sequence[str] | None = None,
) -> ParameterSharding:
    """``placements``: explicit placement strings (one per shard), else each shard on its
    rank's device of ``device_type``."""
    if placements is None:
        placements = [placement(device_type, rank, local_size) for _, _, rank in shards]
    kernel = (
        _default_kernel(table, sharding_type)
        if compute_kernel is None
        else EmbeddingComputeKernel(compute_kernel)
    )
    return ParameterSharding(
        sharding_type=sharding_type,
        compute_kernel=kernel,
        ranks=[rank for _, _, rank in shards],
        sharding_spec=EnumerableShardingSpec([
            ShardMetadata(offsets, sizes, where)
            for (sizes, offsets, _), where in zip(shards, placements, strict=True)
        ]),
    )


def _sizes(table: _Table, kind: ShardingType, local_size: int, world_size: int,
           num_buckets: int | None = None) -> list[tuple[list[int], list[int]]]:
    sizes, offsets = calculate_shard_sizes_and_offsets(
        table.shape, world_size, local_size, kind.value, num_buckets=num_buckets
    )
    return list(zip(sizes, offsets, strict=True))


def _host_ranks(host_index: int, local_size: int, world_size: int, table: str) -> list[int]:
    num_hosts = world_size // local_size
    if not 0 <= host_index < num_hosts:
        raise ValueError(
            f"table {table!r}: host_index {host_index} is outside [0, {num_hosts}) "
            f"(world_size {world_size}, {local_size} ranks per host); pick an existing host"
        )
    return list(range(host_index * local_size, (host_index + 1) * local_size))


def _given_blocks(total: int, sizes: Sequence[int], rows: int, cols: int, table: str, what: str,
                  ) -> list[tuple[int, int]]:
    """``(offset, size)`` of consecutive blocks of the given sizes, the last ones cut at
    ``total`` (as TorchRec); an error if they do not reach it."""
    blocks, end = [], 0
    for size in sizes:
        start, end = end, min(end + int(size), total)
        blocks.append((start, end - start))
    if end < total:
        raise ValueError(
            f"Cannot fit tensor of {rows, cols} into sizes_ranks_placements = {list(sizes)}: "
            f"table {table!r}: {what} {list(sizes)} cover {end} of its {total}; give sizes "
            f"that add up to at least {total}"
        )
    return blocks


def _device_index_placements(devices: Sequence[str], rank_of_device: bool) -> list[str]:
    """TorchRec's placements for explicit per-shard devices on one machine: CPU shards are
    ``rank:0/cpu``; device shards are numbered in order, ``rank:<i>/cuda:<i>`` (i counts the
    device shards before; ``rank_of_device=False``: the rank is the shard's position)."""
    out, index = [], 0
    for position, device in enumerate(devices):
        out.append(placement_helper(device, index, index if rank_of_device else position))
        if device != "cpu":
            index += 1
    return out


def _generator(
    build: Callable[[_Table, int, int, str], ParameterSharding],
) -> ParameterShardingGenerator:
    """A :class:`ParameterShardingGenerator` (TorchRec's call) that reads ``param``'s table and
    returns ``build(table, local_size, world_size, device_type)``."""

    def generate(
        param: torch.Tensor | BaseEmbeddingConfig, local_size: int, world_size: int,
        device_type: str, sharder: Sharder | None = None,
    ) -> ParameterSharding:
        return build(_Table.of(param), local_size, world_size, device_type)

    return generate


def table_wise(
    rank: int,
    device: str | None = None,
    compute_kernel: EmbeddingComputeKernel | str | None = None,
) -> ParameterShardingGenerator:
    """The whole table on ``rank``: a 4096 x 64 table -> one shard ``[0, 0] / [4096, 64]``.

    ``device`` ("cpu" or "cuda") overrides the plan's device type for this table (TorchRec's
    placements: ``rank:0/cpu``, or ``rank:<rank>/cuda:<rank>``). ``compute_kernel`` defaults
    to TorchRec's choice (FUSED with an optimizer applied in backward, else DENSE). (A kernel as
    second positional argument is read as ``compute_kernel``, this library's earlier order.)
    """
    if isinstance(device, EmbeddingComputeKernel):
        device, compute_kernel = None, device

    @_generator
    def generate(
        table: _Table, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        (size, offset), = _sizes(table, ShardingType.TABLE_WISE, local_size, world_size)
        places = [placement_helper(device, rank, rank)] if device else None
        return _sharding(table, ShardingType.TABLE_WISE, compute_kernel, [(size, offset, rank)],
                         local_size, device_type, places)

    return generate


def row_wise(
    sizes_placement: tuple[Sequence[int], str | Sequence[str]] | None = None,
    compute_kernel: EmbeddingComputeKernel | str | None = None,
    num_buckets: int | None = None,
) -> ParameterShardingGenerator:
    """Row blocks on ALL ranks (:func:`row_blocks`): 10 x 8 over 4 ranks -> rows 3, 3, 3, 1;
    with ``num_buckets`` whole buckets per rank (zero-collision hashing).

    ``sizes_placement=(sizes, device)`` (TorchRec's, for inference): rank ``i`` holds the next
    ``sizes[i]`` rows (cut at the table's end) on ``device`` (one for all, or one per rank: CPU
    shards are placed ``rank:0/cpu``, device shards numbered in order), with the QUANT kernel:
    ``([6, 4], "cpu")`` on a 10-row table -> rows [0, 6) and [6, 10). (A kernel as first
    positional argument is read as ``compute_kernel``.)
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

    @_generator
    def generate(
        table: _Table, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        if sizes_placement is None:
            blocks = _sizes(table, ShardingType.ROW_WISE, local_size, world_size,
                            num_buckets=num_buckets)
            shards = [(size, offset, r) for r, (size, offset) in enumerate(blocks)]
            return _sharding(table, ShardingType.ROW_WISE, compute_kernel, shards, local_size,
                             device_type)
        given = _given_blocks(table.rows, sizes, table.rows, table.cols, table.name, "row sizes")
        shards = [([n, table.cols], [off, 0], r) for r, (off, n) in enumerate(given)]
        per_shard = [devices] * len(sizes) if isinstance(devices, str) else list(devices)
        places = _device_index_placements(per_shard, rank_of_device=False)
        return _sharding(table, ShardingType.ROW_WISE, compute_kernel, shards, local_size,
                         device_type, places)

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
    the next ``size_per_rank[j]`` columns (cut at the table's width) on rank ``j``; 10 x 8 with
    ``size_per_rank=[2, 6]`` -> ``[10, 2]`` on rank 0, ``[10, 6]`` at column 2 on rank 1.
    ``device_types`` gives each block's device (TorchRec's placements: CPU blocks
    ``rank:0/cpu``, device blocks numbered in order). (A kernel as second positional argument is
    read as ``compute_kernel``.)
    """
    if isinstance(size_per_rank, EmbeddingComputeKernel):
        size_per_rank, compute_kernel = None, size_per_rank
    if size_per_rank is None and not ranks:
        raise ValueError("column_wise: ranks is empty; give at least one rank per column block")

    @_generator
    def generate(
        table: _Table, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        if size_per_rank is None:
            assert ranks is not None
            if table.cols % len(ranks):
                raise ValueError(
                    f"column dim of {table.cols} cannot be evenly divided across {list(ranks)}: "
                    f"table {table.name!r}: embedding_dim {table.cols} does not split into "
                    f"{len(ranks)} equal column blocks; use a number of ranks that divides "
                    f"{table.cols}, or give size_per_rank"
                )
            # TorchRec's blocks (multiples of 4 columns) when the width is one, else exact ones
            width = table.cols // len(ranks)
            shards = [([table.rows, width], [0, j * width], r) for j, r in enumerate(ranks)]
        else:
            given = _given_blocks(table.cols, size_per_rank, table.rows, table.cols, table.name,
                                  "column sizes")
            shards = [([table.rows, n], [0, off], r) for r, (off, n) in enumerate(given)]
        places = None
        if device_types is not None:
            if len(device_types) != len(shards):
                raise ValueError(
                    f"column_wise: {len(device_types)} device_types for {len(shards)} column "
                    "blocks; give one per block"
                )
            places = _device_index_placements(device_types, rank_of_device=True)
        return _sharding(table, ShardingType.COLUMN_WISE, compute_kernel, shards, local_size,
                         device_type, places)

    return generate


def data_parallel(
    compute_kernel: EmbeddingComputeKernel | str | None = None,
) -> ParameterShardingGenerator:
    """A full replica on every rank; ``sharding_spec`` is None (nothing is split). The default
    kernel is DENSE (TorchRec's): an optimizer outside the module steps the replicas, whose
    gradients ``DistributedModelParallel`` averages with the dense part's."""

    @_generator
    def generate(
        table: _Table, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        kind = ShardingType.DATA_PARALLEL
        return ParameterSharding(
            sharding_type=kind,
            compute_kernel=_default_kernel(table, kind) if compute_kernel is None
            else EmbeddingComputeKernel(compute_kernel),
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

    @_generator
    def generate(
        table: _Table, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        ranks = _host_ranks(host_index, local_size, world_size, table.name)
        blocks = _sizes(table, ShardingType.TABLE_ROW_WISE, local_size, world_size)
        shards = [(size, offset, r) for (size, offset), r in zip(blocks, ranks, strict=True)]
        return _sharding(table, ShardingType.TABLE_ROW_WISE, compute_kernel, shards, local_size,
                         device_type)

    return generate


def table_column_wise(
    host_index: int,
    compute_kernel: EmbeddingComputeKernel | str | None = None,
    ranks_per_table: int | None = None,
) -> ParameterShardingGenerator:
    """Equal column blocks on the first ``ranks_per_table`` ranks of one host (default: all).
    (TorchRec has no generator for this type; this library's.)

    World 4, 2 ranks per host, ``host_index=1``: dim 8 -> columns [0, 4) on rank 2, [4, 8) on 3.
    """

    @_generator
    def generate(
        table: _Table, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        ranks = _host_ranks(host_index, local_size, world_size, table.name)
        count = local_size if ranks_per_table is None else ranks_per_table
        if not 1 <= count <= local_size:
            raise ValueError(
                f"table {table.name!r}: ranks_per_table {count} is outside [1, {local_size}] "
                f"(the ranks of one host); use at most {local_size}"
            )
        if table.cols % count:
            raise ValueError(
                f"table {table.name!r}: embedding_dim {table.cols} does not split into {count} "
                f"equal column blocks (one per rank in {ranks[:count]}); use a number of ranks "
                f"that divides {table.cols}"
            )
        width = table.cols // count
        shards = [([table.rows, width], [0, j * width], r) for j, r in enumerate(ranks[:count])]
        return _sharding(table, ShardingType.TABLE_COLUMN_WISE, compute_kernel, shards,
                         local_size, device_type)

    return generate


def grid_shard(
    host_indexes: Sequence[int], compute_kernel: EmbeddingComputeKernel | str | None = None
) -> ParameterShardingGenerator:
    """Column blocks (of :data:`MIN_CW_DIM` columns, or the whole width if it does not divide),
    block ``j`` split in row blocks over the ranks of host ``host_indexes[j]``.

    World 4, 2 ranks per host, ``host_indexes=[0, 1]``, a 10 x 256 table -> columns [0, 128):
    rows [0, 5) on rank 0, [5, 10) on rank 1; columns [128, 256): rows [0, 5) on rank 2,
    [5, 10) on rank 3. (The plan is TorchRec's; this library's sharders do not execute it.)
    """

    @_generator
    def generate(
        table: _Table, local_size: int, world_size: int, device_type: str
    ) -> ParameterSharding:
        blocks = _sizes(table, ShardingType.GRID_SHARD, local_size, world_size)
        if len(blocks) != len(host_indexes) * local_size:
            raise ValueError(
                f"table {table.name!r}: grid_shard over hosts {list(host_indexes)} makes "
                f"{len(blocks) // local_size} column block(s) of {table.cols} columns, one per "
                "host; give one host index per column block"
            )
        shards = []
        for j, host in enumerate(host_indexes):
            ranks = _host_ranks(host, local_size, world_size, table.name)
            for i, rank in enumerate(ranks):
                size, offset = blocks[j * local_size + i]
                shards.append((size, offset, rank))
        return _sharding(table, ShardingType.GRID_SHARD, compute_kernel, shards, local_size,
                         device_type)

    return generate


def get_sharding_constructor_from_type(
    sharding_type: ShardingType,
) -> Callable[..., ParameterShardingGenerator]:
    """The generator function of a sharding type (TorchRec's table)."""
    constructors: dict[ShardingType, Callable[..., ParameterShardingGenerator]] = {
        ShardingType.TABLE_WISE: table_wise,
        ShardingType.ROW_WISE: row_wise,
        ShardingType.COLUMN_WISE: column_wise,
        ShardingType.TABLE_ROW_WISE: table_row_wise,
        ShardingType.GRID_SHARD: grid_shard,
        ShardingType.DATA_PARALLEL: data_parallel,
    }
    return constructors[ShardingType(getattr(sharding_type, "value", sharding_type))]


def apply_to_all(
    module: EmbeddingModule,
    parameter_sharding_generator: ParameterShardingGenerator,
    sharder: Sharder | None = None,
) -> dict[str, ParameterShardingGenerator]:
    """``{table name: generator}`` for every table of ``module`` (TorchRec's helper)."""
    if sharder is not None and not isinstance(module, sharder.module_type):
        raise ValueError(
            f"apply_to_all: {type(sharder).__name__} shards {sharder.module_type.__name__}, not "
            f"{type(module).__name__}"
        )
    return {c.name: parameter_sharding_generator for c in table_configs(module)}


def _table_params(
    module: EmbeddingModule | Sequence[BaseEmbeddingConfig], configs: Sequence[BaseEmbeddingConfig]
) -> dict[str, torch.Tensor | BaseEmbeddingConfig]:
    """What each generator is called with: the table's weight (a detached alias that carries the
    table's name and, if set, its in-backward optimizers), or its config for a config list."""
    if not isinstance(module, torch.nn.Module):
        return {c.name: c for c in configs}
    # ``<...>.<table>.weight`` entries by table name (one pass, not one scan per table)
    by_table: dict[str, list[torch.Tensor]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and parts[2] == "weight":
            by_table.setdefault(parts[1], []).append(t)
    out: dict[str, torch.Tensor | BaseEmbeddingConfig] = {}
    for c in configs:
        found = by_table.get(c.name, [])
        if len(found) != 1 or found[0].dim() != 2:
            out[c.name] = c
            continue
        alias = found[0].detach()
        alias._table_name = c.name  # type: ignore[attr-defined]
        if hasattr(found[0], "_in_backward_optimizers"):
            alias._in_backward_optimizers = found[0]._in_backward_optimizers  # type: ignore[attr-defined]
        out[c.name] = alias
    return out


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
    """Apply a generator to each named table and check the plan (TorchRec's arguments).

    Keys are table names; tables without a generator are left out of the plan (TorchRec
    requires every table). ``sharder``, if given, must handle the module and is passed to the
    generators. ``local_size`` defaults to ``LOCAL_WORLD_SIZE`` (set by torchrun), else
    ``world_size``; ``world_size`` to the default process group's size; ``device_type`` to
    "cuda" when CUDA is available, else "cpu". ``inference`` (default: whether any table uses
    the QUANT kernel) expects QUANT kernels for every table.

    Checked here: the tables exist, ranks are in the world, shards tile each table, the kernels
    run here (see :func:`validate_module_sharding_plan`). That each shard's placement names the
    rank in ``ranks`` is checked when a sharder executes the plan (TorchRec's explicit-device
    placements, e.g. ``rank:0/cpu`` for every host shard, are plans for one machine).

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
    params = _table_params(module, configs)
    plan = EmbeddingModuleShardingPlan({
        c.name: per_param_sharding[c.name](params[c.name], local_size, world_size, device_type,
                                           sharder)
        for c in configs
        if c.name in per_param_sharding
    })
    if inference is None:
        inference = any(ps.compute_kernel is EmbeddingComputeKernel.QUANT for ps in plan.values())
    validate_module_sharding_plan(configs, plan, world_size, local_size, inference=inference,
                                  placements=False)
    return plan
