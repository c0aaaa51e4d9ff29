"""Managed collisions with the sorted table (MCHManagedCollisionModule), the collection and the
MC embedding collections: hand-computed remappings, evictions, state and bad input."""

import pytest
import torch

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from recsys_core.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from recsys_core.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from recsys_core.optim import EmbOptimType
from recsys_core.sparse import JaggedTensor

MAX = torch.iinfo(torch.int64).max
CPU = torch.device("cpu")


def jt(ids: list[int]) -> dict[str, JaggedTensor]:
    return {"f": JaggedTensor(values=torch.tensor(ids), lengths=torch.ones(len(ids), dtype=torch.int64))}


def lfu(zch_size: int = 4, interval: int = 1, **kwargs) -> MCHManagedCollisionModule:
    return MCHManagedCollisionModule(
        zch_size=zch_size, device=CPU, eviction_policy=LFU_EvictionPolicy(),
        eviction_interval=interval, **kwargs,
    )


def test_lfu_hand_computed_slots_and_evictions() -> None:
    m = lfu()
    # 10 seen twice, 20/30/40/50 once; 3 usable rows (row 3 is the shared miss row); ties go
    # to the smaller id, so 10, 20, 30 enter the empty entries 0, 1, 2.
    out = m(jt([10, 20, 10, 30, 40, 50]))["f"].values()
    assert out.tolist() == [0, 1, 0, 2, 3, 3]
    assert m._mch_sorted_raw_ids.tolist() == [10, 20, 30, MAX]
    assert m._mch_remapped_ids_mapping.tolist() == [0, 1, 2, 3]
    assert m._mch_counts.tolist() == [2, 1, 1, MAX]
    assert m.evict().tolist() == [0, 1, 2]
    assert m.evict() is None  # consumed
    assert m.open_slots().item() == 0
    # 60 x3 beats 30 (count 1); 20 climbs to 2 and stays. 60 takes 30's row 2.
    out = m(jt([60, 60, 60, 20]))["f"].values()
    assert out.tolist() == [2, 2, 2, 1]
    assert m._mch_sorted_raw_ids.tolist() == [10, 20, 60, MAX]
    assert m._mch_remapped_ids_mapping.tolist() == [0, 1, 2, 3]
    assert m._mch_counts.tolist() == [2, 2, 3, MAX]
    assert m.evict().tolist() == [2]
    # A seen id keeps its row; 30 is now a miss.
    assert m(jt([10, 30]))["f"].values().tolist() == [0, 3]


def test_eviction_interval_counts_across_steps_and_eval_freezes() -> None:
    m = lfu(zch_size=3, interval=2)
    assert m(jt([7, 8]))["f"].values().tolist() == [2, 2]  # no update yet
    assert m(jt([8, 9, 9, 9]))["f"].values().tolist() == [1, 0, 0, 0]  # 9 x3, 8 x2 enter
    assert m._mch_sorted_raw_ids.tolist() == [8, 9, MAX]
    assert m._current_iter_tensor.item() == 2
    m.eval()
    for _ in range(3):
        assert m(jt([5, 5, 5, 8]))["f"].values().tolist() == [2, 2, 2, 1]
    assert m._current_iter_tensor.item() == 2
    assert m._mch_sorted_raw_ids.tolist() == [8, 9, MAX]


def test_lru_evicts_least_recent() -> None:
    m = MCHManagedCollisionModule(
        zch_size=3, device=CPU, eviction_policy=LRU_EvictionPolicy(), eviction_interval=1
    )
    m(jt([1, 2]))  # step 1: 1, 2 enter
    m(jt([1]))  # step 2: 1 refreshed
    assert m(jt([3]))["f"].values().tolist() == [1]  # 3 replaces 2 (least recent), row 1
    assert m._mch_sorted_raw_ids.tolist() == [1, 3, MAX]
    assert m._mch_last_access_iter.tolist() == [2, 3, 3]
    m.eval()
    assert m(jt([3, 1, 2]))["f"].values().tolist() == [1, 0, 2]


