"""Sharded == unsharded for EmbeddingCollection: TW, RW, CW at world sizes 1-4, real gloo ranks.

Each rank feeds its own slice of a global batch; the reference is the unsharded
EmbeddingCollection on the whole global batch with torch.optim.Adagrad. After each of 3 steps
the rank's output rows (and the gradient reaching them) must equal the reference slice; at the
end every local shard's weights and Adagrad state must equal the reference slices.
"""

from __future__ import annotations

import copy

import pytest
import torch
from gloo_setup import (
    check_local_shards,
    concat_ranks,
    one_table_per_type,
    rank_batches,
    shard_beside_reference,
    two_table_plans,
    world_env,
)

from recsys_core import EmbeddingCollection, EmbeddingConfig, EmbOptimType, KeyedJaggedTensor
from recsys_core.distributed import (
    LazyAwaitable,
    column_wise,
    construct_module_sharding_plan,
    row_wise,
)
from recsys_core.distributed.embedding import EmbeddingCollectionSharder
from recsys_core.kernels.config import KernelBackend
from recsys_core.kernels.tbe import IdOutOfRangeError
from recsys_core.testing import run_gloo

# t_small has 3 rows: row-wise over 4 ranks leaves rank 3 an empty shard, and ids repeat a lot.
TABLES = [
    EmbeddingConfig(name="t_big", embedding_dim=8, num_embeddings=13, feature_names=["f0", "f1"]),
    EmbeddingConfig(name="t_small", embedding_dim=8, num_embeddings=3, feature_names=["f2"]),
]
KEYS, ROWS, BATCH, STEPS = ["f0", "f1", "f2"], [13, 13, 3], 3, 3
LR, EPS = 0.1, 1e-3
FUSED = {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": LR, "eps": EPS}


def generators(kind: str, world: int) -> dict:
    # table-wise over 4 ranks: ranks 1 and 2 hold nothing, they still take part in every collective
    plans = two_table_plans("t_big", "t_small", world)
    # t_small's column blocks sit on ranks in reverse column order
    plans["column_wise"]["t_small"] = column_wise(ranks=[world - 1, 0], compute_kernel="fused")
    plans["mixed"] = {"t_big": row_wise(compute_kernel="fused"), "t_small": column_wise(ranks=[world - 1, 0], compute_kernel="fused")}
    return plans[kind]


def global_batch(seed: int, world: int) -> list[KeyedJaggedTensor]:
    """Every rank's batch (an empty bag on every rank)."""
    return rank_batches(seed, world, KEYS, ROWS, BATCH, empty_first=True)


def rank_slice(kjts: list[KeyedJaggedTensor], key: str, rank: int) -> slice:
    """Where ``rank``'s ids of ``key`` sit in the global batch (rank 0's first)."""
    counts = [int(k[key].lengths().sum()) for k in kjts]
    return slice(sum(counts[:rank]), sum(counts[: rank + 1]))


def parity_worker(
    rank: int, world: int, kind: str, need_indices: bool, backend: KernelBackend
) -> int:
    torch.manual_seed(0)
    sharded, reference = shard_beside_reference(
        EmbeddingCollection(TABLES, need_indices=need_indices), generators(kind, world), world,
        fused_params=dict(FUSED), backend=backend)
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=LR, eps=EPS)
    for step in range(STEPS):
        kjts = global_batch(100 + step, world)
        mine = kjts[rank]
        result = sharded(mine)
        assert isinstance(result, LazyAwaitable)
        out = result.wait()
        assert list(out) == KEYS
        ref_out = reference(concat_ranks(kjts))
        gen = torch.Generator().manual_seed(step)
        loss, ref_loss, pairs = 0.0, 0.0, []
        for key in KEYS:
            mine_ids = rank_slice(kjts, key, rank)
            rows, ref_rows = out[key].values(), ref_out[key].values()
            target = torch.randn(ref_rows.shape, generator=gen)
            rows.retain_grad()
            ref_rows.retain_grad()
            torch.testing.assert_close(rows, ref_rows[mine_ids].detach(), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out[key].lengths(), mine[key].lengths())
            if need_indices:
                torch.testing.assert_close(out[key].weights(), mine[key].values())
            else:
                assert out[key].weights_or_none() is None
            loss = loss + (torch.tanh(rows) * target[mine_ids]).sum()
            ref_loss = ref_loss + (torch.tanh(ref_rows) * target).sum()
            pairs.append((rows, ref_rows, mine_ids))
        loss.backward()
        ref_opt.zero_grad()
        (ref_loss / world).backward()  # the mean of the ranks' losses
        ref_opt.step()
        for rows, ref_rows, mine_ids in pairs:
            torch.testing.assert_close(rows.grad, ref_rows.grad[mine_ids] * world, atol=1e-5, rtol=1e-5)
    checked = check_local_shards(sharded, reference.embeddings, ref_opt, ("sum", "momentum1"))
    assert len(sharded.fused_optimizer.params) == checked
    return checked


