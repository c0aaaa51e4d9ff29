"""The ``torchrec.distributed`` names TorchRec's multi-process test harness imports, with their
behaviour: types (storage usage, sharder interface, lazy getitem), comm topology helpers, utils,
plan deltas, default sharders, the feature-processed EBC sharder (over gloo, against the
unsharded module) and the sharders this library refuses to execute (with the fix named)."""

from __future__ import annotations

import copy

import pytest
import torch
from gloo_setup import assert_sharded_tensor_blocks
from torch import nn

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recsys_core.distributed import comm
from recsys_core.distributed.model_parallel import DistributedModelParallel, DMPCollection
from recsys_core.distributed.sharding.dynamic_sharding import output_sharding_plans_delta
from recsys_core.distributed.sharding_plan import (
    construct_module_sharding_plan,
    get_module_to_default_sharders,
    row_wise,
    table_wise,
)
from recsys_core.distributed.types import (
    EmbeddingModuleShardingPlan,
    LazyAwaitable,
    LazyGetItemMixin,
    ModuleSharder,
    ShardingPlan,
    StorageUsageType,
    compute_storage_usage,
    get_tensor_size_bytes,
)
from recsys_core.distributed.utils import (
    CopyableMixin,
    add_prefix_to_state_dict,
    append_prefix,
    filter_state_dict,
    none_throws,
)
from recsys_core.modules.feature_processor_ import PositionWeightedModule
from recsys_core.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from recsys_core.optim import in_backward_optimizer_filter
from recsys_core.testing import run_gloo


def test_storage_usage_by_hand() -> None:
    t = torch.empty(10, 4)  # 160 bytes
    assert get_tensor_size_bytes(t) == 160
    assert compute_storage_usage(t, "cuda", "fused", StorageUsageType.BASE) == {"hbm": 160}
    assert compute_storage_usage(t, "cuda", "fused_uvm_caching", StorageUsageType.BASE) == {
        "ddr": 160}
    assert compute_storage_usage(t, "cpu", "fused", StorageUsageType.BASE) == {"ddr": 160}
    # quantized: 4 bytes per row more (scale and bias)
    assert compute_storage_usage(t, "cuda", "quant", StorageUsageType.BASE_QUANT) == {"hbm": 200}
    assert compute_storage_usage(t, "cuda", "quant_uvm", StorageUsageType.BASE_QUANT) == {
        "ddr": 200}


def test_lazy_getitem_defers_the_wait() -> None:
    waits = []

    class DictAwaitable(LazyGetItemMixin[str, torch.Tensor], LazyAwaitable[dict]):
        def _wait_impl(self) -> dict:
            waits.append(1)
            return {"a": torch.tensor(2.0), "b": torch.tensor(3.0)}

    awaitable = DictAwaitable()
    a, b = awaitable["a"], awaitable["b"]
    assert isinstance(a, LazyAwaitable) and waits == []
    assert torch.add(a, b).item() == 5.0 and waits == [1]  # the parent waited once


def test_comm_topology_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert comm.get_local_size(4) == 2
    assert comm.get_local_rank(4, rank=3) == 1
    assert comm.get_group_rank(4, rank=3) == 1 and comm.get_num_groups(4) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # does not divide 4: one host
    assert comm.get_local_size(4) == 4 and comm.get_num_groups(4) == 1
    monkeypatch.delenv("LOCAL_RANK")
    assert comm.get_local_rank(4, rank=3) == 3
    assert comm._INTRA_PG is None and comm._CROSS_PG is None


def _groups_worker(rank: int, world: int) -> tuple[list[int], list[int]]:
    import torch.distributed as dist

    intra, cross = comm.intra_and_cross_node_pg()
    return dist.get_process_group_ranks(intra), dist.get_process_group_ranks(cross)


def test_intra_and_cross_node_groups() -> None:
    groups = run_gloo(4, _groups_worker, local_world_size=2)
    assert groups == [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]


def test_utils() -> None:
    assert append_prefix("a", "b") == "a.b" and append_prefix("", "b") == "b"
    assert none_throws(3) == 3
    with pytest.raises(AssertionError, match="missing"):
        none_throws(None, "missing")
    assert dict(filter_state_dict({"m.x": 1, "m.y": 2, "n.x": 3}, "m")) == {"x": 1, "y": 2}
    state = {"x": 1, "_metadata": {"": {}, "x": {}}}
    add_prefix_to_state_dict(state, "p.")
    assert state == {"p.x": 1, "_metadata": {"": {}, "p.x": {}}}

    class Net(CopyableMixin):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

    net = Net()
    copied = net.copy(torch.device("cpu"))
    assert copied is not net and torch.equal(copied.lin.weight, net.lin.weight)


def _ebc(n: int = 2, weighted: bool = False, device: str = "cpu") -> EmbeddingBagCollection:
    return EmbeddingBagCollection([
        EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], num_embeddings=8,
                           embedding_dim=4) for i in range(n)
    ], is_weighted=weighted, device=device)


def test_plan_delta_lists_moved_tables_and_their_mib() -> None:
    old = construct_module_sharding_plan(
        _ebc(2), {"t0": table_wise(rank=0), "t1": table_wise(rank=1)}, world_size=2)
    new = construct_module_sharding_plan(
        _ebc(2), {"t0": table_wise(rank=0), "t1": table_wise(rank=0)}, world_size=2)
    delta = output_sharding_plans_delta({"m": old}, {"m": new}, return_data_volume=True)
    volume, moved = delta["m"]
    assert list(moved) == ["t1"] and moved["t1"].ranks == [0]
    assert volume == pytest.approx(8 * 4 * 4 / 2**20)  # 8 x 4 float32 rows