def test_distance_lfu_discounts_counts_by_staleness() -> None:
    m = MCHManagedCollisionModule(
        zch_size=3, device=CPU, eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=1
    )
    m(jt([1] * 6 + [2] * 3))  # step 1: 1 (x6) and 2 (x3) enter
    m(jt([2]))  # step 2
    m(jt([2]))  # step 3: 2 seen 5 times, last at 3
    assert m._mch_counts.tolist() == [6, 5, MAX]
    assert m._mch_last_access_iter.tolist() == [1, 3, 3]
    # Step 4, score count / (4 - last + 1): 1 -> 6/4 = 1.5, 2 -> 5/2 = 2.5, new 5 -> 2/1 = 2.
    # 5 replaces 1 (LFU would keep 1 for its count, 6 > 2).
    assert m(jt([5, 5]))["f"].values().tolist() == [0, 0]
    assert m._mch_sorted_raw_ids.tolist() == [2, 5, MAX]
    assert m._mch_remapped_ids_mapping.tolist() == [1, 0, 2]
    assert m._mch_counts.tolist() == [5, 2, MAX]  # in raw-id order: 2, 5
    assert m._mch_last_access_iter.tolist() == [3, 4, 4]


def test_history_grows_beyond_the_first_batch() -> None:
    m = lfu(zch_size=5, interval=2)
    m(jt([1]))  # history sized from a 1-id batch
    m(jt([2, 2, 2, 3, 3, 4, 4, 4, 4, 4]))  # 10 ids: kept, not dropped
    assert dict(zip(m._mch_sorted_raw_ids.tolist(), m._mch_counts.tolist(), strict=True)) == {
        1: 1, 2: 3, 3: 2, 4: 5, MAX: MAX
    }


def test_state_dict_round_trip_and_foreign_state() -> None:
    m = lfu()
    m(jt([10, 20, 10, 30]))
    state = m.state_dict()
    assert {"_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_counts",
            "_current_iter_tensor", "_output_segments_tensor"} <= set(state)
    fresh = lfu()
    fresh.load_state_dict(state)
    fresh.eval()
    assert fresh(jt([30, 20, 10, 99]))["f"].values().tolist() == [2, 1, 0, 3]
    with pytest.raises(ValueError, match=r"row range \[0, 5\).*differently sized table"):
        lfu(zch_size=5).load_state_dict(state)
    # Shard 1's rows [4, 8) loaded into shard 0 of the same table: segments fit, rows do not.
    shard1 = lfu(output_global_offset=4, output_segments=[0, 4, 8])
    shard0 = lfu(name="t1", output_segments=[0, 4, 8])
    with pytest.raises(ValueError, match="'t1'.*another model"):
        shard0.load_state_dict(shard1.state_dict())


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="zch_size"):
        lfu(zch_size=0)
    with pytest.raises(ValueError, match="eviction_interval"):
        lfu(interval=0)
    m = lfu(name="t1")
    bad = {"f": JaggedTensor(values=torch.tensor([1.0, 2.0]), lengths=torch.tensor([1, 1]))}
    with pytest.raises(TypeError, match="feature 'f'.*float32"):
        m(bad)
    m.eval()
    with pytest.raises(TypeError, match="feature 'f'.*float32"):
        m(bad)


def _tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=4, feature_names=["a", "b"])]


def _mcc(tables: list[EmbeddingBagConfig]) -> ManagedCollisionCollection:
    return ManagedCollisionCollection({"t": lfu()}, tables)


def test_collection_remaps_features_of_a_table_together() -> None:
    mcc = _mcc(_tables())
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["b", "a"], values=torch.tensor([30, 40, 10, 20, 10, 50]),
        lengths=torch.tensor([1, 1, 2, 2]),
    )
    out = mcc(kjt)
    # Keys come out in table order (a, b); a = [10, 20, 10, 50], b = [30, 40].
    assert out.keys() == ["a", "b"]
    assert out.lengths().tolist() == [2, 2, 1, 1]
    assert out.values().tolist() == [0, 1, 0, 3, 2, 3]
    with pytest.raises(ValueError, match="'missing' has no managed collision module"):
        ManagedCollisionCollection({"t": lfu()}, _tables() + [
            EmbeddingBagConfig(name="missing", embedding_dim=4, num_embeddings=4)
        ])
    with pytest.raises(ValueError, match="num_embeddings 4.*5 rows"):
        ManagedCollisionCollection({"t": lfu(zch_size=5)}, _tables())


