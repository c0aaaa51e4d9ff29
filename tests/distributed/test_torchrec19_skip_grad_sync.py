"""TorchRec 1.9's ``mark_data_parallel_skip_grad_sync`` under DistributedModelParallel, 2 gloo
ranks: a marked collection's DATA_PARALLEL tables are left out of the gradient sum over ranks
(TorchRec 1.9 does not wrap its data-parallel lookups in DDP), an unmarked one's are averaged;
the rest of the model is DMP's DDP's, marked or not (TorchRec reads the marker only when it
shards an embedding collection).

Each rank looks up one bag holding the id of its rank and the loss is the output's sum, so the
gradient of row ``r`` is all ones on rank ``r`` and zero on the other rank: averaged, 0.5 in
both rows on both ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recsys_core.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recsys_core.distributed.sharding_plan import construct_module_sharding_plan, data_parallel
from recsys_core.distributed.types import ShardingPlan
from recsys_core.kernels.config import EmbOptimType
from recsys_core.modules.embedding_modules import (
    MODULE_ATTR_DATA_PARALLEL_SKIP_GRAD_SYNC,
    mark_data_parallel_skip_grad_sync,
    should_skip_data_parallel_grad_sync,
)
from recsys_core.testing import run_gloo

DIM = 4
LR = 0.1


def _ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection([
        EmbeddingBagConfig(name="dense_t", feature_names=["f"], num_embeddings=4,
                           embedding_dim=DIM),
        EmbeddingBagConfig(name="fused_t", feature_names=["g"], num_embeddings=4,
                           embedding_dim=DIM),
    ])


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.marked = _ebc()
        self.plain = _ebc()
        self.linear = nn.Linear(1, 1, bias=False)

    def forward(self, features: KeyedJaggedTensor, x: torch.Tensor) -> torch.Tensor:
        return (
            self.marked(features).values().sum()
            + self.plain(features).values().sum()
            + self.linear(x).sum()
        )


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Model()
    mark_data_parallel_skip_grad_sync(model.marked)
    mark_data_parallel_skip_grad_sync(model.linear)  # not a collection: DDP still averages it
    start = {n: p.detach().clone() for n, p in model.state_dict().items()}
    generators = {"dense_t": data_parallel(compute_kernel="dense"),
                  "fused_t": data_parallel(compute_kernel="fused")}
    plan = ShardingPlan({
        path: construct_module_sharding_plan(getattr(model, path), generators, world)
        for path in ("marked", "plain")
    })
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    dmp = DistributedModelParallel(model, plan=plan, sharders=[sharder])
    features = KeyedJaggedTensor(
        keys=["f", "g"], values=torch.tensor([rank, rank]), lengths=torch.tensor([1, 1]))
    dmp(features, torch.full((1, 1), float(rank + 1))).backward()
    params = dict(dmp.named_parameters())
    state = dmp.state_dict()
    return {
        "marked_dense_grad": params["marked.embedding_bags.dense_t.weight"].grad.clone(),
        "plain_dense_grad": params["plain.embedding_bags.dense_t.weight"].grad.clone(),
        "marked_fused_step": start["marked.embedding_bags.fused_t.weight"]
        - state["marked.embedding_bags.fused_t.weight"],
        "plain_fused_step": start["plain.embedding_bags.fused_t.weight"]
        - state["plain.embedding_bags.fused_t.weight"],
        "linear_grad": params["linear.weight"].grad.clone(),
    }


def _rows(*values: float) -> torch.Tensor:
    return torch.tensor(values).unsqueeze(1).expand(-1, DIM)


def test_marked_collection_keeps_each_ranks_gradient_unmarked_one_is_averaged() -> None:
    results = run_gloo(2, _worker)
    for rank, got in enumerate(results):
        own = _rows(*[1.0 if r == rank else 0.0 for r in range(4)])
        torch.testing.assert_close(got["marked_dense_grad"], own, rtol=0, atol=0)
        torch.testing.assert_close(got["plain_dense_grad"], _rows(0.5, 0.5, 0, 0), rtol=0, atol=0)
        # the fused data-parallel table: one SGD step in backward on the same gradients
        torch.testing.assert_close(got["marked_fused_step"], own * LR, rtol=0, atol=1e-7)
        torch.testing.assert_close(
            got["plain_fused_step"], _rows(0.5, 0.5, 0, 0) * LR, rtol=0, atol=1e-7)
        # the Linear's input is rank + 1: its gradient is the mean, 1.5, on both ranks
        torch.testing.assert_close(got["linear_grad"], torch.tensor([[1.5]]))


def test_marker_is_torchrecs_attribute() -> None:
    ebc = _ebc()
    assert not should_skip_data_parallel_grad_sync(ebc)
    mark_data_parallel_skip_grad_sync(ebc)
    assert should_skip_data_parallel_grad_sync(ebc)
    assert getattr(ebc, MODULE_ATTR_DATA_PARALLEL_SKIP_GRAD_SYNC) is True
    assert MODULE_ATTR_DATA_PARALLEL_SKIP_GRAD_SYNC == "_torchrec_data_parallel_skip_grad_sync"
