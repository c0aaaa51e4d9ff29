"""TorchRec's planner helpers (``torchrec.distributed.planner.utils``): unit conversions, a
sharder's estimator data, shard-rank resets, imbalance finding and the two 1-D searches the
offload scale-up proposer uses."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from functools import reduce
from typing import Any

import torch
from torch import nn

from recsys_core.plan.sharder import (
    fused_params_of,
    qcomm_codecs_of,
    shardable_parameters_of,
    storage_usage_type_of,
)
from recsys_core.plan.types import ShardingType
from recsys_core.planner.constants import NUM_POOLINGS
from recsys_core.planner.interfaces import SharderData, SharderDataMap
from recsys_core.planner.sharding_option import ShardingOption
from recsys_core.planner.storage import Storage

# CommOp names (recsys_core.distributed.types.CommOp), the keys of a qcomm codecs registry.
_POOLED_A2A = "POOLED_EMBEDDINGS_ALL_TO_ALL"
_SEQUENCE_A2A = "SEQUENCE_EMBEDDINGS_ALL_TO_ALL"
_POOLED_RS = "POOLED_EMBEDDINGS_REDUCE_SCATTER"
_QCOMM_OPS = (_POOLED_A2A, _SEQUENCE_A2A, _POOLED_RS)


def build_sharder_data(sharder: Any) -> SharderData:
    """What estimators read of ``sharder``: its fused params (a dict copy), the element sizes of
    its quantized collectives, and how its tensors are counted (quantized inference sharders
    count a 4-byte row header; fused ones keep UVM tables in host memory)."""
    registry = qcomm_codecs_of(sharder)
    sizes: dict[str, tuple[float, float]] = {}
    for op in _QCOMM_OPS:
        if op in registry:
            codecs = registry[op]
            sizes[op] = (
                torch.tensor([], dtype=codecs.forward.quantized_dtype).element_size(),
                torch.tensor([], dtype=codecs.backward.quantized_dtype).element_size(),
            )
    return SharderData(fused_params=fused_params_of(sharder), qcomm_dtype_sizes=sizes,
                       storage_usage_type=storage_usage_type_of(sharder))


def build_sharder_data_map(sharder_map: dict[str, Any]) -> SharderDataMap:
    return {key: build_sharder_data(sharder) for key, sharder in sharder_map.items()}


def sharder_name(t: type[Any]) -> str:
    """``module.QualName`` of a module type: the key sharders are looked up by."""
    return t.__module__ + "." + t.__name__


def is_prefetch_pipelined(sharding_option: ShardingOption, sharder_data: SharderData) -> bool:
    params = sharding_option.cache_params
    pipelined = getattr(params, "prefetch_pipeline", None) if params is not None else None
    return bool(pipelined or sharder_data.fused_params.get("prefetch_pipeline", False))


def extract_comm_data_type_size(
    sharding_option: ShardingOption, sharder_data: SharderData
) -> tuple[float, float, float, float]:
    """Bytes per element of (fwd all-to-all, bwd all-to-all, fwd reduce-scatter, bwd
    reduce-scatter): the table's element size unless a quantized codec says otherwise."""
    size = sharding_option.tensor.element_size()
    a2a = sr = (size, size)
    qcomm = sharder_data.qcomm_dtype_sizes
    pooled = sharding_option.is_pooled
    a2a_op = _POOLED_A2A if pooled else _SEQUENCE_A2A
    if a2a_op in qcomm:
        a2a = qcomm[a2a_op]
    if pooled and _POOLED_RS in qcomm:
        sr = qcomm[_POOLED_RS]
    return a2a[0], a2a[1], sr[0], sr[1]


def get_num_poolings(constraints: dict[str, Any] | None, so: ShardingOption) -> list[float]:
    """Poolings per feature: the option's own, else its constraints', else 1 each."""
    if so.num_poolings is not None and len(so.num_poolings) == len(so.input_lengths):
        return list(so.num_poolings)
    if constraints and constraints.get(so.name) and constraints[so.name].num_poolings:
        return list(constraints[so.name].num_poolings)
    return [NUM_POOLINGS] * len(so.input_lengths)


def bytes_to_gb(num_bytes: float) -> float:
    return float(num_bytes / (1024 * 1024 * 1024))


def bytes_to_mb(num_bytes: float) -> float:
    return float(num_bytes / (1024 * 1024))


def gb_to_bytes(gb: float) -> int:
    return int(gb * 1024 * 1024 * 1024)


def mb_to_bytes(mb: float) -> int:
    return int(mb * 1024 * 1024)


def prod(iterable: Iterable[int]) -> int:
    return reduce(operator.mul, iterable, 1)


def placement(compute_device: str, rank: int, local_size: int) -> str:
    """``"rank:{rank}/{device}"``; on cuda/mtia the device is the rank's local index."""
    device: Any = compute_device
    if compute_device in ("cuda", "mtia"):
        device = torch.device(compute_device, rank % local_size)
    return f"rank:{rank}/{device}"


def storage_repr_in_gb(storage: Storage | None) -> str:
    if storage is None:
        return ""
    return (f"Storage(hbm = {round(bytes_to_gb(storage.hbm), 3)} GB, "
            f"ddr = {round(bytes_to_gb(storage.ddr), 3)} GB)")


