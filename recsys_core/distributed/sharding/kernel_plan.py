"""What a plan says about the kernels: cached tables (FUSED_UVM_CACHING) and their load
factor, and the kernel placements refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from recsys_core.distributed.types import (
    EmbeddingComputeKernel,
    ParameterSharding,
    ShardingType,
)
from recsys_core.plan.params import CacheParams

# Cache share of a FUSED_UVM_CACHING shard whose plan gives no load factor (TorchRec's default).
DEFAULT_LOAD_FACTOR = 0.2


def check_kernel_placement(plan: Mapping[str, ParameterSharding], device: torch.device) -> None:
    """FUSED_UVM_CACHING tables run the cached kernel (a cache over a backing file on CPU, over
    host memory on CUDA), except data-parallel ones (replicas are updated densely). On CPU a
    FUSED_UVM table is a FUSED one (host memory is where CPU tables live); on CUDA UVM without a
    cache is not placed by these kernels: refuse rather than put the table in device memory."""
    for name, ps in plan.items():
        caching = ps.compute_kernel is EmbeddingComputeKernel.FUSED_UVM_CACHING
        if caching and ps.sharding_type is ShardingType.DATA_PARALLEL:
            raise ValueError(
                f"table {name!r}: a data-parallel table cannot be cached (fused_uvm_caching); "
                "shard it table-wise or row-wise, or use EmbeddingComputeKernel.FUSED"
            )
        if device.type == "cuda" and ps.compute_kernel is EmbeddingComputeKernel.FUSED_UVM:
            raise ValueError(
                f"table {name!r}: compute kernel {ps.compute_kernel} (UVM without a cache) is "
                "not available for sharded CUDA tables; use fused_uvm_caching or fused"
            )


def with_cache_load_factor(
    plan: Mapping[str, ParameterSharding], fused_params: Mapping[str, Any] | None,
) -> dict[str, ParameterSharding]:
    """``plan`` with the sharder's ``fused_params["cache_load_factor"]`` (TorchRec's key) as
    the load factor of every FUSED_UVM_CACHING table whose plan gives none."""
    clf = (fused_params or {}).get("cache_load_factor")
    out = dict(plan)
    if clf is None:
        return out
    for name, ps in plan.items():
        if ps.compute_kernel is not EmbeddingComputeKernel.FUSED_UVM_CACHING:
            continue
        params = ps.cache_params or CacheParams()
        if params.load_factor is None:
            out[name] = dataclasses.replace(
                ps, cache_params=dataclasses.replace(params, load_factor=float(clf)))
    return out


def planned_caches(plan: Mapping[str, ParameterSharding]) -> dict[str, CacheParams]:
    """The cache settings of the tables ``plan`` puts in FUSED_UVM_CACHING."""
    return {
        name: ps.cache_params or CacheParams()
        for name, ps in plan.items()
        if ps.compute_kernel is EmbeddingComputeKernel.FUSED_UVM_CACHING
    }
