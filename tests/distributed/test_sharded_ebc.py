"""Sharded == unsharded: every sharding type, world sizes 1-4, real processes over gloo.

Each rank feeds its own slice of a global batch; the reference is the unsharded
EmbeddingBagCollection on the whole global batch with the matching torch optimizer, stepping on
the mean of the ranks' losses (TorchRec's gradient division: the embedding collectives divide
the gradients by the world size, data-parallel tables average like DDP). After each
of 3 steps the rank's output (and the gradient reaching it) must equal the reference slice;
at the end every local shard's weights and optimizer state must equal the reference slices.
"""

from __future__ import annotations

import os

import pytest
import torch
from gloo_setup import (
    SUM_MEAN_KEYS,
    check_local_shards,
    concat_ranks,
    pooled_step,
    rank_batches,
    rank_rows,
    shard_beside_reference,
    sum_and_mean_tables,
    two_table_plans,
)

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, EmbOptimType
from recsys_core.distributed import data_parallel, row_wise
from recsys_core.distributed.comm_ops import set_gradient_division
from recsys_core.optim import RowWiseAdagrad
from recsys_core.testing import run_gloo

TABLES = sum_and_mean_tables()
KEYS, ROWS, BATCH, STEPS = SUM_MEAN_KEYS, [13, 13, 7], 3, 3
# Large enough that few rows are touched per step: data-parallel exchanges only those rows.
BIG_TABLES = sum_and_mean_tables((1000, 7))


def generators(kind: str, world: int, local: int) -> dict:
    if kind == "mixed":
        return {"t_sum": row_wise(compute_kernel="fused"), "t_mean": data_parallel(compute_kernel="fused")}
    return two_table_plans("t_sum", "t_mean", world, local)[kind]


def global_batch(seed: int, world: int, weighted: bool, rows: list[int] = ROWS) -> list:
    """Every rank's batch (an empty bag on every rank)."""
    return rank_batches(seed, world, KEYS, rows, BATCH, weighted=weighted, empty_first=True)


