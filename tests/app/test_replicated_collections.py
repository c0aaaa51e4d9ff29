"""dlrm_app.training.build.replicated_collections: on several ranks of one CPU host, the DLRM's small
collections (embeddings, wide part) are planned data-parallel; large ones, other hosts, other
devices and raw-id tables keep the planner's choice."""

from __future__ import annotations

import dataclasses

import torch
from test_resources import SHARDERS, dlrm_spec

from dlrm_app.model import ModelConfig, build_dlrm
from dlrm_app.training.build import (
    REPLICATE_COLLECTION_BYTES,
    collection_bytes,
    replicated_collections,
)
from dlrm_app.training.config import EmbeddingOptimizer
from recsys_core.distributed import ShardingEnv
from recsys_core.planner import plan_for_env

CPU = torch.device("cpu")
ONE_HOST = ShardingEnv(world_size=2, rank=0, local_world_size=2)
ROWWISE = EmbeddingOptimizer.ROWWISE_ADAGRAD
MEMORY = 8 * 1024**3  # a rank's memory, bytes


def test_collection_bytes_by_hand() -> None:
    model = build_dlrm(dlrm_spec([100, 50]), ModelConfig(embedding_dim=16), device="meta")
    main, wide = model.sparse_arch.embedding_bag_collection, model.wide.tables
    # 150 rows: weights 150 x 16 fp32, row-wise Adagrad one fp32 per row
    assert collection_bytes(main, ROWWISE) == 4 * 150 * 16 + 4 * 150
    assert collection_bytes(wide, ROWWISE) == 4 * 150 * 1 + 4 * 150
    assert collection_bytes(main, EmbeddingOptimizer.SGD) == 4 * 150 * 16
    # Adagrad: one state per element
    assert collection_bytes(main, EmbeddingOptimizer.ADAGRAD) == 4 * 150 * 16 * 2


def test_small_collections_on_one_host_are_data_parallel() -> None:
    spec = dlrm_spec([100, 50, 7])
    model = build_dlrm(spec, ModelConfig(embedding_dim=16), device="meta")
    constraints = replicated_collections(model, ONE_HOST, CPU, ROWWISE, MEMORY)
    names = [p + f.name for p in ("t_", "w_") for f in spec.sparse_features]
    assert sorted(constraints) == sorted(names)
    assert all(c.sharding_types == ["data_parallel"] for c in constraints.values())
    plan = plan_for_env(model, ONE_HOST, SHARDERS, "cpu", constraints=constraints)
    kinds = {ps.sharding_type.value for module in plan.plan.values() for ps in module.values()}
    assert kinds == {"data_parallel"}
    # without the constraints the planner spreads the same tables table-wise
    plain = plan_for_env(model, ONE_HOST, SHARDERS, "cpu")
    assert "table_wise" in {ps.sharding_type.value for m in plain.plan.values() for ps in m.values()}


def test_one_rank_other_hosts_and_devices_keep_the_planners_choice() -> None:
    model = build_dlrm(dlrm_spec([100, 50]), ModelConfig(embedding_dim=16), device="meta")
    assert replicated_collections(model, ShardingEnv(world_size=1, rank=0), CPU, ROWWISE,
                                  MEMORY) == {}
    two_hosts = ShardingEnv(world_size=4, rank=0, local_world_size=2)
    assert replicated_collections(model, two_hosts, CPU, ROWWISE, MEMORY) == {}
    assert replicated_collections(model, ONE_HOST, torch.device("cuda"), ROWWISE, MEMORY) == {}


def test_a_large_collection_keeps_its_plan_while_the_wide_part_is_replicated() -> None:
    # 70,000 rows x 16: 4.48 MB of weights + 0.28 MB of state > 4 MiB; the wide part 0.56 MB
    rows = [60_000, 10_000]
    model = build_dlrm(dlrm_spec(rows), ModelConfig(embedding_dim=16), device="meta")
    assert collection_bytes(model.sparse_arch.embedding_bag_collection, ROWWISE) \
        > REPLICATE_COLLECTION_BYTES >= collection_bytes(model.wide.tables, ROWWISE)
    assert sorted(replicated_collections(model, ONE_HOST, CPU, ROWWISE, MEMORY)) == ["w_c0", "w_c1"]
    # the same tables at dim 8 fit: both collections are replicated
    small = build_dlrm(dlrm_spec(rows), ModelConfig(embedding_dim=8), device="meta")
    assert len(replicated_collections(small, ONE_HOST, CPU, ROWWISE, MEMORY)) == 4


def test_raw_id_tables_are_left_to_their_row_wise_plan() -> None:
    spec = dlrm_spec([100, 50])
    raw = dataclasses.replace(spec.sparse_features[1], raw_ids=True, num_embeddings=1 << 31)
    spec = dataclasses.replace(spec, sparse_features=(spec.sparse_features[0], raw))
    model = build_dlrm(spec, ModelConfig(embedding_dim=16, zch_rows=64), device="meta")
    # the encoded feature's table and its wide table only (raw ids have no wide table)
    assert sorted(replicated_collections(model, ONE_HOST, CPU, ROWWISE, MEMORY)) == ["t_c0", "w_c0"]


def test_replicas_stay_within_a_small_share_of_a_ranks_memory() -> None:
    # main 10,200 bytes, wide 1,200 (see the first test): 1% of a rank's memory must hold them
    model = build_dlrm(dlrm_spec([100, 50]), ModelConfig(embedding_dim=16), device="meta")
    both = ["t_c0", "t_c1", "w_c0", "w_c1"]
    assert sorted(replicated_collections(model, ONE_HOST, CPU, ROWWISE, 100 * 11_400)) == both
    # room for the wide part only: the embeddings are left to the planner
    assert sorted(replicated_collections(model, ONE_HOST, CPU, ROWWISE, 100 * 10_199)) == \
        ["w_c0", "w_c1"]
    assert replicated_collections(model, ONE_HOST, CPU, ROWWISE, 100 * 1_199) == {}
