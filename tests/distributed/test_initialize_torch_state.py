"""``_initialize_torch_state`` (TorchRec's name): the sharded collections build each sharded
table's weight once, as a ShardedTensor of views of this rank's shards, and ``state_dict()``
hands out those very tensors; a table whose tensor cannot be built is named in the error, with
the cause kept."""

from __future__ import annotations

import pytest
import torch
from gloo_setup import counting_gathers, world_env
from table_configs import one_feature_tables
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from recsys_core.distributed import (
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    table_wise,
)
from recsys_core.testing import run_gloo

# distinct sizes: the failing constructor below picks table "b" by its global size
BAGS = one_feature_tables(EmbeddingBagConfig, {"a": (11, 8), "b": (7, 4), "c": (5, 4)})
SEQUENCES = one_feature_tables(EmbeddingConfig, {"a": (11, 8), "b": (7, 8)})


def _views(sharded: torch.nn.Module, table: str) -> list[int]:
    return [s.weight.data_ptr() for s in sharded.table_shards().get(table, [])]


def _failing_for(size: list[int]):  # type: ignore[no-untyped-def]
    """torch's constructor, failing for the tensor of global ``size`` only."""
    real = ShardedTensor._init_from_local_shards_and_global_metadata

    def build(cls, local_shards, sharded_tensor_metadata, **kwargs):  # type: ignore[no-untyped-def]
        if list(sharded_tensor_metadata.size) == size:
            raise RuntimeError("Number of local shards (0) does not match")
        return real.__func__(cls, local_shards, sharded_tensor_metadata, **kwargs)

    return real, classmethod(build)


def worker(rank: int, world: int) -> dict:
    out: dict = {}
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=BAGS)
    plan = construct_module_sharding_plan(
        ebc, {"a": column_wise(ranks=[0, 1]), "b": table_wise(rank=1), "c": data_parallel()},
        world)
    sharded = EmbeddingBagCollectionSharder().shard(ebc, plan, world_env(), torch.device("cpu"))
    built = sharded._model_parallel_name_to_sharded_tensor
    out["built"] = sorted(built)
    # views of the kernels' storage: nothing copied
    out["views"] = {t: [s.tensor.data_ptr() for s in built[t].local_shards()] == _views(sharded, t)
                    for t in built}
    out["local_shards"] = {t: len(built[t].local_shards()) for t in built}
    state = sharded.state_dict()
    out["same_objects"] = {t: state[f"embedding_bags.{t}.weight"] is built[t] for t in built}
    # their values: the unsharded module's rows and columns at each shard's offsets
    unsharded = ebc.state_dict()
    out["values"] = all(
        torch.equal(s.tensor, unsharded[f"embedding_bags.{t}.weight"][
            tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes,
                                                  strict=True))])
        for t in built for s in built[t].local_shards())
    # built again: local (the layouts are known), hooks not registered twice
    out["gathers_again"] = counting_gathers(sharded._initialize_torch_state)[1]
    with torch.no_grad():
        full = {k: v + 1.0 for k, v in unsharded.items()}
    result = sharded.load_state_dict(full)
    out["missing_after_reinit"] = list(result.missing_keys)
    after = sharded.state_dict()
    out["loaded"] = all(
        torch.equal(s.tensor, full[f"embedding_bags.{t}.weight"][
            tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes,
                                                  strict=True))])
        for t in built for s in after[f"embedding_bags.{t}.weight"].local_shards())
    # one table's tensor failing to build: the error names it and keeps the cause
    real, failing = _failing_for([7, 4])
    ShardedTensor._init_from_local_shards_and_global_metadata = failing  # type: ignore[method-assign]
    try:
        sharded._initialize_torch_state()
        out["error"] = None
    except RuntimeError as e:
        out["error"] = (str(e), str(e.__cause__))
    finally:
        ShardedTensor._init_from_local_shards_and_global_metadata = real  # type: ignore[method-assign]
    # the sequence collection builds its tables the same way
    ec = EmbeddingCollection(tables=SEQUENCES)
    ec_plan = construct_module_sharding_plan(
        ec, {"a": table_wise(rank=0), "b": column_wise(ranks=[1, 0])}, world)
    ec_sharded = EmbeddingCollectionSharder().shard(ec, ec_plan, world_env(), torch.device("cpu"))
    ec_built = ec_sharded._model_parallel_name_to_sharded_tensor
    ec_state = ec_sharded.state_dict()
    out["ec"] = {t: (ec_state[f"embeddings.{t}.weight"] is ec_built[t],
                     [s.tensor.data_ptr() for s in ec_built[t].local_shards()]
                     == _views(ec_sharded, t))
                 for t in ec_built}
    return out


@pytest.mark.slow  # 2 gloo ranks, ~5 s
def test_tables_built_once_as_views_and_errors_name_the_table() -> None:
    results = run_gloo(2, worker)
    for rank, found in enumerate(results):
        assert found["built"] == ["a", "b"], rank  # data-parallel "c" stays a plain tensor
        assert found["views"] == {"a": True, "b": True}, rank
        assert found["local_shards"] == {"a": 1, "b": rank}, rank  # b lives on rank 1
        assert found["same_objects"] == {"a": True, "b": True}, rank
        assert found["values"], rank
        assert found["gathers_again"] == 0, rank
        assert found["missing_after_reinit"] == [], rank
        assert found["loaded"], rank
        message, cause = found["error"]
        assert "'b'" in message and "Number of local shards (0) does not match" in message, rank
        assert cause == "Number of local shards (0) does not match", rank
        assert found["ec"] == {"a": (True, True), "b": (True, True)}, rank
