"""EmbeddingEnumerator: the planner's candidates as TorchRec ShardingOptions, by hand."""

from __future__ import annotations

import pytest
import torch

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, EmbOptimType
from recsys_core.distributed import EmbeddingBagCollectionSharder
from recsys_core.planner import (
    EmbeddingEnumerator,
    ParameterConstraints,
    Perf,
    Shard,
    ShardingOption,
    Storage,
    Topology,
)


def options(constraints: dict | None = None) -> list[ShardingOption]:
    model = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="t", embedding_dim=8, num_embeddings=100, feature_names=["f"])], device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD,
                                                          "learning_rate": 0.1})
    return EmbeddingEnumerator(Topology(2, "cpu"), batch_size=4, constraints=constraints).enumerate(
        model, [sharder])


def test_table_wise_option_by_hand() -> None:
    tw = next(o for o in options() if o.sharding_type == "table_wise")
    assert (tw.name, tw.path, tw.fqn, tw.partition_by, tw.compute_kernel) == (
        "t", "", ".t", "device", "fused")
    # feature_names come from constraints only (TorchRec's enumerator)
    assert (tw.input_lengths, tw.batch_size, tw.is_pooled, tw.feature_names) == ([1.0], 4, True, None)
    assert tw.tensor.shape == (100, 8) and tw.tensor.device.type == "meta"
    # 2 ranks x 4 samples: 8 ids (8 B each) in; 8 pooled rows of 8 fp32 out
    weights, ids, outputs = 100 * 8 * 4, 8 * 8, 8 * 8 * 4
    (shard,) = tw.shards
    assert (shard.size, shard.offset, shard.rank) == ([100, 8], [0, 0], None)
    # TorchRec's storage rule: weights (no optimizer class on the weight: no state), ids
    # received and rows sent, once each (no lengths, no output gradients)
    assert shard.storage == Storage(hbm=0, ddr=weights + ids + outputs)
    # TorchRec's perf formulas with TorchRec's bandwidths (the topology gives none): ids read
    # (8 ids x 8 B), rows looked up at >= 32 columns (8 x 32 x 4 B), rows written (8 x 8 x 4 B),
    # x 1.75 for an 8-wide block, over DDR; the output all-to-all over the intra-host link
    perf = shard.perf
    assert perf is not None
    ddr, link = 51 * 1024**3 / 1000, 600 * 1024**3 / 1000
    assert perf.fwd_compute == pytest.approx((64 + 1024 + 256) * 1.75 / ddr)
    assert perf.bwd_compute == pytest.approx(2 * perf.fwd_compute)
    assert (perf.fwd_comms, perf.bwd_comms) == (pytest.approx(outputs / link),) * 2
    assert perf.input_dist_comms == pytest.approx(ids / link)
    assert tw.total_perf == pytest.approx(perf.total)
    assert tw.total_storage == shard.storage


def test_row_wise_shards_and_totals() -> None:
    rw = next(o for o in options() if o.sharding_type == "row_wise")
    assert rw.partition_by == "uniform"
    assert [(s.size, s.offset) for s in rw.shards] == [([50, 8], [0, 0]), ([50, 8], [50, 0])]
    assert rw.total_storage == rw.shards[0].storage + rw.shards[1].storage  # type: ignore[operator]
    assert rw.get_shards_assignment() == [None, None]
    assert rw.num_shards == 2 and rw.num_inputs == 1


def test_constraints_narrow_the_options() -> None:
    only = options({"t": ParameterConstraints(sharding_types=["row_wise"], pooling_factors=[3.0])})
    # every kernel the sharder runs row-wise on CPU, as TorchRec's enumerator lists them
    sharder = EmbeddingBagCollectionSharder()
    kernels = set(sharder.compute_kernels("row_wise", "cpu")) - {"dense"}  # dense: fused wins
    assert {o.sharding_type for o in only} == {"row_wise"}
    assert {o.compute_kernel for o in only} == kernels
    assert only[0].input_lengths == [3.0]


def test_shard_perf_is_torchrecs_type() -> None:
    shard = options()[0].shards[0]
    assert isinstance(shard, Shard) and isinstance(shard.perf, Perf)


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "table_row_wise", "data_parallel"])
@pytest.mark.parametrize("kernel", ["fused", "fused_uvm", "fused_uvm_caching"])
def test_perf_phases_sum_to_the_planners_cost(kind: str, kernel: str) -> None:
    from recsys_core.distributed import EmbeddingComputeKernel, ShardingType
    from recsys_core.planner.search.cost import estimate_option
    from recsys_core.planner.search.types import Placement, TableSpec

    config = EmbeddingBagConfig(name="t", embedding_dim=16, num_embeddings=1000, feature_names=["f"])
    table = TableSpec(path="", config=config, pooled=True, optimizer=EmbOptimType.EXACT_ADAGRAD,
                      constraints=ParameterConstraints(), ids_per_batch=50.0, bags_per_batch=10.0,
                      is_weighted=False)
    shards = 1 if kind == "table_wise" else 2
    c = estimate_option(table, ShardingType(kind), EmbeddingComputeKernel(kernel), Placement.ALL_RANKS,
                        torch.full((shards,), 1000 // shards).numpy(), torch.full((shards,), 16).numpy(),
                        Topology(4, "cuda", local_world_size=2), with_perf=True)
    assert c.perf.sum(axis=0) == pytest.approx(c.cost, rel=1e-12)
    if kernel == "fused_uvm_caching":
        assert 0 < c.miss_fwd.sum() < c.miss_cost.sum()
