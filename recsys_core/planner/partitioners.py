"""TorchRec's partitioners over :class:`ShardingOption` proposals: :class:`GreedyPerfPartitioner`
and :class:`MemoryBalancedPartitioner` (this library's own search places tables with
``search/placement.py``).

Greedy: "uniform" options (row-wise, data-parallel) put shard i on rank i; the others, in
groups (by ``dependency`` or fqn) sorted largest first (storage or perf), go shard by shard
to the least-loaded rank that fits (a heap of :class:`OrderedDeviceHardware`: by perf total,
then local rank, then rank); "host" options go to the least-loaded host that holds them all.
The topology is not modified: the partitioner works on copies of its devices.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import logging
from dataclasses import dataclass
from enum import Enum

from recsys_core.planner.errors import PlannerError, PlannerErrorType
from recsys_core.planner.interfaces import PartitionByType, Partitioner
from recsys_core.planner.perf_models import NoopPerfModel
from recsys_core.planner.sharding_option import ShardingOption
from recsys_core.planner.storage import DeviceHardware, Storage
from recsys_core.planner.topology import Topology
from recsys_core.planner.utils import bytes_to_gb, mb_to_bytes, reset_shard_rank

logger: logging.Logger = logging.getLogger(__name__)


def _partition_error(message: str) -> PlannerError:
    return PlannerError(message, PlannerErrorType.PARTITION)


@dataclass
class ShardingOptionGroup:
    sharding_options: list[ShardingOption]
    storage_sum: Storage
    perf_sum: float
    param_count: int


class SortBy(Enum):
    STORAGE = "storage"
    PERF = "perf"


@dataclass
class OrderedDeviceHardware:
    """A device ordered by (perf total, local rank, rank): the heap order of the greedy pass."""

    device: DeviceHardware
    local_world_size: int

    def __lt__(self, other: OrderedDeviceHardware) -> bool:
        lws = self.local_world_size
        return (self.device.perf.total, self.device.rank % lws, self.device.rank) < (
            other.device.perf.total, other.device.rank % lws, other.device.rank)


def _group_and_sort_non_uniform_sharding_options(
    sharding_options: list[ShardingOption],
    sort_by: SortBy = SortBy.STORAGE,
    balance_modules: bool = False,
) -> list[ShardingOptionGroup]:
    """Non-uniform options grouped by ``dependency`` (else fqn), largest first; with
    ``balance_modules`` modules with fewer tables first."""
    param_count: dict[str, int] = {}
    for so in sharding_options:
        param_count[so.path] = param_count.get(so.path, 0) + 1
    groups: dict[str, ShardingOptionGroup] = {}
    for so in sharding_options:
        if so.partition_by == PartitionByType.UNIFORM.value:
            continue
        key = so.dependency or so.fqn
        if key not in groups:
            groups[key] = ShardingOptionGroup([so], so.total_storage, so.total_perf,
                                              param_count=-param_count[so.path])
        else:
            group = groups[key]
            group.sharding_options.append(so)
            group.storage_sum += so.total_storage
            group.perf_sum += so.total_perf
    attrs = (["param_count"] if balance_modules else []) + [
        "storage_sum" if sort_by == SortBy.STORAGE else "perf_sum"]
    return sorted(groups.values(), key=lambda g: [getattr(g, a) for a in attrs], reverse=True)


def _place(shard_owner: ShardingOption, index: int, device: DeviceHardware) -> None:
    shard = shard_owner.shards[index]
    shard.rank = device.rank
    device.storage -= shard.storage
    device.perf += shard.perf


class GreedyPerfPartitioner(Partitioner):
    """Greedy placement (see the module docstring).

    Args:
        sort_by: place the largest groups first by storage (default) or perf.
        balance_modules: sort by module first, modules with fewer tables first.
    """

    def __init__(self, sort_by: SortBy = SortBy.STORAGE, balance_modules: bool = False) -> None:
        self._sort_by = sort_by
        self._balance_modules = balance_modules

    def partition(
        self,
        proposal: list[ShardingOption],
        storage_constraint: Topology,
        hbm_per_device: int | None = None,
    ) -> list[ShardingOption]:
        """Assigns every shard a rank (in place) and returns ``proposal``; ``hbm_per_device``
        replaces every rank's HBM."""
        devices = [
            DeviceHardware(d.rank, Storage(hbm_per_device or d.storage.hbm, d.storage.ddr,
                                           d.storage.ssd), copy.deepcopy(d.perf))
            for d in storage_constraint.devices
        ]
        hosts = self._get_host_level_devices(storage_constraint, devices)
        uniform = [so for so in proposal if so.partition_by == PartitionByType.UNIFORM.value]
        self._uniform_partition(uniform, devices)
        heap: list[OrderedDeviceHardware] | None = None
        for group in _group_and_sort_non_uniform_sharding_options(
            proposal, self._sort_by, self._balance_modules
        ):
            by = group.sharding_options[0].partition_by
            if by == PartitionByType.MULTI_HOST.value:
                self._multi_hosts_partition(group, hosts)
                heap = None
            elif by == PartitionByType.HOST.value:
                self._cohost_partition(group, hosts)
                heap = None
            elif by == PartitionByType.DEVICE.value:
                if heap is None:
                    heap = self._establish_minheap(devices, storage_constraint.local_world_size)
                if len(group.sharding_options) != 1:
                    raise _partition_error(
                        f"a device-partitioned group holds {len(group.sharding_options)} sharding "
                        "options (tables with a shared dependency must be host-partitioned)")
                so = group.sharding_options[0]
                if so.sharding_type == "column_wise" and so.compute_kernel == "key_value":
                    self._column_wise_device_partition(so, heap)
                else:
                    self._device_partition(so, heap)
            else:
                raise RuntimeError(f"Unexpected sharding option group {group}")
        return proposal

    @classmethod
    def _establish_minheap(
        cls, devices: list[DeviceHardware], local_world_size: int
    ) -> list[OrderedDeviceHardware]:
        heap = [OrderedDeviceHardware(d, local_world_size) for d in devices]
        heapq.heapify(heap)
        return heap

    @classmethod
    def _column_wise_device_partition(
        cls, sharding_option: ShardingOption, minheap_devices: list[OrderedDeviceHardware]
    ) -> None:
        """Column blocks on distinct ranks, each on the least-loaded one that fits."""
        if sharding_option.num_shards > len(minheap_devices):
            raise _partition_error(
                f"COLUMN_WISE sharding requires num_shards ({sharding_option.num_shards}) <= "
                f"num_devices ({len(minheap_devices)})")
        used: set[int] = set()
        for i, shard in enumerate(sharding_option.shards):
            free = sorted((od for od in minheap_devices if od.device.rank not in used),
                          key=lambda od: (od.device.perf.total, od.device.rank % od.local_world_size,
                                          od.device.rank))
            target = next((od.device for od in free if shard.storage.fits_in(od.device.storage)),
                          None)
            if target is None:
                raise _partition_error(
                    f"COLUMN_WISE partition failed: no rank left for shard {shard} of table "
                    f"{sharding_option.name} (used ranks {sorted(used)})")
            _place(sharding_option, i, target)
            used.add(target.rank)
        heapq.heapify(minheap_devices)

    @classmethod
    def _device_partition(
        cls,
        sharding_option: ShardingOption,
        minheap_devices: list[OrderedDeviceHardware],
        bulk_heapify_threshold: float = 0.25,
    ) -> None:
        pushlimit = len(minheap_devices) * bulk_heapify_threshold
        for i, shard in enumerate(sharding_option.shards):
            skipped = []
            while minheap_devices:
                ordered = minheap_devices[0]
                if shard.storage.fits_in(ordered.device.storage):
                    _place(sharding_option, i, ordered.device)
                    heapq.heapreplace(minheap_devices, ordered)
                    break
                skipped.append(heapq.heappop(minheap_devices))
            else:
                largest = max(od.device.storage for od in skipped)
                raise _partition_error(
                    f"Device partition failed. Couldn't find a rank for shard {shard} of table "
                    f"{sharding_option.name}, largest device storage: {largest}")
            if len(skipped) <= pushlimit:
                for ordered in skipped:
                    heapq.heappush(minheap_devices, ordered)
            else:
                minheap_devices.extend(skipped)
                heapq.heapify(minheap_devices)

    @classmethod
    def _multi_hosts_partition(
        cls, sharding_option_group: ShardingOptionGroup,
        _host_level_devices: list[list[DeviceHardware]],
    ) -> None:
        """Grid-sharded options over ``num_shards / local_world_size`` whole hosts, the
        least-loaded first (hosts reused round-robin when there are too few)."""
        options = sharding_option_group.sharding_options
        if len(options) != 1:
            raise _partition_error(f"Unexpected length for sharding options: {len(options)}. "
                                   "Length needs to be 1")
        so = options[0]
        local = len(_host_level_devices[0])
        needed, rest = divmod(so.num_shards, local)
        if rest:
            raise _partition_error(
                "Grid Sharding is unable to place shards equally over hosts without "
                f"overlapping. num_shards={so.num_shards} % local_world_size={local} != 0")
        hosts = _sort_devices_by_perf(_host_level_devices)
        start = 0
        while True:
            all_used = needed >= len(hosts)
            if all_used:
                devices = [d for i in range(needed) for d in hosts[i % len(hosts)]]
            else:
                devices = list(itertools.chain(*hosts[start:start + needed]))
            start += 1
            trial = copy.deepcopy(devices)
            try:
                if so.sharding_type != "grid_shard":
                    raise _partition_error(
                        f"unexpected multi_host sharding type: {so.sharding_type}")
                cls._uniform_partition([so], trial)
            except PlannerError:
                if start + needed > len(hosts) or all_used:
                    break
                continue
            _keep_trial(devices, trial)
            return
        raise _partition_error(f"can't find hosts for sharding option group {sharding_option_group}")

    @classmethod
    def _cohost_partition(
        cls, sharding_option_group: ShardingOptionGroup,
        _host_level_devices: list[list[DeviceHardware]],
    ) -> None:
        """Table-row-wise (shard i on local rank i) and table-column-wise (greedy) options of
        a group on the least-loaded host that holds them."""
        for devices in _sort_devices_by_perf(_host_level_devices):
            trial = copy.deepcopy(devices)
            capacity = Storage(0, 0, 0)
            for device in trial:
                capacity += device.storage
            if not sharding_option_group.storage_sum.fits_in(capacity):
                continue
            heap: list[OrderedDeviceHardware] | None = None
            try:
                for so in sharding_option_group.sharding_options:
                    if so.sharding_type == "table_row_wise":
                        cls._uniform_partition([so], trial)
                        heap = None
                    elif so.sharding_type == "table_column_wise":
                        if heap is None:
                            heap = cls._establish_minheap(trial, len(trial))
                        cls._device_partition(so, heap)
                    else:
                        raise _partition_error(
                            f"unexpected cohost sharding type: {so.sharding_type}")
            except PlannerError:
                continue
            trial.sort(key=lambda d: d.rank)
            _keep_trial(devices, trial)
            return
        raise _partition_error(f"can't find a host for sharding option group {sharding_option_group}")

    @staticmethod
    def _get_host_level_devices(
        topology: Topology, all_devices: list[DeviceHardware]
    ) -> list[list[DeviceHardware]]:
        size = topology.intra_group_size
        return [all_devices[i * size:(i + 1) * size] for i in range(topology.world_size // size)]

    @staticmethod
    def _uniform_partition(
        sharding_options: list[ShardingOption], devices: list[DeviceHardware]
    ) -> None:
        for so in sharding_options:
            if so.num_shards != len(devices):
                raise _partition_error(
                    f"For a uniform partition, the number of shards ({so.num_shards}) must equal "
                    f"the number of devices ({len(devices)})")
            for i, device in enumerate(devices):
                needed = so.shards[i].storage
                if not needed.fits_in(device.storage):
                    raise _partition_error(
                        f"Shard of size {needed} bytes does not fit on any rank. Device memory "
                        f"cap: {device.storage}.")
                _place(so, i, device)


def _sort_devices_by_perf(devices: list[list[DeviceHardware]]) -> list[list[DeviceHardware]]:
    return sorted(devices, key=lambda host: sum(d.perf.total for d in host))


def _keep_trial(devices: list[DeviceHardware], trial: list[DeviceHardware]) -> None:
    """Take a placement tried on copies of ``devices``: each device's storage and perf."""
    for device, placed in zip(devices, trial, strict=False):
        device.storage, device.perf = placed.storage, placed.perf


class MemoryBalancedPartitioner(Partitioner):
    """Greedy partitions (sorted by perf) at smaller and smaller HBM per rank, by bisection
    between the average (or largest shard) and the greedy plan's peak: keeps the smallest
    whose rating (NoopPerfModel) is within ``tolerance`` of the greedy plan's.

    Args:
        max_search_count: at most this many extra partitions.
        tolerance: accepted relative slowdown (0.02: 2%).
        balance_modules: as GreedyPerfPartitioner's.
    """

    def __init__(self, max_search_count: int = 10, tolerance: float = 0.02,
                 balance_modules: bool = False) -> None:
        self._max_search_count = max_search_count
        self._tolerance = tolerance
        self._balance_modules = balance_modules

    def partition(
        self, proposal: list[ShardingOption], storage_constraint: Topology
    ) -> list[ShardingOption]:
        perf_model = NoopPerfModel(storage_constraint)
        greedy = GreedyPerfPartitioner(sort_by=SortBy.PERF, balance_modules=self._balance_modules)
        default_plan = greedy.partition(proposal, storage_constraint)
        best = [so.get_shards_assignment() for so in default_plan]
        original = perf_model.rate(default_plan)
        hbm_by_rank = [0] * storage_constraint.world_size
        total = largest_shard = 0
        for so in default_plan:
            for shard in so.shards:
                if shard.storage is not None and shard.rank is not None:
                    hbm_by_rank[shard.rank] += shard.storage.hbm
                    total += shard.storage.hbm
                    largest_shard = max(largest_shard, shard.storage.hbm)
        high = max(hbm_by_rank)
        low = max(int(total / storage_constraint.world_size), largest_shard)
        searches = 0
        while searches < self._max_search_count and low + mb_to_bytes(10) < high:
            searches += 1
            reset_shard_rank(proposal)
            mid = (high + low) // 2
            try:
                plan = greedy.partition(proposal, storage_constraint, mid)
            except PlannerError:
                low = mid
                continue
            if perf_model.rate(plan) > original * (1 + self._tolerance):
                low = mid
            else:
                logger.info("MemoryBalancedPartitioner: a plan with %.3f GB per rank",
                            bytes_to_gb(mid))
                best = [so.get_shards_assignment() for so in plan]
                high = mid
        for so, ranks in zip(default_plan, best, strict=False):
            for shard, rank in zip(so.shards, ranks, strict=False):
                shard.rank = rank
        return default_plan
