"""The DENSE compute kernel (TorchRec's non-fused kernel): shard weights are parameters with
gradients that an optimizer outside the module steps; data-parallel DENSE replicas are averaged
by the DDP of DistributedModelParallel. Also: the sharded EBC checks its first input (unique
keys, logged once as TorchRec does) and refuses repeated keys on every new key order.

Reference semantics (TorchRec's gradient division, on here): each rank's loss is on its own
batch; every table, like the dense part under DDP, steps on the gradient of the MEAN of the
ranks' losses, i.e. of the unsharded model's loss on all batches divided by the world size.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from gloo_setup import assert_sharded_tensor_blocks, world_env
from torch import nn

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from recsys_core.distributed import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    ShardingEnv,
    ShardingPlan,
)
from recsys_core.distributed.batched_embedding_kernel import DenseTableBatchedEmbedding
from recsys_core.distributed.comm_ops import set_gradient_division
from recsys_core.distributed.embeddingbag import EmbeddingBagSharder
from recsys_core.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recsys_core.distributed.types import EmbeddingComputeKernel
from recsys_core.optim import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter
from recsys_core.testing import run_gloo


def test_dense_kernel_pools_by_hand() -> None:
    kernel = DenseTableBatchedEmbedding(rows=[3, 4], dims=[2, 1], feature_table_map=[0, 1],
                                        pooling_mean=False, device=torch.device("cpu"))
    with torch.no_grad():
        kernel.weights[0].copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
        kernel.weights[1].copy_(torch.tensor([[10.0], [20.0], [30.0], [40.0]]))
    # batch 2; f0: [0, 2] | [1]; f1: [] | [3]
    out = kernel(torch.tensor([0, 2, 1, 3]), torch.tensor([0, 2, 3, 3, 4]))
    torch.testing.assert_close(out, torch.tensor([[6.0, 8.0, 0.0], [3.0, 4.0, 40.0]]))
    out.sum().backward()
    torch.testing.assert_close(kernel.weights[0].grad, torch.tensor([[1.0, 1.0]] * 3))
    torch.testing.assert_close(kernel.weights[1].grad, torch.tensor([[0.0], [0.0], [0.0], [1.0]]))
    mean = DenseTableBatchedEmbedding(rows=[3], dims=[2], feature_table_map=[0],
                                      pooling_mean=True, device=torch.device("cpu"))
    with torch.no_grad():
        mean.weights[0].copy_(kernel.weights[0])
    torch.testing.assert_close(
        mean(torch.tensor([0, 2, 1]), torch.tensor([0, 2, 3])), torch.tensor([[3.0, 4.0], [3.0, 4.0]]))
    assert kernel.state_dict() == {}  # the collection's state dict holds whole tables


TABLES = [
    EmbeddingBagConfig(name="tw", feature_names=["a"], num_embeddings=7, embedding_dim=4),
    EmbeddingBagConfig(name="rw", feature_names=["b"], num_embeddings=9, embedding_dim=4,
                       pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="cw", feature_names=["c"], num_embeddings=5, embedding_dim=4),
    EmbeddingBagConfig(name="dp", feature_names=["d"], num_embeddings=6, embedding_dim=2),
]


class _Model(nn.Module):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection(TABLES, device=device)
        self.over = nn.Linear(14, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(self.sparse(kjt).values()).squeeze(1)


def _batch(rank: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(10 + rank)
    lengths = torch.randint(0, 3, (4 * 3,), generator=gen)
    rows = [7, 9, 5, 6]
    values = torch.cat([
        torch.randint(0, rows[k], (int(lengths[3 * k : 3 * k + 3].sum()),), generator=gen)
        for k in range(4)
    ])
    return KeyedJaggedTensor(keys=["a", "b", "c", "d"], values=values, lengths=lengths)


def _dense_worker(rank: int, world: int) -> None:
    set_gradient_division(True)
    torch.manual_seed(0)
    model = _Model()
    reference = copy.deepcopy(model)
    plan = construct_module_sharding_plan(
        model.sparse,
        {"tw": table_wise(rank=1), "rw": row_wise(), "cw": column_wise(ranks=[0, 1]),
         "dp": data_parallel()},
        world_size=world)
    assert {ps.compute_kernel for ps in plan.values()} == {EmbeddingComputeKernel.DENSE}
    dmp = DistributedModelParallel(model, plan=ShardingPlan({"sparse": plan}),
                                   sharders=[EmbeddingBagCollectionSharder()])
    params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    # every shard this rank holds is a parameter (tw on rank 1, rw and cw blocks, dp replica)
    assert sum(p.numel() for n, p in params.items() if not n.startswith("over")) == (
        (7 * 4 if rank == 1 else 0) + (5 if rank == 0 else 4) * 4 + 5 * 2 + 6 * 2)
    opt = CombinedOptimizer([dmp.fused_optimizer, KeyedOptimizerWrapper(
        params, lambda ps: torch.optim.SGD(ps, lr=0.5))])
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _step in range(2):
        opt.zero_grad()
        dmp(_batch(rank)).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(reference(_batch(r)).sum() for r in range(world)) / world).backward()
        ref_opt.step()
        torch.testing.assert_close(dmp(_batch(rank)).detach(), reference(_batch(rank)).detach())
    state = dmp.state_dict()
    full = {n: reference.sparse.embedding_bags[n].weight.detach() for n in ("tw", "rw", "cw", "dp")}
    torch.testing.assert_close(state["sparse.embedding_bags.dp.weight"], full["dp"])
    for name in ("tw", "rw", "cw"):
        assert_sharded_tensor_blocks(state[f"sparse.embedding_bags.{name}.weight"], full[name])
    assert not any(k.startswith("sparse.lookups") for k in state)


def test_dense_kernels_train_like_the_unsharded_model() -> None:
    run_gloo(2, _dense_worker)


def _input_worker(rank: int, world: int) -> list[str]:
    ebc = EmbeddingBagCollection(TABLES[:1])
    plan = construct_module_sharding_plan(ebc, {"tw": table_wise(rank=0, compute_kernel="fused")},
                                          world_size=world)
    sharded = EmbeddingBagCollectionSharder().shard(ebc, plan, world_env())
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("recsys_core.distributed.embeddingbag")
    logger.setLevel(logging.INFO)
    logger.addHandler(_Keep())
    for _ in range(3):
        sharded(kjt).wait()
    twice = KeyedJaggedTensor(keys=["a", "a"], values=torch.tensor([1, 2, 3]),
                              lengths=torch.tensor([1, 1, 1, 0]))
    with pytest.raises(ValueError, match=r"keys must be unique, but \['a'\] appear more than once"):
        sharded(twice)
    return records


def test_first_input_is_validated_once_and_repeated_keys_are_refused() -> None:
    for records in run_gloo(2, _input_worker):
        assert records.count("Validating input features...") == 1


def test_single_embedding_bag_sharder_refuses_with_the_fix() -> None:
    sharder = EmbeddingBagSharder()
    assert sharder.module_type is nn.EmbeddingBag
    with pytest.raises(ValueError, match="put its table in an EmbeddingBagCollection"):
        sharder.shard(nn.EmbeddingBag(4, 2), {}, ShardingEnv.from_local(1, 0))
