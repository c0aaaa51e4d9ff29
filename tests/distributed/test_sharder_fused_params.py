"""A sharder takes the fused optimizer as TorchRec's ``fused_params`` dict or as the typed
``FusedOptimizerConfig``; both give the same optimizer to the sharded tables and the same dict
to the planner. An optimizer applied in backward wins over them key by key, as in TorchRec."""

from __future__ import annotations

import torch

from recsys_core.distributed import EmbeddingBagCollectionSharder, ShardingEnv
from recsys_core.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from recsys_core.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from recsys_core.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig
from recsys_core.modules import EmbeddingBagCollection, EmbeddingBagConfig
from recsys_core.optim import RowWiseAdagrad, apply_optimizer_in_backward
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


# ---- an optimizer applied in backward wins over the sharder's fused_params (TorchRec's rule:
# the sharder's dict updated by the in-backward class and the arguments given to it) ----------


def _in_backward_ebc(optimizer: type, kwargs: dict) -> EmbeddingBagCollection:
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"]),
    ])
    apply_optimizer_in_backward(optimizer, ebc.parameters(), kwargs)
    return ebc


def test_in_backward_optimizer_wins_key_by_key_over_sharder_fused_params() -> None:
    ebc = _in_backward_ebc(torch.optim.Adagrad, {"lr": 0.1})
    # a sharder given only eps keeps the in-backward Adagrad and its lr (was: SGD at lr 0.01)
    config = EmbeddingBagCollectionSharder(fused_params={"eps": 1e-6}).optimizer_config(ebc)
    assert (config.optimizer, config.learning_rate, config.eps) == (
        EmbOptimType.EXACT_ADAGRAD, 0.1, 1e-6)
    # a sharder's own optimizer and learning rate lose to the in-backward ones
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05})
    config = sharder.optimizer_config(ebc)
    assert (config.optimizer, config.learning_rate) == (EmbOptimType.EXACT_ADAGRAD, 0.1)
    # ...but fill in what the in-backward optimizer was not given (TorchRec: its lr 0.05)
    config = sharder.optimizer_config(_in_backward_ebc(torch.optim.Adagrad, {}))
    assert (config.optimizer, config.learning_rate) == (EmbOptimType.EXACT_ADAGRAD, 0.05)
    # no sharder dict: the in-backward optimizer alone
    config = EmbeddingBagCollectionSharder().optimizer_config(ebc)
    assert (config.optimizer, config.learning_rate) == (EmbOptimType.EXACT_ADAGRAD, 0.1)


def test_in_backward_adagrad_eps_defaults_to_the_fused_kernels_1e_8() -> None:
    """TorchRec hands the in-backward kwargs to the fused kernel, whose eps default is 1e-8
    (torch.optim.Adagrad's own is 1e-10): with gradients of 1e-6 the two steps differ."""
    for optimizer in (torch.optim.Adagrad, RowWiseAdagrad):
        ebc = _in_backward_ebc(optimizer, {"lr": 0.1})
        assert EmbeddingBagCollectionSharder().optimizer_config(ebc).eps == 1e-8
    ebc = _in_backward_ebc(torch.optim.Adagrad, {"lr": 0.1})
    start = ebc.embedding_bags["t0"].weight.detach().clone()
    plan = construct_module_sharding_plan(ebc, {"t0": table_wise(rank=0)}, world_size=1)
    sharded = EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_local(1, 0))
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([3]), torch.tensor([1]))
    (sharded(kjt).wait().values().sum() * 1e-6).backward()
    after = sharded.state_dict()["embedding_bags.t0.weight"]
    # Adagrad's first step by hand: w -= lr * g / (sqrt(g^2) + eps), g = 1e-6 on row 3
    expected = start.clone()
    expected[3] -= 0.1 * 1e-6 / (1e-6 + 1e-8)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-7)
    assert (0.1 * 1e-6 / (1e-6 + 1e-10)) - (0.1 * 1e-6 / (1e-6 + 1e-8)) > 1e-4  # it matters


def test_managed_collision_sharders_take_fused_params_as_torchrec() -> None:
    params = {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.2}
    for sharder_type in (ManagedCollisionEmbeddingBagCollectionSharder,
                         ManagedCollisionEmbeddingCollectionSharder):
        sharder = sharder_type(None, None, params)  # TorchRec's positional order
        inner = sharder._e_sharder
        assert inner.fused_params == params
        assert sharder_type(fused_params=params)._e_sharder.fused_params == params
