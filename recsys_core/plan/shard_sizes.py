"""Shard geometry and placement strings: TorchRec's ``calculate_shard_sizes_and_offsets`` and its
helpers, ``placement`` and ``placement_helper``. Pure functions of table shapes.

Worked examples (sizes and offsets are ``[rows, columns]``)::

    _calculate_rw_shard_sizes_and_offsets(10, 4, 8)
        sizes   [[3, 8], [3, 8], [3, 8], [1, 8]]     # blocks of ceil(10 / 4) = 3 rows
        offsets [[0, 0], [3, 0], [6, 0], [9, 0]]
    _calculate_rw_shard_sizes_and_offsets(10, 4, 8, num_buckets=5)   # 5 buckets of 2 rows
        sizes   [[4, 8], [2, 8], [2, 8], [2, 8]]     # buckets 2, 1, 1, 1
    _calculate_cw_shard_sizes_and_offsets(256, 10)   # blocks of MIN_CW_DIM = 128 columns
        sizes   [[10, 128], [10, 128]], offsets [[0, 0], [0, 128]]
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

from recsys_core.plan.types import ShardingType

MIN_CW_DIM = 128
"""Narrowest column block the planner (and default column-wise split) makes (TorchRec's)."""

Sizes = list[list[int]]


class ShardSizeError(ValueError, AssertionError):
    """Shard sizes cannot be computed from the arguments. A ValueError; also an AssertionError,
    the type TorchRec raises for the same conditions."""


def placement(compute_device: str, rank: int, local_size: int) -> str:
    """``"rank:<r>/<device>"``; CUDA and MTIA shards go on the rank's local device
    (``rank % local_size``): ``placement("cuda", 9, 8) == "rank:9/cuda:1"``."""
    if compute_device in {"cuda", "mtia"}:
        return f"rank:{rank}/{torch.device(compute_device, rank % local_size)}"
    return f"rank:{rank}/{compute_device}"


def placement_helper(device_type: str, index: int = 0, rank: int = 0) -> str:
    """The placement of a shard whose device a generator names explicitly (TorchRec's rule for
    host/device mixes on one machine): a CPU shard is ``"rank:0/cpu"`` (host memory belongs to
    the process of rank 0), a device shard ``"rank:<rank>/<device>:<index>"``."""
    if device_type == "cpu":
        return "rank:0/cpu"
    return f"rank:{rank}/{device_type}:{index}"


def calculate_shard_sizes_and_offsets(
    tensor: torch.Tensor,
    world_size: int,
    local_world_size: int,
    sharding_type: str,
    col_wise_shard_dim: int | None = None,
    device_memory_sizes: Sequence[int] | None = None,
    num_buckets: int | None = None,
) -> tuple[Sizes, Sizes]:
    """``(sizes, offsets)`` of each shard of a ``[rows, columns]`` tensor (TorchRec's rule).

    DATA_PARALLEL: the whole tensor once per rank; TABLE_WISE: once; ROW_WISE: row blocks over
    ``world_size`` ranks (by ``device_memory_sizes`` shares when given; whole buckets when
    ``num_buckets`` is given); TABLE_ROW_WISE: row blocks over ``local_world_size`` ranks;
    (TABLE_)COLUMN_WISE: column blocks of ``col_wise_shard_dim`` (default :data:`MIN_CW_DIM`)
    columns; GRID_SHARD: each column block split in row blocks over ``local_world_size``.
    """
    rows, columns = tensor.shape
    kind = getattr(sharding_type, "value", sharding_type)
    if kind == ShardingType.DATA_PARALLEL.value:
        return [[rows, columns]] * world_size, [[0, 0]] * world_size
    if kind == ShardingType.TABLE_WISE.value:
        return [[rows, columns]], [[0, 0]]
    if kind == ShardingType.ROW_WISE.value:
        if num_buckets and num_buckets < world_size:
            raise ValueError(
                f"Number of buckets ({num_buckets}) must be >= the number of ranks "
                f"({world_size}): a bucket cannot be split across ranks. Increase "
                "total_num_buckets or reduce world_size."
            )
        if device_memory_sizes:
            return _calculate_uneven_rw_shard_sizes_and_offsets(
                rows, world_size, columns, device_memory_sizes, num_buckets
            )
        return _calculate_rw_shard_sizes_and_offsets(rows, world_size, columns, num_buckets)
    if kind == ShardingType.TABLE_ROW_WISE.value:
        return _calculate_rw_shard_sizes_and_offsets(rows, local_world_size, columns)
    if kind in (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value):
        return _calculate_cw_shard_sizes_and_offsets(columns, rows, col_wise_shard_dim)
    if kind == ShardingType.GRID_SHARD.value:
        return _calculate_grid_shard_sizes_and_offsets(
            rows, local_world_size, columns, col_wise_shard_dim
        )
    raise ValueError(f"Unrecognized or unsupported sharding type provided: {sharding_type}")


def _offsets_of(sizes: Sizes) -> Sizes:
    offsets, row = [], 0
    for size in sizes:
        offsets.append([row, 0])
        row += size[0]
    return offsets


def _bucket_size(hash_size: int, num_buckets: int) -> int:
    if hash_size % num_buckets:
        raise ShardSizeError(
            f"hash_size must be divisible by num_buckets: {hash_size} rows do not split into "
            f"{num_buckets} equal buckets"
        )
    return hash_size // num_buckets


def _calculate_rw_shard_sizes_and_offsets(
    hash_size: int, num_devices: int, columns: int, num_buckets: int | None = None
) -> tuple[Sizes, Sizes]:
    """Row blocks of ``ceil(hash_size / num_devices)`` rows, the last ones short or empty
    (10 rows on 4 -> 3, 3, 3, 1; 5 on 4 -> 2, 2, 1, 0). With ``num_buckets`` (zero-collision
    hashing) whole buckets of ``hash_size / num_buckets`` rows, the first ranks one extra."""
    if num_buckets:
        bucket = _bucket_size(hash_size, num_buckets)
        per_rank, extra = divmod(num_buckets, num_devices)
        sizes = [[bucket * (per_rank + (rank < extra)), columns] for rank in range(num_devices)]
    else:
        block = math.ceil(hash_size / num_devices)
        sizes = [
            [max(0, min(block, hash_size - rank * block)), columns] for rank in range(num_devices)
        ]
    return sizes, _offsets_of(sizes)


def _calculate_uneven_rw_shard_sizes_and_offsets(
    hash_size: int,
    num_devices: int,
    columns: int,
    device_memory_sizes: Sequence[int],
    num_buckets: int | None = None,
) -> tuple[Sizes, Sizes]:
    """Rows (whole buckets) in proportion to each device's memory, rounded down; the last device
    takes the rest: 40 rows over memories [2, 1, 1] -> 20, 10, 10."""
    if len(device_memory_sizes) != num_devices:
        raise ShardSizeError(
            f"must provide all the memory size: {len(device_memory_sizes)} sizes for "
            f"{num_devices} devices"
        )
    total = sum(device_memory_sizes)
    buckets, bucket = (hash_size, 1) if num_buckets is None else (
        num_buckets, _bucket_size(hash_size, num_buckets)
    )
    sizes, taken = [], 0
    for rank in range(num_devices):
        if rank < num_devices - 1:
            rows = int(buckets * (device_memory_sizes[rank] / total)) * bucket
            taken += rows
        else:
            rows = hash_size - taken
        sizes.append([rows, columns])
    return sizes, _offsets_of(sizes)


def _find_base_dim(lower_bound: int, dim: int) -> int:
    """The smallest width >= ``lower_bound`` that divides ``dim`` and is a multiple of 4."""
    for i in range(lower_bound, dim):
        if dim % i == 0 and i % 4 == 0:
            return i
    return dim


def _get_block_size_for_cw_shard(columns: int, column_wise_shard_dim: int | None) -> int:
    block = min(_find_base_dim(column_wise_shard_dim or MIN_CW_DIM, columns), columns)
    if columns % block:
        warnings.warn(
            f"Dim of {columns} cannot be evenly divided with column wise shard dim "
            f"{column_wise_shard_dim}, overriding block_size to embedding_dim={columns}",
            UserWarning,
            stacklevel=2,
        )
        block = columns
    return block


def _calculate_cw_shard_sizes_and_offsets(
    columns: int, rows: int, col_wise_shard_dim: int | None = None
) -> tuple[Sizes, Sizes]:
    block = _get_block_size_for_cw_shard(columns, col_wise_shard_dim)
    count = columns // block
    return [[rows, block] for _ in range(count)], [[0, block * j] for j in range(count)]


def _calculate_grid_shard_sizes_and_offsets(
    hash_size: int, num_device: int, columns: int, col_wise_shard_dim: int | None = None
) -> tuple[Sizes, Sizes]:
    """Column blocks (as column-wise), each split in row blocks over ``num_device`` ranks;
    column block by column block."""
    row_sizes, row_offsets = _calculate_rw_shard_sizes_and_offsets(hash_size, num_device, columns)
    block = _get_block_size_for_cw_shard(columns, col_wise_shard_dim)
    sizes, offsets = [], []
    for j in range(columns // block):
        for size, offset in zip(row_sizes, row_offsets, strict=True):
            sizes.append([size[0], block])
            offsets.append([offset[0], block * j])
    return sizes, offsets
