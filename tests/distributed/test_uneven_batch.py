"""Ranks with different local batch sizes (a last partial batch, an empty one), as TorchRec
allows: the input dist exchanges every rank's batch size and the output dist sends each rank
its own rows.

Oracle: the unsharded module fed the concatenation of the ranks' batches, stepping (SGD) on
the MEAN of the ranks' losses (TorchRec's gradient division, on by default). Checked per
sharding type: each rank's output rows, the gradient reaching them, and after the step every
local shard's weights.
"""

from __future__ import annotations

import pytest
import torch
from gloo_setup import (
    SUM_MEAN_KEYS,
    check_local_shards,
    concat_ranks,
    pooled_step,
    random_batch,
    shard_beside_reference,
    sum_and_mean_tables,
    two_table_plans,
)

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    EmbeddingConfig,
    EmbOptimType,
    KeyedJaggedTensor,
)
from recsys_core.distributed import column_wise, row_wise, table_wise
from recsys_core.distributed.dist_data import SparseFeaturesAllToAll
from recsys_core.testing import run_gloo

KEYS = SUM_MEAN_KEYS
ROWS = [13, 13, 7]
POOLED = sum_and_mean_tables()
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
    plans = two_table_plans("t_sum", "t_mean", 2, 2 // (host + 1), kernel=K)
    plans["mixed"] = {"t_sum": row_wise(compute_kernel=K), "t_mean": table_wise(rank=1, compute_kernel=K)}
    return plans


def rank_batch(seed: int, batch: int, weighted: bool = False) -> KeyedJaggedTensor:
    return random_batch(torch.Generator().manual_seed(seed), KEYS, ROWS, batch, weighted=weighted)


def pooled_worker(
    rank: int, world: int, kinds: list[str], host: int, weighted: bool = False,
    batches: list[tuple[int, int]] = BATCHES,
) -> int:
    checked = 0
    for kind in kinds:
        for case, sizes in enumerate(batches):
            torch.manual_seed(case)
            sharded, reference = shard_beside_reference(
                EmbeddingBagCollection(POOLED, is_weighted=weighted), pooled_plans(host)[kind],
                world, world // (host + 1), fused_params=FUSED)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
            kjts = [rank_batch(10 * case + r, b, weighted) for r, b in enumerate(sizes)]
            rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
            target = torch.randn(sum(sizes), 20, generator=torch.Generator().manual_seed(case))
            out = sharded(kjts[rank]).wait()
            assert out.values().shape == (sizes[rank], 20), (kind, sizes, out.values().shape)
            ref_values = reference(concat_ranks(kjts)).values()
            pooled_step(out.values(), ref_values, rows, target, ref_opt, world)
            checked += check_local_shards(sharded, reference.embedding_bags)
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
    checked = 0
    for generators in SEQUENCE_PLANS.values():
        for case, sizes in enumerate(BATCHES):
            torch.manual_seed(case)
            sharded, reference = shard_beside_reference(
                EmbeddingCollection(SEQUENCE), generators, world, world, fused_params=FUSED)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
            kjts = [rank_batch(10 * case + r, b) for r, b in enumerate(sizes)]
            out = sharded(kjts[rank]).wait()
            ref = reference(concat_ranks(kjts))
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
            checked += check_local_shards(sharded, reference.embeddings)
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
    whole = concat_ranks(kjts)
    assert whole.stride() == sum(sizes)
    for key in KEYS:
        torch.testing.assert_close(
            whole[key].lengths(), torch.cat([k[key].lengths() for k in kjts])
        )