def reset_shard_rank(proposal: list[ShardingOption]) -> None:
    for sharding_option in proposal:
        for shard in sharding_option.shards:
            shard.rank = None


def _find_imbalance_tables(
    sharding_options: list[ShardingOption], target_imbalance: str = "perf"
) -> list[ShardingOption]:
    """The options with shards on every most-loaded rank (by perf total or HBM), data-parallel
    and row-wise ones excepted, largest first shard first; [] with one rank or none."""
    if target_imbalance not in ("perf", "hbm"):
        raise ValueError(f"Unknown target imbalance {target_imbalance}")

    def load(shard: Any) -> float:
        return shard.perf.total if target_imbalance == "perf" else shard.storage.hbm

    per_rank: dict[int, float] = {}
    for so in sharding_options:
        for shard in so.shards:
            per_rank[shard.rank] = per_rank.get(shard.rank, 0) + load(shard)
    if len(per_rank) <= 1:
        return []
    top = max(per_rank.values())
    top_ranks = {rank for rank, value in per_rank.items() if value == top}
    skipped = (ShardingType.DATA_PARALLEL.value, ShardingType.ROW_WISE.value)
    found = [
        so for so in sharding_options
        if {s.rank for s in so.shards} >= top_ranks and so.sharding_type not in skipped
    ]
    found.sort(key=lambda so: load(so.shards[0]), reverse=True)
    return found


class BinarySearchPredicate:
    """The largest X in [A, B] with F(X) true, for a step function F, found by probing:
    ``next(prior_result)`` returns the next X to try (the first call ignores its argument) and
    None once fewer than ``tolerance`` values remain."""

    def __init__(self, A: int, B: int, tolerance: int) -> None:
        self.left = A
        self.right = B
        self.tolerance = tolerance
        self.first = True

    def next(self, prior_result: bool) -> int | None:
        if self.right - self.left < self.tolerance:
            return None
        mid = self._mid()
        if self.first:
            self.first = False
            return mid
        if prior_result:
            self.left = mid + 1
        else:
            self.right = mid - 1
        if self.right - self.left < self.tolerance:
            return None
        return self._mid()

    def _mid(self) -> int:
        return self.left + (self.right - self.left) // 2


class LuusJaakolaSearch:
    """A clamped Luus-Jaakola search for the minimum of f over [A, B]
    (https://en.wikipedia.org/wiki/Luus-Jaakola): probe x + U(-d, d) clamped to the range;
    on an improvement move there and shrink d by 5%. Seeded (``seed``), so deterministic;
    the bounds are probed at most once each (``left_cost`` is f(A) if already known)."""

    def __init__(
        self, A: float, B: float, max_iterations: int, seed: int = 42,
        left_cost: float | None = None,
    ) -> None:
        self.left = A
        self.right = B
        self.iteration = -1
        self.max_iterations = max_iterations
        self.gen = torch.Generator()
        self.gen.manual_seed(seed)
        self.x: float = self.uniform(self.left, self.right)
        self.fx: float = 0.0
        self.y: float = math.nan
        self.fleft: float | None = left_cost
        self.fright: float | None = None
        self.d: float = self.right - self.left

    def shrink_right(self, B: float) -> None:
        """Everything from B up is infinitely bad: the range ends at B."""
        self.right = B
        self.fright = math.inf
        self.d = self.right - self.left
        self.x = self.clamp(self.x)

    def clamp(self, x: float) -> float:
        return min(max(x, self.left), self.right)

    def uniform(self, A: float, B: float) -> float:
        u = torch.rand(1, generator=self.gen, device="cpu").item()
        return A + (B - A) * u

    def next(self, fy: float) -> float | None:
        """The next point to evaluate given f at the previous one (ignored on the first call);
        None after ``max_iterations``."""
        self.iteration += 1
        if self.iteration == 0:
            return self.x
        if self.iteration == 1:
            self.fx = fy
        elif self.iteration == self.max_iterations:
            return None
        elif fy <= self.fx:
            self.x, self.fx = self.y, fy
            self.d = 0.95 * self.d
        if self.y == self.left:
            self.fleft = fy
        elif self.y == self.right:
            self.fright = fy
        while True:
            y = self.clamp(self.x + self.uniform(-self.d, self.d))
            if (y == self.left and self.fleft is not None) or (
                y == self.right and self.fright is not None
            ):
                continue
            self.y = y
            return y

    def best(self) -> tuple[float, float]:
        """The best point so far and its cost."""
        return self.x, self.fx


def shardable_parameters(sharder: Any, module: nn.Module) -> dict[str, nn.Parameter]:
    """``{table name: weight}`` a sharder shards in ``module``: the sharder's own
    ``shardable_parameters`` where it has one, else the module's embedding tables."""
    listed = shardable_parameters_of(sharder, module)
    if listed is not None:
        return listed
    configs = getattr(module, "embedding_bag_configs", None) or getattr(
        module, "embedding_configs", None)
    if not callable(configs):
        return {}
    params = dict(module.named_parameters())
    found = {}
    for config in configs():
        weight = next((p for n, p in params.items() if n.split(".")[-2:-1] == [config.name]
                       or n.endswith(f"{config.name}.weight")), None)
        if weight is not None:
            found[config.name] = weight
    return found
