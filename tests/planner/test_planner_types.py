"""Topology, CacheParams and ParameterConstraints: defaults, coercion and argument checks."""

from __future__ import annotations

import json

import pytest

from recsys_core import DataType
from recsys_core.distributed import EmbeddingComputeKernel, ShardingType
from recsys_core.planner import CacheAlgorithm, CacheParams, ParameterConstraints, Topology

GIB = 1024**3


def test_topology_defaults_cuda_and_cpu() -> None:
    cuda = Topology(world_size=16, compute_device="cuda", local_world_size=8)
    # TorchRec's constants: 32 GiB of HBM and 128 GiB of host memory, each per rank
    assert (cuda.hbm_per_rank, cuda.ddr_per_rank, cuda.num_hosts) == (32 * GIB, 128 * GIB, 2)
    cpu = Topology(world_size=4, compute_device="cpu")
    assert cpu.local_world_size == 4
    assert (cpu.hbm_per_rank, cpu.ddr_per_rank) == (0, 128 * GIB)  # ddr_cap is per rank
    assert cpu.intra_host_bw < cuda.intra_host_bw  # gloo loopback, not NVLink


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 4, "compute_device": "tpu"}, "compute_device"),
        ({"world_size": 6, "local_world_size": 0}, "local_world_size"),
        ({"world_size": 2, "compute_device": "cpu", "hbm_cap": GIB}, "no HBM"),
        ({"world_size": 2, "ddr_cap": -1}, "ddr_cap"),
        ({"world_size": 2, "inter_host_bw": 0}, "inter_host_bw"),
    ],
)
def test_topology_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Topology(**kwargs)


def test_cache_params_round_trip_through_json() -> None:
    params = CacheParams(algorithm=CacheAlgorithm.LFU, load_factor=0.25, precision=DataType.FP16,
                         reserved_memory=1.5, prefetch_pipeline=True)
    data = json.loads(json.dumps(params.to_dict()))
    assert data["algorithm"] == "lfu" and data["precision"] == "FP16"
    assert CacheParams.from_dict(data) == params
    assert CacheParams(algorithm="lru").algorithm is CacheAlgorithm.LRU


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"load_factor": -0.1}, "load_factor"),  # 0 is accepted, as TorchRec
        ({"load_factor": 1.5}, "load_factor"),
        ({"reserved_memory": -1.0}, "reserved_memory"),
        ({"precision": DataType.INT8}, "precision"),
        ({"algorithm": "fifo"}, "algorithm"),
    ],
)
def test_cache_params_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CacheParams(**kwargs)


def test_constraints_coerce_strings_to_enums_in_lists() -> None:
    c = ParameterConstraints(sharding_types=["table_wise", ShardingType.ROW_WISE],
                             compute_kernels=("fused",), pooling_factors=(2.0, 3.0))
    assert c.sharding_types == [ShardingType.TABLE_WISE, ShardingType.ROW_WISE]
    assert c.sharding_types == ["table_wise", "row_wise"]  # str enums, as TorchRec's strings
    assert c.compute_kernels == [EmbeddingComputeKernel.FUSED]
    assert c.pooling_factors == [2.0, 3.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sharding_types": ["diagonal"]}, "ShardingType"),
        ({"sharding_types": []}, "empty"),
        ({"min_partition": 0}, "min_partition"),
        ({"pooling_factors": [0.0]}, "pooling_factors"),
        ({"pooling_factors": 2.0}, "one value per feature"),
        ({"cache_params": {"load_factor": 0.1}}, "CacheParams"),
    ],
)
def test_constraints_reject_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParameterConstraints(**kwargs)
