"""dlrm_app.training.resources: the run's topology (--memory-per-rank), table memory, and the user-level
error when the DLRM's tables do not fit."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from dlrm_app.data.schema import DatasetKind, DatasetSpec, SparseFeature, SplitSpec
from dlrm_app.model import ModelConfig, build_dlrm
from dlrm_app.training.build import WideSharder
from dlrm_app.training.config import EmbeddingOptimizer, TrainConfig
from dlrm_app.training.resources import (
    planning_error_for_user,
    table_memory_bytes,
    topology_for_run,
)
from recsys_core import EmbOptimType
from recsys_core.distributed import EmbeddingBagCollectionSharder, ShardingEnv
from recsys_core.planner import PlannerError, plan_for_env

GIB = 1024**3
# Criteo-1TB-like cardinalities, a few tables large: 44.4M rows in all
ROWS = [40_000_000, 3_000_000, 1_000_000, 200_000] + [10_000] * 22
SHARDER = EmbeddingBagCollectionSharder(fused_params={
    "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
# as dlrm_app.training.build.build_model shards the DLRM: the wide part's tables by their own sharder
SHARDERS = [WideSharder(fused_params=SHARDER.fused_params), SHARDER]


def dlrm_spec(rows: list[int]) -> DatasetSpec:
    return DatasetSpec(
        name="criteo-like", kind=DatasetKind.SYNTHETIC, dense_features=("d0", "d1"),
        sparse_features=tuple(SparseFeature(name=f"c{i}", num_embeddings=r, multi_hot=False)
                              for i, r in enumerate(rows)),
        label="label", label_dtype="float32", parameters={}, created_by="test",
        splits=tuple(SplitSpec(name=n, label_rate=0.5, shards=()) for n in ("train", "validation", "test")),
    )


def plan_dlrm(rows: list[int], dim: int, memory_per_rank_gib: float | None) -> None:
    model = build_dlrm(dlrm_spec(rows), ModelConfig(embedding_dim=dim), device="meta")
    topology = topology_for_run(2, 2, "cpu", memory_per_rank_gib)
    plan_for_env(model, ShardingEnv(world_size=2, rank=0, local_world_size=2), SHARDERS, "cpu",
                 topology=topology)


def user_error(rows: list[int], dim: int, memory_per_rank_gib: float) -> tuple[str, PlannerError]:
    with pytest.raises(PlannerError) as info:
        plan_dlrm(rows, dim, memory_per_rank_gib)
    error = planning_error_for_user(info.value)
    assert isinstance(error, ValueError)
    return str(error), info.value


def test_memory_per_rank_overrides_detection() -> None:
    topology = topology_for_run(4, 2, "cpu", 3.5)
    assert (topology.ddr_per_rank, topology.num_hosts, topology.hbm_per_rank) == (3.5 * GIB, 2, 0)
    assert "given explicitly" in topology.memory_source


def test_without_override_the_machine_is_read() -> None:
    topology = topology_for_run(2, 2, torch.device("cpu"), None)
    assert topology.ddr_cap > 0 and topology.local_world_size == 2
    assert "read by detect_topology" in topology.memory_source


@pytest.mark.gpu
def test_cuda_run_reads_the_device() -> None:
    topology = topology_for_run(1, 1, torch.device("cuda", 0), None)
    assert 0 < topology.hbm_cap <= torch.cuda.mem_get_info(0)[1]
    assert topology_for_run(1, 1, "cuda:0", 2.0).hbm_cap == 2 * GIB


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_memory_per_rank_names_the_flag(bad: float) -> None:
    # checked once, where the flag becomes the config (topology_for_run takes it as given)
    with pytest.raises(ValueError, match="--memory-per-rank .*: give a positive number of GiB"):
        TrainConfig.from_flags(data="d", out="o", memory_per_rank=bad)


@pytest.mark.parametrize(("optimizer", "expected"), [
    ("rowwise_adagrad", 1000 * 16 * 4 + 1000 * 4),  # one float of state per row
    ("adagrad", 1000 * 16 * 4 * 2),  # one per element
    ("sgd", 1000 * 16 * 4),  # none
    (EmbeddingOptimizer.ROWWISE_ADAGRAD, 1000 * 16 * 4 + 1000 * 4),
])
def test_table_memory_is_weights_plus_optimizer_state(optimizer: str, expected: int) -> None:
    assert table_memory_bytes([1000], 16, optimizer) == expected
    assert table_memory_bytes([1000, 1000, 1000], 16, optimizer) == 3 * expected


@pytest.mark.parametrize(("args", "message"), [
    (([10], 16, "adam"), "not one of sgd, adagrad, rowwise_adagrad"),
    (([10], 0, "sgd"), "embedding_dim"),
    (([10, 0], 8, "sgd"), r"num_embeddings.*\[0\]"),
])
def test_table_memory_rejects_bad_arguments(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        table_memory_bytes(*args)


def test_dlrm_too_big_names_the_cli_fixes() -> None:
    text, error = user_error(ROWS, 128, 4.0)
    # the figures: need, per rank, where that came from, largest tables; usable = 4 GiB x 2 ranks
    # less the planner's reservations (15%, and 6x the dense parameters as TorchRec's heuristic)
    assert "21." in text and "6.77 GiB usable" in text and "4.00 GiB of host memory per rank" in text
    assert "memory_per_rank 4.00 GiB given explicitly" in text
    assert "'t_c0' 40000000 x 128 FP32" in text
    # the fixes are this application's flags, not the library's knobs
    for flag in ["dlrm-app preprocess criteo ... --max-embeddings-per-feature N",
                 "dlrm-app train ... --embedding-dim N", "--memory-per-rank GIB",
                 "torchrun --nnodes M --nproc-per-node 2", "more nodes (about 4 in all)"]:
        assert flag in text, flag
    assert "Topology hbm_cap" not in text and "detect_topology(memory_per_rank" not in text
    # what preprocess prints is the planner's own estimate, without the buffers
    weights = table_memory_bytes(ROWS, 128, "rowwise_adagrad")
    assert error.shortfall is not None
    assert 0.95 * error.shortfall.needed_bytes < weights < error.shortfall.needed_bytes


def test_suggested_sizes_fit() -> None:
    text, _ = user_error(ROWS, 128, 4.0)
    cap = int(re.search(r"--max-embeddings-per-feature N`, e\.g\. N = (\d+)", text).group(1))
    dim = int(re.search(r"--embedding-dim N`, e\.g\. N = (\d+) instead of 128", text).group(1))
    assert 1_000_000 < cap < 40_000_000 and 8 <= dim < 128
    plan_dlrm([min(r, cap) for r in ROWS], 128, 4.0)
    plan_dlrm(ROWS, dim, 4.0)
    need = float(re.search(r"needs about (\d+\.\d) GiB per rank", text).group(1))
    plan_dlrm(ROWS, 128, need + 0.1)


def test_other_planner_errors_keep_their_message() -> None:
    error = planning_error_for_user(PlannerError("constraints name tables ['x']"))
    assert isinstance(error, ValueError) and str(error) == "constraints name tables ['x']"


def plan_with_disk(rows: list[int], dim: int, memory_gib: float, disk_gib: float):
    model = build_dlrm(dlrm_spec(rows), ModelConfig(embedding_dim=dim), device="meta")
    topology = dataclasses.replace(topology_for_run(2, 2, "cpu", memory_gib),
                                   ssd_cap=int(disk_gib * GIB))
    return plan_for_env(model, ShardingEnv(world_size=2, rank=0, local_world_size=2), SHARDERS,
                        "cpu", topology=topology)


def test_with_disk_the_tables_beyond_memory_are_offloaded() -> None:
    # 21.3 GiB of tables on 2 ranks of 4 GiB: the largest live on disk behind caches
    plan = plan_with_disk(ROWS, 128, 4.0, 20.0)
    kernels = {name: ps.compute_kernel for module in plan.plan.values()
               for name, ps in module.items()}
    assert kernels["t_c0"] == "fused_uvm_caching" and kernels["t_c4"] == "fused"


def test_disk_too_small_names_the_offload_dir_flag() -> None:
    with pytest.raises(PlannerError) as info:
        plan_with_disk(ROWS, 128, 4.0, 2.0)
    assert info.value.shortfall is not None
    assert info.value.shortfall.memory in ("disk", "memory (host + disk)")
    text = str(planning_error_for_user(info.value))
    per_rank = float(re.search(r"--offload-dir DIR` on a local disk with more free space: the "
                               r"tables kept on disk need at most about (\d+\.\d\d) GiB per rank", text)[1])
    assert 2.0 < per_rank <= info.value.shortfall.needed_bytes / GIB / 2 + 0.01
    assert "drop `--no-offload`" not in text
    plan_with_disk(ROWS, 128, 4.0, per_rank + 0.1)


def test_without_offload_the_error_offers_it() -> None:
    with pytest.raises(PlannerError) as info:
        plan_dlrm(ROWS, 128, 4.0)
    assert "drop `--no-offload`" in str(planning_error_for_user(info.value, offload=False))
    assert "--no-offload" not in str(planning_error_for_user(info.value, offload=True))


def test_sizes_in_planning_messages_take_the_unit_that_fits() -> None:
    from dlrm_app.training.resources import _gib

    # a tiny offload folder's shortfall read "0.00 GiB"
    assert [_gib(v) for v in (3.5 * 2**30, 12.3 * 2**10, 600 * 2**20, 5, 0)] == [
        "3.50 GiB", "12.30 KiB", "600.00 MiB", "5 B", "0 B"]
