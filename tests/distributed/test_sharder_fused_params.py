"""A sharder takes the fused optimizer as TorchRec's ``fused_params`` dict or as the typed
``FusedOptimizerConfig``; both give the same optimizer to the sharded tables and the same dict
to the planner."""

from __future__ import annotations

import torch

from recsys_core.distributed import EmbeddingBagCollectionSharder, ShardingEnv
from recsys_core.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig
from recsys_core.modules import EmbeddingBagCollection, EmbeddingBagConfig
from recsys_core.planner import EmbeddingShardingPlanner, Topology
from recsys_core.sparse import KeyedJaggedTensor


def _ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100, feature_names=["f0"]),
    ], device=torch.device("meta"))


def test_typed_config_and_dict_are_the_same_sharder() -> None:
    typed = FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_ADAGRAD, learning_rate=0.05,
                                 eps=1e-6)
    as_dict = {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.05, "eps": 1e-6}
    a = EmbeddingBagCollectionSharder(fused_params=typed)
    b = EmbeddingBagCollectionSharder(fused_params=as_dict)
    ebc = _ebc()
    assert a.optimizer_config(ebc) == b.optimizer_config(ebc) == typed
    # the planner reads the dict: every field, the given ones with their values
    assert a.fused_params["optimizer"] is EmbOptimType.EXACT_ADAGRAD
    assert a.fused_params["learning_rate"] == 0.05 and a.fused_params["eps"] == 1e-6
    assert set(a.fused_params) == {"optimizer", "learning_rate", "eps", "beta1", "beta2",
                                   "weight_decay", "weight_decay_mode"}
    # ...and plans the same way (Adagrad's per-element state counted in both)
    topology = Topology(world_size=2, compute_device="cpu")
    plans = [EmbeddingShardingPlanner(topology=topology).plan(_ebc(), [s]) for s in (a, b)]
    assert str(plans[0]) == str(plans[1])


def test_sharded_tables_use_the_typed_optimizer() -> None:
    typed = FusedOptimizerConfig(optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.5)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"]),
    ])
    before = ebc.embedding_bags["t0"].weight.detach().clone()
    plan = construct_module_sharding_plan(ebc, {"t0": table_wise(rank=0, compute_kernel="fused")}, world_size=1)
    sharded = EmbeddingBagCollectionSharder(fused_params=typed).shard(
        ebc, plan, ShardingEnv.from_local(1, 0))
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([3]), torch.tensor([1]))
    sharded(kjt).wait().values().sum().backward()
    after = sharded.state_dict()["embedding_bags.t0.weight"]
    expected = before.clone()
    expected[3] -= 0.5  # SGD, lr 0.5, gradient 1 per element of the looked-up row
    torch.testing.assert_close(after, expected)
