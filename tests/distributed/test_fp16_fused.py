"""FP16 tables on the FUSED kernel, sharded as TorchRec shards them: float16 shard weights (the
state dict's ShardedTensors and replicas are float16, with the unsharded module's values), bags
summed in float32, and a training step that follows the float16 rounding rule of the fused
kernels (tests/kernels/test_fp16_tables.py) applied to the unsharded module's float32 gradient
of the mean of the ranks' losses. FP16 and FP32 tables of both pooling types interleave, so the
kernels (one per pooling type and dtype) must put the columns back in the module's order."""

from __future__ import annotations

import torch
from gloo_setup import concat_ranks, rank_batches, rank_rows, world_env
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recsys_core import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbOptimType,
    PoolingType,
)
from recsys_core.distributed import EmbeddingBagCollectionSharder
from recsys_core.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recsys_core.testing import run_gloo

HALF, FULL, FUSED = DataType.FP16, DataType.FP32, "fused"
TABLES = [  # (name, rows, dim, data type, pooling, plan)
    ("h_tw", 10, 4, HALF, PoolingType.SUM, table_wise(rank=1, compute_kernel=FUSED)),
    ("f_tw", 6, 4, FULL, PoolingType.SUM, table_wise(rank=1, compute_kernel=FUSED)),
    ("h_rw", 13, 4, HALF, PoolingType.MEAN, row_wise(compute_kernel=FUSED)),
    ("h_cw", 9, 8, HALF, PoolingType.SUM, column_wise(ranks=[0, 1], compute_kernel=FUSED)),
    ("f_rw", 7, 4, FULL, PoolingType.MEAN, row_wise(compute_kernel=FUSED)),
    ("h_dp", 5, 4, HALF, PoolingType.SUM, data_parallel(compute_kernel=FUSED)),
]
BATCH, LR = 3, 0.5


def configs() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, data_type=t, pooling=p,
                               feature_names=[f"f_{n}"]) for n, r, d, t, p, _ in TABLES]


def fp16_fused_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(configs())
    plan = construct_module_sharding_plan(ebc, {n: g for n, *_, g in TABLES}, world, world)
    sharded = EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR,
    }).shard(ebc, plan, world_env(), torch.device("cpu"))
    kernels = [k for lk in sharded.lookups for k in lk.kernels]
    assert {type(k).__name__ for k in kernels} <= {
        "FbgemmTableBatchedEmbedding", "TorchTableBatchedEmbedding"}, kernels
    # the reference: the unsharded tables' values in float32, trained by hand below
    start = {n: ebc.embedding_bags[n].weight.detach().clone() for n, *_ in TABLES}
    ref = EmbeddingBagCollection(configs())
    ref.embedding_bags = nn.ModuleDict({
        n: nn.EmbeddingBag.from_pretrained(start[n].float(), freeze=False, mode=p.value.lower(),
                                           include_last_offset=True)
        for n, _, _, _, p, _ in TABLES})
    keys = [f"f_{n}" for n, *_ in TABLES]
    for step in range(2):
        kjts = rank_batches(step, world, keys, [r for _, r, *_ in TABLES], BATCH)
        out = sharded(kjts[rank]).wait().values()
        ref_out = torch.cat([ref.embedding_bags[n](jt.values(), jt.offsets()) for n, jt in zip(
            [n for n, *_ in TABLES], concat_ranks(kjts).to_dict().values(), strict=True)], dim=1)
        assert out.dtype == torch.float32
        # exact sums at first; then a float16 unit per row where a rank summed the gradients of
        # the ranks in another order and the rounding went the other way
        tolerance = 1e-5 if step == 0 else 4e-3
        torch.testing.assert_close(out, ref_out[rank_rows(rank, BATCH)], atol=tolerance, rtol=0)
        target = torch.randn(world * BATCH, out.shape[1], generator=torch.Generator().manual_seed(step))
        (out * target[rank_rows(rank, BATCH)]).sum().backward()
        ((ref_out * target).sum() / world).backward()
        with torch.no_grad():  # the fused rule on an FP16 table: round the step, then the sum
            for n, _, _, dtype, *_ in TABLES:
                w = ref.embedding_bags[n].weight
                step_ = -LR * w.grad
                if dtype is HALF:
                    w.copy_((w + step_.half().float()).half().float())
                else:
                    w.add_(step_)
                w.grad = None
    state = sharded.state_dict()
    for n, _, _, dtype, *_ in TABLES:
        value = state[f"embedding_bags.{n}.weight"]
        want = torch.float16 if dtype is HALF else torch.float32
        expected = ref.embedding_bags[n].weight.detach().to(want)
        tensors = ([(s.tensor, s.metadata.shard_offsets) for s in value.local_shards()]
                   if isinstance(value, ShardedTensor) else [(value, [0, 0])])
        for tensor, (r, c) in tensors:
            assert tensor.dtype == want, n
            block = expected[r:r + tensor.shape[0], c:c + tensor.shape[1]]
            # one float16 unit where the ranks' gradients were summed in another order
            torch.testing.assert_close(tensor, block, atol=2e-3 if dtype is HALF else 1e-5, rtol=0)
    # the state dict's float16 views are the kernel's rows: writing them sets the table
    sharded.load_state_dict({f"embedding_bags.{n}.weight": start[n] for n, *_ in TABLES})
    for n, *_ in TABLES:
        value = sharded.state_dict()[f"embedding_bags.{n}.weight"]
        for tensor, (r, c) in ([(s.tensor, s.metadata.shard_offsets) for s in value.local_shards()]
                               if isinstance(value, ShardedTensor) else [(value, [0, 0])]):
            block = start[n][r:r + tensor.shape[0], c:c + tensor.shape[1]]
            assert torch.equal(tensor, block), (n, (tensor - block).abs().max(), tensor.shape)


def test_fp16_tables_on_the_fused_kernel_sharded_every_way() -> None:
    run_gloo(2, fp16_fused_worker)