CASES = [
    (kind, world) for kind in ["table_wise", "row_wise", "column_wise"] for world in (1, 2, 4)
] + [("row_wise", 3), ("mixed", 2)]


@pytest.mark.parametrize("kind, world", CASES, ids=[f"{k}-w{w}" for k, w in CASES])
@pytest.mark.slow
def test_sharded_ec_equals_unsharded(kind: str, world: int) -> None:
    # alternate need_indices and exercise the pure-torch kernel as well as FBGEMM's
    need_indices = world % 2 == 0
    backend = KernelBackend.TORCH if kind == "mixed" or world == 3 else KernelBackend.AUTO
    checked = run_gloo(world, parity_worker, kind, need_indices, backend)
    # every shard of the plan (empty row shards included) was compared on its rank
    assert sum(checked) == {"table_wise": 2, "row_wise": 2 * world, "column_wise": 4,
                            "mixed": world + 2}[kind]


def errors_worker(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    ec = EmbeddingCollection(TABLES)
    reference = copy.deepcopy(ec)
    env = world_env()
    sharder = EmbeddingCollectionSharder(fused_params=dict(FUSED))
    messages = []
    # data-parallel, table-row-wise and table-column-wise (host 0): the types an EC cannot take
    unsupported = one_table_per_type(world, ("dp", "twrw", "twcw"), compute_kernel="fused")
    for generator in unsupported.values():
        plan = construct_module_sharding_plan(
            ec, {"t_big": row_wise(compute_kernel="fused"), "t_small": generator}, world
        )
        with pytest.raises(ValueError, match="TABLE_WISE, COLUMN_WISE, ROW_WISE") as info:
            sharder.shard(ec, plan, env)
        messages.append(str(info.value))
    plan = construct_module_sharding_plan(ec, generators("mixed", world), world)
    sharded = sharder.shard(ec, plan, env, torch.device("cpu"))
    # every rank sends a bad id in a different feature; nothing may reach the wire
    bad_key = KEYS[rank]
    ids = torch.zeros(len(KEYS) * BATCH, dtype=torch.long)
    ids[KEYS.index(bad_key) * BATCH] = -1 if rank else 99
    bad = KeyedJaggedTensor(keys=KEYS, values=ids, lengths=torch.ones_like(ids))
    with pytest.raises(IdOutOfRangeError, match=f"feature '{bad_key}'") as info:
        sharded(bad)
    messages.append(str(info.value))
    # the ranks' collectives are still in step: a good batch runs forward and backward
    kjts = global_batch(7, world)
    out = sharded(kjts[rank]).wait()
    ref = reference(concat_ranks(kjts))
    for key in KEYS:
        expected = ref[key].values()[rank_slice(kjts, key, rank)].detach()
        torch.testing.assert_close(out[key].values(), expected)
    sum(jt.values().sum() for jt in out.values()).backward()
    return messages


def test_sharded_ec_errors() -> None:
    messages = run_gloo(2, errors_worker)
    for rank, rank_messages in enumerate(messages):
        assert all("'t_small'" in m for m in rank_messages[:3])
        assert "DATA_PARALLEL" in rank_messages[0]
        assert f"'{KEYS[rank]}'" in rank_messages[3] and f"rank {rank}" in rank_messages[3]
