"""Planning against the memory the machine really has: a model that does not fit fails at
planning, with how much it needs, how much each rank has and where that figure came from."""

from __future__ import annotations

import pickle

import pytest
import torch
from gloo_setup import world_env

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig
from recsys_core.distributed import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    ShardingEnv,
)
from recsys_core.planner import (
    EmbeddingShardingPlanner,
    MemoryReading,
    PlannerError,
    Topology,
    detect_topology,
    host_memory,
    plan_for_env,
)
from recsys_core.testing import run_gloo

GIB = 1024**3
SHARDERS = [EmbeddingBagCollectionSharder()]
ROW_BYTES_128 = 128 * 4 + 4  # fp32 row of 128 + its row-wise Adagrad state


def ebc(rows: list[int], dim: int = 128) -> EmbeddingBagCollection:
    return EmbeddingBagCollection([
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=r, feature_names=[f"f{i}"])
        for i, r in enumerate(rows)
    ], device="meta")


# 12M + 4M rows x 128: 7.7 GiB of weights and state; 2 ranks of a 7 GiB host have 5.95 GiB
TOO_BIG = [12_000_000, 4_000_000, 1000]


def test_model_bigger_than_detected_memory_fails_at_planning(host_7gib: MemoryReading) -> None:
    module = ebc(TOO_BIG)
    EmbeddingShardingPlanner(topology=Topology(2, "cpu")).plan(module, SHARDERS)  # 128 GiB: fits
    topology = detect_topology(2, "cpu", local_world_size=2, host=host_7gib)
    with pytest.raises(PlannerError) as info:
        EmbeddingShardingPlanner(topology=topology).plan(module, SHARDERS)
    message = str(info.value)
    for part in [
        "does not fit", "of host memory", "5.95 GiB usable",  # 2 x 3.5 GiB x (1 - 0.15)
        "3.50 GiB of host memory per rank (7.00 GiB on a host, shared by 2 ranks)",
        "MemAvailable 20.00 GiB", "cgroup v2 limit memory.max 8.00 GiB - 1.00 GiB used",
        "'t0' 12000000 x 128 FP32: 5.7", "'t1' 4000000 x 128 FP32: 1.9",  # per table, largest first
        "smaller tables", "more ranks", "memory budget",
    ]:
        assert part in message, part
    shortfall = info.value.shortfall
    assert shortfall is not None and shortfall.memory == "host memory"
    kjt = 3 * 512 * 8 * 20  # TorchRec's input-KJT estimate per rank: 3 features at batch 512
    assert shortfall.usable_bytes == pytest.approx(2 * (3.5 * GIB * 0.85 - kjt))
    assert shortfall.needed_bytes > 7.6 * GIB
    assert [t.table for t in shortfall.largest] == ["t0", "t1", "t2"]
    restored = pickle.loads(pickle.dumps(info.value))  # collective_plan sends it to every rank
    assert str(restored) == message and restored.shortfall == shortfall


def test_override_sets_the_planned_budget(host_7gib: MemoryReading) -> None:
    topology = detect_topology(2, "cpu", local_world_size=2, memory_per_rank=8 * GIB, host=host_7gib)
    planner = EmbeddingShardingPlanner(topology=topology)
    planner.plan(ebc(TOO_BIG), SHARDERS)
    kjt = 3 * 512 * 8 * 20  # TorchRec's input-KJT estimate: 3 features at batch 512
    assert planner.stats is not None and planner.stats.ddr_budget == pytest.approx(
        0.85 * 8 * GIB - kjt)


def test_plan_for_env_plans_for_the_given_detected_topology(host_7gib: MemoryReading) -> None:
    env = ShardingEnv(world_size=2, rank=0, local_world_size=2)
    topology = detect_topology(2, "cpu", local_world_size=2, host=host_7gib)
    with pytest.raises(PlannerError, match=r"5\.95 GiB usable.*MemAvailable 20\.00 GiB"):
        plan_for_env(ebc(TOO_BIG), env, SHARDERS, "cpu", topology=topology)


def test_dmp_default_plan_is_for_this_machine_not_128_gib() -> None:
    # a table twice this machine's available memory: the planner must refuse it before the
    # sharder allocates anything (the model is on meta)
    available = host_memory().available
    module = ebc([int(2 * available / ROW_BYTES_128) + 1, 1000])
    if 2 * available < 0.8 * 128 * GIB:  # what the planner believed before, 108.8 GiB usable
        EmbeddingShardingPlanner(topology=Topology(1, "cpu")).plan(module, SHARDERS)
    env = ShardingEnv.from_local(1, 0)
    with pytest.raises(PlannerError, match=r"(MemAvailable|physical memory).*'t0'"):
        plan_for_env(module, env, SHARDERS, "cpu")  # DMP's default plan, without allocating
    with pytest.raises(PlannerError, match="read by detect_topology"):
        DistributedModelParallel(module, env=env, device=torch.device("cpu"))


def uneven_hosts_worker(rank: int, world: int) -> tuple[str, bool]:
    reading = MemoryReading(available=(16 if rank == 0 else 4) * GIB, source=f"fake host of rank {rank}")
    env = world_env()
    topology = detect_topology(world, "cpu", local_world_size=1, host=reading)
    try:
        plan_for_env(ebc([20_000_000, 1000]), env, SHARDERS, "cpu", topology=topology)
    except PlannerError as exc:
        return str(exc), exc.shortfall is not None
    return "planned", False


def test_plan_must_fit_on_the_smallest_host() -> None:
    # 9.6 GiB of tables: two hosts like rank 0's (16 GiB) would hold them, two like rank 1's
    # (4 GiB) cannot
    results = run_gloo(2, uneven_hosts_worker, local_world_size=1)
    for message, has_shortfall in results:
        assert "does not fit" in message and "fake host of rank 1" in message, message
        assert has_shortfall


def test_small_models_figures_read_in_units_that_fit() -> None:
    """A small model on a tiny budget: sizes in KiB/MiB (not "0.00 GiB" fifteen times), and
    one rank "has", not "the 1 ranks have"."""
    from recsys_core.planner.units import format_bytes

    assert [format_bytes(n) for n in (0, 1023, 1536, 5 * 2**20, 3 * GIB, 2 * 2**40)] == [
        "0 B", "1023 B", "1.50 KiB", "5.00 MiB", "3.00 GiB", "2.00 TiB"]
    module = ebc([5000, 4000], dim=16)
    with pytest.raises(PlannerError) as info:
        EmbeddingShardingPlanner(topology=Topology(1, "cpu", ddr_cap=100 * 1024)).plan(
            module, SHARDERS)
    message = str(info.value)
    assert "0.00 GiB" not in message and "its 1 rank has" in message, message
    assert "'t0' 5000 x 16 FP32: 384.50 KiB" in message, message  # weights, state, buffers