OPTIMIZERS = {
    "adagrad": ({"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3},
                lambda ps: torch.optim.Adagrad(ps, lr=0.1, eps=1e-3), "sum", "momentum1"),
    "rowwise_adagrad": ({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3},
                        lambda ps: RowWiseAdagrad(ps, lr=0.1, eps=1e-3), "sum", "momentum1"),
    "sgd": ({"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.2}, lambda ps: torch.optim.SGD(ps, lr=0.2), None, None),
}


def parity_worker(
    rank: int, world: int, kind: str, weighted: bool, optimizer: str, big: bool = False,
    division: bool = True, one_dim: bool = False,
) -> int:
    """Each rank's loss is its slice's; the reference steps on the MEAN of the ranks' losses
    (TorchRec's default gradient division) or, with ``division=False``, on their sum."""
    set_gradient_division(division)
    scale = world if division else 1  # reference loss = sum of rank losses / scale
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(0)
    tables = BIG_TABLES if big else TABLES
    if one_dim:  # both tables of dim 8: the torch kernel updates them in one pass
        tables = [EmbeddingBagConfig(name=c.name, embedding_dim=8, num_embeddings=c.num_embeddings,
                                     feature_names=c.feature_names, pooling=c.pooling)
                  for c in tables]
    width = sum(c.embedding_dim * len(c.feature_names) for c in tables)
    rows = [1000, 1000, 7] if big else ROWS
    fused_params, make_opt, ref_state, state_key = OPTIMIZERS[optimizer]
    sharded, reference = shard_beside_reference(
        EmbeddingBagCollection(tables, is_weighted=weighted), generators(kind, world, local),
        world, local, fused_params=dict(fused_params))
    ref_opt = make_opt(list(reference.parameters()))
    for step in range(STEPS):
        kjts = global_batch(100 + step, world, weighted, rows)
        target = torch.randn(world * BATCH, width, generator=torch.Generator().manual_seed(step))
        values = sharded(kjts[rank]).wait().values()
        ref_values = reference(concat_ranks(kjts)).values()
        pooled_step(values, ref_values, rank_rows(rank, BATCH), target, ref_opt, scale)
    states = None if ref_state is None else (ref_state, state_key)
    return check_local_shards(sharded, reference.embedding_bags, ref_opt, states)


CASES = [(kind, world) for kind in ["table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel"] for world in (1, 2, 4)]
CASES += [("row_wise", 3), ("mixed", 2)]


# Weighted ids at world sizes 2 and 3 for every kind; world size 1 (nothing crosses ranks) and 4
# (two hosts for the table-row and table-column kinds: the layouts, not the weights) unweighted
# only, to keep CI within budget.
WEIGHTED_CASES = [(kind, world, weighted) for kind, world in CASES for weighted in (False, True)
                  if not (weighted and world in (1, 4))]


@pytest.mark.parametrize("kind, world, weighted", WEIGHTED_CASES,
                         ids=[f"{'weighted' if w else 'unweighted'}-{k}-w{n}"
                              for k, n, w in WEIGHTED_CASES])
@pytest.mark.slow
def test_sharded_equals_unsharded(kind: str, world: int, weighted: bool) -> None:
    local = 2 if kind.startswith("table_") and world == 4 else world  # 2 hosts of 2 ranks
    optimizer = "adagrad" if kind.endswith("column_wise") else "rowwise_adagrad"
    checked = run_gloo(world, parity_worker, kind, weighted, optimizer, local_world_size=local)
    assert sum(checked) >= len(TABLES)  # every table's shards were compared somewhere


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_data_parallel_large_table_exchanges_touched_rows(world: int) -> None:
    checked = run_gloo(world, parity_worker, "data_parallel", True, "rowwise_adagrad", True)
    assert sum(checked) == len(BIG_TABLES) * world


# Tables of one dim: the replicas' gradients cross the ranks as one entry of all their rows
# (gathered rows when few are touched, big tables; a dense sum otherwise, small ones).
@pytest.mark.parametrize("world, big", [(2, False), (2, True), (3, True), (4, False)])
@pytest.mark.slow
def test_data_parallel_tables_of_one_dim(world: int, big: bool) -> None:
    checked = run_gloo(world, parity_worker, "data_parallel", False, "rowwise_adagrad", big,
                       True, True)
    assert sum(checked) == len(TABLES) * world


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.slow
def test_sharded_equals_unsharded_other_optimizers(optimizer: str) -> None:
    checked = run_gloo(2, parity_worker, "mixed", True, optimizer)
    assert sum(checked) >= len(TABLES)


# SGD shows the loss scale one for one (Adagrad's step hardly depends on it): every sharding
# type at world size 2 steps like the unsharded module on the MEAN of the ranks' losses (a sum
# would be 2x off), and at 4 where the layout changes with it (two hosts: table-row and
# table-column wise) and in the mixed plan.
SGD_CASES = [(kind, 2) for kind in ["table_wise", "row_wise", "column_wise", "table_row_wise",
                                    "table_column_wise", "data_parallel", "mixed"]]
SGD_CASES += [(kind, 4) for kind in ["table_row_wise", "table_column_wise", "mixed"]]


@pytest.mark.parametrize("kind, world", SGD_CASES, ids=[f"{k}-w{n}" for k, n in SGD_CASES])
@pytest.mark.slow
def test_sgd_steps_on_mean_loss(kind: str, world: int) -> None:
    local = 2 if kind.startswith("table_") and world == 4 else world
    checked = run_gloo(world, parity_worker, kind, False, "sgd", local_world_size=local)
    assert sum(checked) >= len(TABLES)


# set_gradient_division(False): the tables step on the SUM of the ranks' losses (the fused
# data-parallel replicas too).
@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "table_row_wise",
                                  "data_parallel"])
@pytest.mark.slow
def test_sgd_steps_on_summed_loss_without_gradient_division(kind: str) -> None:
    checked = run_gloo(2, parity_worker, kind, False, "sgd", False, False)
    assert sum(checked) >= len(TABLES)
