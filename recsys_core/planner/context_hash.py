"""Hashes of a planner's inputs (TorchRec's ``hash_planner_context_inputs``): a stored plan is
reused only while the hash of what it was planned for is unchanged.

Device memory is rounded to the nearest 100 GiB (``HUNDRED_GB``) so that machines whose free
memory differs slightly hash alike; every other topology figure is taken as is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from recsys_core.planner.constants import HUNDRED_GB


def hash_sha256_to_int(hashable_list: list[Any]) -> int:
    """SHA-256 of ``str(hashable_list)`` as an int."""
    return int(hash_sha256_str(hashable_list), 16)


def hash_sha256_str(hashable_list: list[Any]) -> str:
    """SHA-256 of ``str(hashable_list)`` as hex."""
    return hashlib.sha256(str(hashable_list).encode("utf-8")).hexdigest()


def round_to_nearest(x: int, unit: int) -> int:
    return round(x / unit) * unit


def _topology_components(topology: Any, unit: int = HUNDRED_GB) -> list[Any]:
    devices = [
        (d.rank, round_to_nearest(d.storage.hbm, unit), round_to_nearest(d.storage.ddr, unit),
         round_to_nearest(d.storage.ssd, unit))
        for d in topology.devices
    ]
    bws = topology.comms_bandwidths
    return [
        topology.world_size, topology.compute_device, devices, topology.local_world_size,
        topology.intra_group_size, topology.hbm_mem_bw, topology.ddr_mem_bw,
        topology.ssd_mem_bw, topology.hbm_to_ddr_mem_bw, bws.intra_host_bw, bws.inter_host_bw,
        topology.bwd_compute_multiplier, topology.weighted_feature_bwd_compute_multiplier,
        topology.uneven_sharding_perf_multiplier,
    ]


def _shard_components(shard: Any) -> tuple[Any, ...]:
    storage = shard.storage
    return (tuple(shard.size), tuple(shard.offset), shard.rank,
            (storage.hbm, storage.ddr, storage.ssd) if storage else None)


def _hashable_list(
    topology: Any, batch_size: int, enumerator: Any, storage_reservation: Any,
    constraints: dict[str, Any] | None,
) -> list[Any]:
    search_space = getattr(enumerator, "last_stored_search_space", None)
    if search_space is None:
        raise ValueError(
            "hash_planner_context_inputs: the enumerator has no stored search space "
            "(last_stored_search_space); call enumerate() first"
        )
    reserved = storage_reservation.last_reserved_topology
    if reserved is None:
        raise ValueError(
            "hash_planner_context_inputs: the storage reservation has not reserved a topology "
            "yet (last_reserved_topology); call reserve() first"
        )
    return [
        hash_sha256_to_int(_topology_components(topology)),
        batch_size,
        [[so.fqn, so.sharding_type, so.compute_kernel,
          tuple(_shard_components(s) for s in so.shards), so.cache_params]
         for so in search_space],
        type(storage_reservation).__name__,
        hash_sha256_to_int(_topology_components(reserved)),
        tuple((k, hash(v)) for k, v in sorted(constraints.items())) if constraints else None,
    ]


def hash_planner_context_inputs(
    topology: Any,
    batch_size: int,
    enumerator: Any,
    storage_reservation: Any,
    constraints: dict[str, Any] | None,
    hash_function: Callable[[list[Any]], int] = hash_sha256_to_int,
) -> int:
    """One int for the topology, batch size, search space, reservation and constraints."""
    return hash_function(
        _hashable_list(topology, batch_size, enumerator, storage_reservation, constraints)
    )


def hash_planner_context_inputs_str(
    topology: Any,
    batch_size: int,
    enumerator: Any,
    storage_reservation: Any,
    constraints: dict[str, Any] | None,
    hash_function: Callable[[list[Any]], str] = hash_sha256_str,
) -> str:
    """As :func:`hash_planner_context_inputs`, as a hex string."""
    return hash_function(
        _hashable_list(topology, batch_size, enumerator, storage_reservation, constraints)
    )