def _kjt(a: list[int], b: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.tensor(a + b),
        lengths=torch.tensor([len(a), 0, len(b), 0]),
    )


def test_mc_ebc_equals_plain_ebc_at_remapped_ids_and_resets_new_rows() -> None:
    tables = _tables()
    ebc = EmbeddingBagCollection(tables=tables, device=CPU)
    with torch.no_grad():
        ebc.embedding_bags["t"].weight.fill_(100.0)
    mc_ebc = ManagedCollisionEmbeddingBagCollection(ebc, _mcc(tables), return_remapped_features=True)
    out, remapped = mc_ebc(_kjt([10, 20, 10], [30, 40, 50]))
    assert remapped.values().tolist() == [0, 1, 0, 2, 3, 3]
    torch.testing.assert_close(out.values(), ebc(remapped).values(), rtol=0, atol=0)
    weight = ebc.embedding_bags["t"].weight.detach()
    bound = 0.5  # sqrt(1 / num_embeddings)
    assert bool((weight[:3].abs() <= bound).all())  # rows 0-2 went to new ids: re-initialised
    assert bool((weight[3] == 100.0).all())  # the miss row was never given away


def test_fused_mc_ebc_resets_weights_and_optimizer_state_of_evicted_rows() -> None:
    tables = _tables()
    ebc = FusedEmbeddingBagCollection(
        tables, optimizer_type=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        optimizer_kwargs={"learning_rate": 0.5}, device=CPU,
    )
    mc_ebc = ManagedCollisionEmbeddingBagCollection(ebc, _mcc(tables), return_remapped_features=True)
    out, _ = mc_ebc(_kjt([10, 20, 10], [30]))  # rows 0, 1, 2
    out.values().sum().backward()  # rowwise adagrad state grows on rows 0-2
    momentum = next(iter(ebc.fused_optimizer.state_dict()["state"].values()))
    momentum = next(v for v in momentum.values() if isinstance(v, torch.Tensor) and v.dim() == 1)
    assert bool((momentum[:3] > 0).all())
    weight = ebc.embedding_bags["t"].weight.detach()
    before = weight.clone()
    out, remapped = mc_ebc(_kjt([60, 60], [60, 10]))  # 60 x3 evicts 30 from row 2
    assert remapped.values().tolist() == [2, 2, 2, 0]
    state = ebc.fused_optimizer.state_dict()["state"]
    momentum = next(v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() == 1)
    assert momentum[2].item() == 0.0 and bool((momentum[:2] > 0).all())
    assert not torch.equal(weight[2], before[2])
    torch.testing.assert_close(weight[:2], before[:2], rtol=0, atol=0)


@pytest.mark.parametrize("blocks", [None, [0, 2, 4]])
def test_eval_remap_traces_and_scripts_to_the_eager_rows(blocks: list[int] | None) -> None:
    """TorchRec traces an eval-mode collection with torch.fx and scripts the graph (its
    inference path): the remap must be one traced leaf, and scriptable. ``blocks``: a state
    loaded from a 2-block row-wise training, where a missing id gets its block's last row."""
    from recsys_core.fx import symbolic_trace

    mcc = _mcc(_tables())
    mcc(_kjt([10, 20, 10, 30, 40], [50, 60]))  # train once: some ids get rows
    mcc.eval()
    module = mcc._managed_collision_modules["t"]
    module._miss_segments = blocks
    probe = _kjt([10, 99, 7, 30], [98, 40, 3])
    eager = mcc(probe)
    traced = symbolic_trace(mcc)
    scripted = torch.jit.script(traced)
    for out in (traced(probe), scripted(probe)):
        assert out.keys() == eager.keys()
        assert torch.equal(out.values(), eager.values())
        assert torch.equal(out.lengths(), eager.lengths())
    missing = eager.values()[torch.tensor([1, 2, 4, 6])]  # 99, 7, 98, 3 have no row
    if blocks is None:
        assert missing.tolist() == [3, 3, 3, 3]  # the table's last row
    else:  # ids route to blocks of ceil(input_size / 2); each gets its block's last row, 1 or 3
        assert set(missing.tolist()) <= {1, 3} and missing.tolist() != [3, 3, 3, 3]
