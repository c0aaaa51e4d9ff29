"""The sharded collections' fused optimizer answers TorchRec's KeyedOptimizer calls:
``update_hyper_parameters({"lr": ...})`` changes the rate the next backward applies,
``set_optimizer_step`` sets the kernels' step counter, and a state dict saved without param
groups loads keeping the current rate and step."""

from __future__ import annotations

import pytest
import torch

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, EmbOptimType, KeyedJaggedTensor
from recsys_core.distributed import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    ShardingEnv,
    ShardingPlan,
    construct_module_sharding_plan,
    table_wise,
)

TABLES = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=6, feature_names=["f"])]


def _sharded(optimizer: EmbOptimType, lr: float) -> DistributedModelParallel:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, {"t": table_wise(rank=0, compute_kernel="fused")},
                                                            world_size=1)})
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": optimizer,
                                                          "learning_rate": lr})
    return DistributedModelParallel(ebc, env=ShardingEnv.from_local(1, 0), plan=plan,
                                    sharders=[sharder])


def _weights(dmp: DistributedModelParallel) -> torch.Tensor:
    return dmp.state_dict()["embedding_bags.t.weight"].detach().clone()


def _train_step(dmp: DistributedModelParallel) -> None:
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 1, 3]),
                            lengths=torch.tensor([2, 1]))
    dmp(kjt).wait().values().sum().backward()


def test_update_hyper_parameters_sets_the_rate_backward_applies() -> None:
    dmp = _sharded(EmbOptimType.EXACT_SGD, lr=0.1)
    before = _weights(dmp)
    dmp.fused_optimizer.update_hyper_parameters({"lr": 0.5})
    assert dmp.fused_optimizer.param_groups[0]["lr"] == pytest.approx(0.5)
    _train_step(dmp)
    # loss = sum of pooled rows: row 1 is in the batch twice, row 3 once -> SGD moves them by
    # 2 * lr and 1 * lr in every column; the other rows stay.
    expected = before.clone()
    expected[1] -= 2 * 0.5
    expected[3] -= 1 * 0.5
    torch.testing.assert_close(_weights(dmp), expected)
    with pytest.raises(NotImplementedError, match="fused_params"):
        dmp.fused_optimizer.update_hyper_parameters({"eps": 1e-3})


def test_set_optimizer_step_and_load_without_param_groups() -> None:
    dmp = _sharded(EmbOptimType.ADAM, lr=0.01)
    dmp.fused_optimizer.set_optimizer_step(7)
    assert "param_groups" not in dmp.fused_optimizer.state_dict()  # TorchRec's default
    dmp.fused_optimizer.save_param_groups(True)
    saved = dmp.fused_optimizer.state_dict()
    assert saved["param_groups"][0]["step"] == 7
    other = _sharded(EmbOptimType.ADAM, lr=0.02)
    other.fused_optimizer.save_param_groups(True)
    other.fused_optimizer.set_optimizer_step(3)
    other.fused_optimizer.load_state_dict({"state": saved["state"]})  # no param groups
    kept = other.fused_optimizer.state_dict()["param_groups"][0]
    assert kept["step"] == 3 and kept["lr"] == pytest.approx(0.02)
    other.fused_optimizer.load_state_dict(saved)
    loaded = other.fused_optimizer.state_dict()["param_groups"][0]
    assert loaded["step"] == 7 and loaded["lr"] == pytest.approx(0.01)