def test_default_sharders_and_refusals() -> None:
    sharders = get_module_to_default_sharders()
    assert FeatureProcessedEmbeddingBagCollection in sharders
    assert all(isinstance(s, ModuleSharder) for s in sharders.values())
    ebc_sharder = sharders[EmbeddingBagCollection]
    assert "grid_shard" not in ebc_sharder.sharding_types("cpu")
    assert list(ebc_sharder.shardable_parameters(_ebc(2))) == ["t0", "t1"]
    with pytest.raises(ValueError, match="DMPCollection .* is not implemented"):
        DMPCollection(nn.Linear(1, 1))
    from recsys_core.distributed.embedding_tower_sharding import EmbeddingTowerSharder

    with pytest.raises(ValueError, match="sharding an EmbeddingTower .* is not implemented"):
        EmbeddingTowerSharder().shard(
            nn.Linear(1, 1), EmbeddingModuleShardingPlan(), None)  # type: ignore[arg-type]


def test_tower_sharders_offer_only_the_towers_tables_to_the_planner() -> None:
    """The interaction module's weights are not tables: the planner never sees them."""
    from recsys_core.distributed.embedding_tower_sharding import (
        EmbeddingTowerCollectionSharder,
        EmbeddingTowerSharder,
    )
    from recsys_core.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection

    def tower(*names: str) -> EmbeddingTower:
        tables = [EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=10,
                                     feature_names=[f"f_{n}"]) for n in names]
        return EmbeddingTower(EmbeddingBagCollection(tables=tables), nn.Linear(8, 8))

    first, second = tower("t0", "t2"), tower("t1")
    assert list(EmbeddingTowerSharder().shardable_parameters(first)) == ["t0", "t2"]
    params = EmbeddingTowerCollectionSharder().shardable_parameters(
        EmbeddingTowerCollection([first, second]))
    assert list(params) == ["t0", "t2", "t1"]
    assert params["t1"] is second.embedding.embedding_bags["t1"].weight


def _fp_model(device: str = "cpu") -> FeatureProcessedEmbeddingBagCollection:
    return FeatureProcessedEmbeddingBagCollection(
        _ebc(2, weighted=True, device=device),
        {"f0": PositionWeightedModule(3), "f1": PositionWeightedModule(3)},
    )


def _batch(rank: int) -> KeyedJaggedTensor:
    values = [torch.tensor([1, 2, 3, 0]), torch.tensor([4, 4, 7, 5, 6])][rank]
    lengths = [torch.tensor([3, 0, 1, 0]), torch.tensor([1, 2, 2, 0])][rank]
    return KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths)


def _fp_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = _fp_model()
    with torch.no_grad():  # distinct position weights, so that a wrong position shows
        for i, name in enumerate(("f0", "f1")):
            model._feature_processors[name].position_weight.copy_(
                torch.tensor([1.0, 0.5, 0.25]) + i)
    reference = copy.deepcopy(model)
    plan = construct_module_sharding_plan(
        model._embedding_bag_collection,
        {"t0": table_wise(rank=1, compute_kernel="fused"), "t1": row_wise(compute_kernel="fused")},
        world_size=world)
    sharders = [get_module_to_default_sharders()[FeatureProcessedEmbeddingBagCollection]]
    with pytest.raises(ValueError, match=r"position_weight.*are trainable.*requires_grad_"):
        DistributedModelParallel(copy.deepcopy(model), plan=ShardingPlan({"": plan}),
                                 sharders=sharders)
    model._feature_processors.requires_grad_(False)
    dmp = DistributedModelParallel(model, plan=ShardingPlan({"": plan}), sharders=sharders)
    assert not any(p.requires_grad for _, p in in_backward_optimizer_filter(dmp.named_parameters()))
    torch.testing.assert_close(dmp(_batch(rank)).wait().values(),
                               reference(_batch(rank)).values().detach())
    state = dmp.state_dict()
    assert torch.equal(state["_feature_processors.f1.position_weight"],
                       torch.tensor([2.0, 1.5, 1.25]))
    assert_sharded_tensor_blocks(
        state["_embedding_bag_collection.embedding_bags.t1.weight"],
        reference._embedding_bag_collection.embedding_bags["t1"].weight.detach())


def test_feature_processed_ebc_with_frozen_processors_shards_like_the_unsharded_module() -> None:
    run_gloo(2, _fp_worker)


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = _ebc(1)
        self.over = nn.Linear(4, 1)
        self.unused = nn.Parameter(torch.zeros(3))  # TorchRec's test models carry such params

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(self.sparse(kjt).values()).sum()


def _unused_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = _WithUnused()
    reference = copy.deepcopy(model)
    plan = construct_module_sharding_plan(
        model.sparse, {"t0": table_wise(rank=0, compute_kernel="fused")}, world_size=world)
    dmp = DistributedModelParallel(model, plan=ShardingPlan({"sparse": plan}))
    batches = [KeyedJaggedTensor(keys=["f0"], values=torch.tensor(v), lengths=torch.tensor(n))
               for v, n in (([1, 2, 3], [2, 1]), ([4, 5, 6, 7], [1, 3]))]
    dmp(batches[rank]).backward()
    # the dense gradient is the mean over ranks even with a parameter no forward uses
    expected = torch.autograd.grad(
        sum(reference(b) for b in batches) / world, reference.over.weight)[0]
    torch.testing.assert_close(dmp.module.over.weight.grad, expected)


def test_dense_gradients_are_averaged_with_unused_parameters() -> None:
    run_gloo(2, _unused_worker)
