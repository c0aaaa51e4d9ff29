"""FP16 tables on the DENSE kernel, as TorchRec keeps them: the shard weights are float16
parameters (TorchRec's ``weights_precision`` from the table's data_type), the pooled output is
float32, and the sharded state dict holds float16 tensors (ShardedTensor local shards and
data-parallel replicas alike) with the unsharded module's values; loading round-trips.
"""

from __future__ import annotations

import torch
from gloo_setup import world_env
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recsys_core import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from recsys_core.distributed import EmbeddingBagCollectionSharder
from recsys_core.distributed.batched_embedding_kernel import DenseTableBatchedEmbedding
from recsys_core.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    table_wise,
)
from recsys_core.testing import run_gloo

TABLES = [
    EmbeddingBagConfig(name="t_half", embedding_dim=4, num_embeddings=10, feature_names=["a"],
                       pooling=PoolingType.SUM, data_type=DataType.FP16),
    EmbeddingBagConfig(name="t_full", embedding_dim=4, num_embeddings=6, feature_names=["b"],
                       pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t_half_dp", embedding_dim=2, num_embeddings=5, feature_names=["c"],
                       pooling=PoolingType.SUM, data_type=DataType.FP16),
]


def test_dense_kernel_keeps_fp16_weights_and_returns_fp32() -> None:
    kernel = DenseTableBatchedEmbedding(rows=[3], dims=[2], feature_table_map=[0],
                                        pooling_mean=False, device=torch.device("cpu"),
                                        dtypes=[torch.float16])
    assert kernel.weights[0].dtype == torch.float16
    with torch.no_grad():
        kernel.weights[0].copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.5, 0.25]]))
    out = kernel(torch.tensor([0, 2, 1]), torch.tensor([0, 2, 3]),
                 torch.tensor([1.0, 2.0, 0.5]))  # float32 per-sample weights are accepted
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.5], [1.5, 2.0]]))


def fp16_worker(rank: int, world: int) -> None:
    env = world_env()
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES, is_weighted=True)
    assert ebc.embedding_bags["t_half"].weight.dtype == torch.float16
    plan = construct_module_sharding_plan(ebc, {
        "t_half": table_wise(rank=1, compute_kernel="dense"),
        "t_full": table_wise(rank=0, compute_kernel="dense"),
        "t_half_dp": data_parallel(compute_kernel="dense"),
    }, world, world)
    sharded = EmbeddingBagCollectionSharder().shard(ebc, plan, env, torch.device("cpu"))
    state = sharded.state_dict()
    for table in TABLES:
        value = state[f"embedding_bags.{table.name}.weight"]
        dtype = torch.float16 if table.data_type is DataType.FP16 else torch.float32
        expected = ebc.embedding_bags[table.name].weight.detach()
        if isinstance(value, ShardedTensor):
            assert value.metadata().tensor_properties.dtype == dtype, table.name
            for shard in value.local_shards():
                assert shard.tensor.dtype == dtype, table.name
                torch.testing.assert_close(shard.tensor, expected, atol=0, rtol=0)
        else:
            assert value.dtype == dtype, table.name
            torch.testing.assert_close(value, expected, atol=0, rtol=0)
    # forward == unsharded (both compute in the table's dtype, output float32)
    gen = torch.Generator().manual_seed(rank)
    kjt = KeyedJaggedTensor(
        keys=["a", "b", "c"], values=torch.tensor([1, 9, 2, 5, 0, 4, 3]),
        lengths=torch.tensor([2, 1, 1, 1, 1, 1]), weights=torch.rand(7, generator=gen),
    )
    out = sharded(kjt).wait().values()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ebc(kjt).values(), atol=1e-3, rtol=1e-3)
    # round trip: load a changed unsharded state dict, read it back through the sharded one
    changed = {k: v + 1 for k, v in ebc.state_dict().items()}
    sharded.load_state_dict(changed)
    again = sharded.state_dict()
    for table in TABLES:
        value = again[f"embedding_bags.{table.name}.weight"]
        tensors = [s.tensor for s in value.local_shards()] if isinstance(value, ShardedTensor) else [value]
        for t in tensors:
            torch.testing.assert_close(t, changed[f"embedding_bags.{table.name}.weight"], atol=0, rtol=0)


def test_sharded_fp16_dense_state_dict() -> None:
    run_gloo(2, fp16_worker)
