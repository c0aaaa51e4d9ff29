"""Ranks with different local batch sizes (a last partial batch, an empty one), as TorchRec
allows: the input dist exchanges every rank's batch size and the output dist sends each rank
its own rows.

Oracle: the unsharded module fed the concatenation of the ranks' batches, stepping (SGD) on
the MEAN of the ranks' losses (TorchRec's gradient division, on by default). Checked per
sharding type: each rank's output rows, the gradient reaching them, and after the step every
local shard's weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    EmbOptimType,
    KeyedJaggedTensor,
    PoolingType,
)
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    ShardingEnv,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recsys_core.distributed.dist_data import SparseFeaturesAllToAll
from recsys_core.testing import run_gloo

KEYS = ["f0", "f1", "f2"]
ROWS = {"f0": 13, "f1": 13, "f2": 7}
POOLED = [
    EmbeddingBagConfig(name="t_sum", embedding_dim=8, num_embeddings=13, feature_names=["f0", "f1"], pooling=PoolingType.SUM),
    EmbeddingBagConfig(name="t_mean", embedding_dim=4, num_embeddings=7, feature_names=["f2"], pooling=PoolingType.MEAN),
]
SEQUENCE = [
    EmbeddingConfig(name="t_a", embedding_dim=8, num_embeddings=13, feature_names=["f0", "f1"]),
    EmbeddingConfig(name="t_b", embedding_dim=8, num_embeddings=7, feature_names=["f2"]),
]
LR = 0.5
K = "fused"
FUSED = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
# (rank 0's batch, rank 1's batch): a partial batch, an empty rank, and the empty rank first
BATCHES = [(3, 4), (0, 4), (4, 0)]


def pooled_plans(host: int) -> dict[str, dict]:
    """Sharding kind -> plan generators, world size 2 (``host``: the host index of the
    table-row/column-wise tables; 1 when each rank is its own host)."""
    return {
        "table_wise": {"t_sum": table_wise(rank=1, compute_kernel=K), "t_mean": table_wise(rank=0, compute_kernel=K)},
        "column_wise": {"t_sum": column_wise(ranks=[0, 1], compute_kernel=K), "t_mean": column_wise(ranks=[1], compute_kernel=K)},
        "row_wise": {"t_sum": row_wise(compute_kernel=K), "t_mean": row_wise(compute_kernel=K)},
        "table_row_wise": {"t_sum": table_row_wise(host_index=host, compute_kernel=K), "t_mean": table_row_wise(host_index=0, compute_kernel=K)},
        "table_column_wise": {"t_sum": table_column_wise(host_index=host, compute_kernel=K), "t_mean": table_wise(rank=0, compute_kernel=K)},
        "data_parallel": {"t_sum": data_parallel(compute_kernel=K), "t_mean": data_parallel(compute_kernel=K)},
        "mixed": {"t_sum": row_wise(compute_kernel=K), "t_mean": table_wise(rank=1, compute_kernel=K)},
    }


def rank_batch(seed: int, batch: int, weighted: bool = False) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS) * batch,), generator=gen)
    values = torch.cat([
        torch.randint(0, ROWS[k], (int(lengths[i * batch : (i + 1) * batch].sum()),), generator=gen)
        for i, k in enumerate(KEYS)
    ])
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, weights=weights, stride=batch)


def concat(kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    per_key = [[k.to_dict()[key] for k in kjts] for key in KEYS]
    weighted = kjts[0].weights_or_none() is not None
    return KeyedJaggedTensor(
        keys=KEYS,
        values=torch.cat([jt.values() for jts in per_key for jt in jts]),
        lengths=torch.cat([jt.lengths() for jts in per_key for jt in jts]),
        weights=torch.cat([jt.weights() for jts in per_key for jt in jts]) if weighted else None,
        stride=sum(k.stride() for k in kjts),
    )


def check_shards(sharded: torch.nn.Module, reference: torch.nn.Module, prefix: str) -> int:
    checked = 0
    for local in sharded.lookups:
        for shard, weight, _ in local.local_shards():
            full = getattr(reference, prefix)[shard.table].weight.detach()
            rows = slice(shard.row_offset, shard.row_offset + shard.rows)
            cols = slice(shard.col_offset, shard.col_offset + shard.cols)
            torch.testing.assert_close(weight, full[rows, cols], atol=1e-5, rtol=1e-5)
            checked += 1
    return checked


def pooled_worker(
    rank: int, world: int, kinds: list[str], host: int, weighted: bool = False,
    batches: list[tuple[int, int]] = BATCHES,
) -> int:
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    checked = 0
    for kind in kinds:
        for case, sizes in enumerate(batches):
            torch.manual_seed(case)
            ebc = EmbeddingBagCollection(POOLED, is_weighted=weighted)
            reference = copy.deepcopy(ebc)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
            plan = construct_module_sharding_plan(ebc, pooled_plans(host)[kind], world, world // (host + 1))
            sharded = EmbeddingBagCollectionSharder(fused_params=FUSED).shard(ebc, plan, env, torch.device("cpu"))
            kjts = [rank_batch(10 * case + r, b, weighted) for r, b in enumerate(sizes)]
            lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
            target = torch.randn(sum(sizes), 20, generator=torch.Generator().manual_seed(case))
            out = sharded(kjts[rank]).wait()
            assert out.values().shape == (sizes[rank], 20), (kind, sizes, out.values().shape)
            values = out.values()
            values.retain_grad()
            ref_values = reference(concat(kjts)).values()
            ref_values.retain_grad()
            torch.testing.assert_close(values, ref_values[lo:hi].detach(), atol=1e-5, rtol=1e-5)
            (torch.tanh(values) * target[lo:hi]).sum().backward()
            ref_opt.zero_grad()
            ((torch.tanh(ref_values) * target).sum() / world).backward()  # mean of rank losses
            ref_opt.step()
            torch.testing.assert_close(values.grad, ref_values.grad[lo:hi] * world, atol=1e-5, rtol=1e-5)
            checked += check_shards(sharded, reference, "embedding_bags")
    return checked


def test_pooled_uneven_batches_every_sharding_type() -> None:
    kinds = ["table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise",
             "data_parallel", "mixed"]
    assert min(run_gloo(2, pooled_worker, kinds, 0)) > 0


def test_pooled_uneven_batches_two_hosts() -> None:
    # one rank per host: table-row-wise runs its cross-host all-to-all with uneven batches;
    # weighted ids (the weights travel with the ids through the uneven reorder)
    kinds = ["table_row_wise", "table_column_wise", "row_wise"]
    assert min(run_gloo(2, pooled_worker, kinds, 1, True, local_world_size=1)) > 0


SEQUENCE_PLANS = {
    "table_wise": {"t_a": table_wise(rank=1, compute_kernel=K), "t_b": table_wise(rank=0, compute_kernel=K)},
    "column_wise": {"t_a": column_wise(ranks=[0, 1], compute_kernel=K), "t_b": table_wise(rank=1, compute_kernel=K)},
    "row_wise": {"t_a": row_wise(compute_kernel=K), "t_b": row_wise(compute_kernel=K)},
}


def sequence_worker(rank: int, world: int) -> int:
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    checked = 0
    for generators in SEQUENCE_PLANS.values():
        for case, sizes in enumerate(BATCHES):
            torch.manual_seed(case)
            ec = EmbeddingCollection(SEQUENCE)
            reference = copy.deepcopy(ec)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
            plan = construct_module_sharding_plan(ec, generators, world, world)
            sharded = EmbeddingCollectionSharder(fused_params=FUSED).shard(ec, plan, env, torch.device("cpu"))
            kjts = [rank_batch(10 * case + r, b) for r, b in enumerate(sizes)]
            out = sharded(kjts[rank]).wait()
            ref = reference(concat(kjts))
            loss, ref_loss = torch.zeros(()), torch.zeros(())
            for key in KEYS:
                # this rank's ids come after the earlier ranks' ids of the same key
                before = sum(k[key].values().numel() for k in kjts[:rank])
                mine = kjts[rank][key].values().numel()
                got, want = out[key].values(), ref[key].values()
                torch.testing.assert_close(got, want[before : before + mine].detach(), atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(out[key].lengths(), kjts[rank][key].lengths())
                loss = loss + (got * got).sum()
                ref_loss = ref_loss + (want * want).sum()
            loss.backward()
            ref_opt.zero_grad()
            (ref_loss / world).backward()
            ref_opt.step()
            checked += check_shards(sharded, reference, "embeddings")
    return checked


def test_sequence_uneven_batches() -> None:
    assert min(run_gloo(2, sequence_worker)) > 0


def malformed_worker(rank: int, world: int) -> str:
    """A rank whose lengths do not match its batch size is named; so is a batch size that a
    caller requiring equal batches does not accept."""
    group = torch.distributed.group.WORLD
    per_dest = 2 if rank == 0 else 1  # rank 1 claims batch 2 but sends 1 length per rank
    bad = SparseFeaturesAllToAll(
        torch.ones(2 * per_dest, dtype=torch.int64), torch.zeros(2 * per_dest, dtype=torch.int64),
        None, [per_dest] * 2, [per_dest] * 2, ["a"], 2, group, world, variable_batch=True,
    )
    messages = []
    try:
        bad.wait()
    except ValueError as exc:
        messages.append(str(exc))
    batch = rank + 1
    equal = SparseFeaturesAllToAll(
        torch.ones(2 * batch, dtype=torch.int64), torch.zeros(2 * batch, dtype=torch.int64),
        None, [batch] * 2, [batch] * 2, ["a"], batch, group, world,
    )
    try:
        equal.wait()
    except ValueError as exc:
        messages.append(str(exc))
    return " | ".join(messages)


def test_malformed_lengths_and_required_equal_batch_are_clear_errors() -> None:
    messages = run_gloo(2, malformed_worker)
    for text in messages:
        assert "rank 1 sent 1 lengths for 1 feature(s) and its batch size 2" in text
        assert "malformed" in text
    assert "rank 1 uses batch size 2, this rank 1" in messages[0]
    assert "rank 0 uses batch size 1, this rank 2" in messages[1]


@pytest.mark.parametrize("sizes", [(3, 4)])
def test_unsharded_reference_rows_partition_the_concatenated_batch(sizes: tuple[int, int]) -> None:
    # the oracle's own premise: concat puts each rank's samples in rank order
    kjts = [rank_batch(r, b) for r, b in enumerate(sizes)]
    whole = concat(kjts)
    assert whole.stride() == sum(sizes)
    for key in KEYS:
        torch.testing.assert_close(
            whole[key].lengths(), torch.cat([k[key].lengths() for k in kjts])
        )
