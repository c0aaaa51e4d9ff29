"""shard_quant_model on several CPU devices: placement as planned, outputs == unsharded."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from recsys_core import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    IdOutOfRangeError,
    KernelBackend,
    KeyedJaggedTensor,
)
from recsys_core.distributed import (
    EmbeddingComputeKernel,
    ShardingPlan,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recsys_core.inference import (
    QuantEmbeddingBagCollection,
    ShardedQuantEmbeddingBagCollection,
    quant_table_wise_plan,
    quantize_inference_model,
    shard_quant_model,
)

MakeKJT = Callable[..., KeyedJaggedTensor]
QUANT = EmbeddingComputeKernel.QUANT
DTYPES = {"t_shared": DataType.INT8, "t_mean": DataType.INT4, "t_wide": DataType.FP16, "t_small": DataType.INT2}


def quantized(tables: list[EmbeddingBagConfig], weighted: bool = False,
              backend: KernelBackend = KernelBackend.AUTO) -> QuantEmbeddingBagCollection:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables, is_weighted=weighted)
    return QuantEmbeddingBagCollection.from_float(ebc, DTYPES, backend=backend)


def sized_tables() -> list[EmbeddingBagConfig]:
    """INT8 dim 16 -> 20-byte rows: 12800, 9600, 6400 and 1280 bytes (all 128-aligned)."""
    return [
        EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=16, feature_names=[name + "_f"],
                           data_type=DataType.INT8)
        for name, rows in [("tiny", 64), ("big", 640), ("small", 320), ("mid", 480)]
    ]


@pytest.mark.parametrize(
    "world_size, expected",
    [
        (2, {0: ["tiny", "big"], 1: ["small", "mid"]}),  # loads 14080 / 16000
        (3, {0: ["big"], 1: ["mid"], 2: ["tiny", "small"]}),
    ],
)
def test_default_plan_balances_bytes(world_size: int, expected: dict[int, list[str]]) -> None:
    quant = QuantEmbeddingBagCollection(sized_tables())
    assert quant.table_bytes() == {"tiny": 1280, "big": 12800, "small": 6400, "mid": 9600}
    sharded = shard_quant_model(quant, world_size=world_size)
    assert isinstance(sharded, ShardedQuantEmbeddingBagCollection)
    assert sharded.tables_per_rank() == expected
    sizes = quant.table_bytes()
    assert sharded.bytes_per_rank() == {r: sum(sizes[t] for t in ts) for r, ts in expected.items()}
    for name, sharding in sharded.plan.items():
        assert sharding.compute_kernel is QUANT
        assert name in expected[sharding.ranks[0]]
    assert all(d.type == "cpu" for d in sharded.devices_per_rank().values())


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("backend", [KernelBackend.AUTO, KernelBackend.TORCH])
def test_sharded_equals_unsharded(
    mixed_tables, make_kjt: MakeKJT, world_size: int, weighted: bool, backend: KernelBackend
) -> None:
    quant = quantized(mixed_tables, weighted, backend)
    sharded = ShardedQuantEmbeddingBagCollection(
        quant, quant_table_wise_plan(quant, world_size), [torch.device("cpu")] * world_size
    )
    assert len(sharded.ranks) == min(world_size, len(mixed_tables))  # 5 ranks, 4 tables
    for seed, keys in [(1, None), (2, ["f_small", "f_wide", "f_mean", "f_b", "f_a"])]:
        kjt = make_kjt(mixed_tables, 8, seed=seed, weighted=weighted, keys=keys)
        out, ref = sharded(kjt), quant(kjt)
        assert out.keys() == ref.keys() and out.length_per_key() == ref.length_per_key()
        assert torch.equal(out.values(), ref.values())
    state, ref_state = sharded.state_dict(), quant.state_dict()
    assert list(state) == list(ref_state)
    assert all(torch.equal(state[k], ref_state[k]) for k in state)


def test_explicit_plan_is_honoured(mixed_tables, make_kjt: MakeKJT) -> None:
    quant = quantized(mixed_tables)
    plan = construct_module_sharding_plan(
        quant.embedding_bag_configs(),
        {"t_shared": table_wise(2, QUANT), "t_mean": table_wise(0, QUANT),
         "t_wide": table_wise(2, QUANT), "t_small": table_wise(0, QUANT)},
        world_size=3, inference=True,
    )
    plan = ShardingPlan.from_json(ShardingPlan({"": plan}).to_json())  # plain data round trip
    sharded = shard_quant_model(quant, devices=["cpu", "cpu", "cpu"], plan=plan)
    assert sharded.tables_per_rank() == {0: ["t_mean", "t_small"], 2: ["t_shared", "t_wide"]}
    kjt = make_kjt(mixed_tables, 5, seed=3)
    assert torch.equal(sharded(kjt).values(), quant(kjt).values())
    with pytest.raises(IdOutOfRangeError, match=r"feature 'f_mean': id 35 .*outside \[0, 35\)"):
        sharded(KeyedJaggedTensor(keys=["f_a", "f_b", "f_mean", "f_wide", "f_small"],
                                  values=torch.tensor([0, 0, 35, 0, 0]), lengths=torch.ones(5, dtype=torch.int64)))


def _plan(quant: QuantEmbeddingBagCollection, generators: dict, world_size: int = 2, **kw):
    return construct_module_sharding_plan(
        quant.embedding_bag_configs(), generators, world_size=world_size, **kw
    )


@pytest.mark.parametrize(
    "make_plan, match",
    [
        (lambda q: _plan(q, {n: row_wise(QUANT) for n in DTYPES}, inference=True),
         r"table 't_shared' is row_wise; quantized inference places whole tables"),
        (lambda q: _plan(q, {"t_shared": table_wise(0, QUANT)}, inference=True),
         r"places no shard of tables \['t_mean', 't_wide', 't_small'\]"),
        (lambda q: _plan(q, {n: table_wise(0) for n in DTYPES}),
         r"table 't_shared' \(table_wise\): compute kernel dense in an inference plan"),
        (lambda q: _plan(q, {n: table_wise(3, QUANT) for n in DTYPES}, world_size=4, inference=True),
         r"rank 3 in ranks \[3\] is outside \[0, 2\)"),
        (lambda q: _plan(q, {n: table_wise(1, QUANT) for n in DTYPES}, inference=True,
                         device_type="cuda"),
         r"table 't_shared' is planned on 'rank:1/cuda:1' but rank 1's device is cpu"),
    ],
    ids=["row_wise", "missing_table", "fused_kernel", "rank_out_of_range", "device_mismatch"],
)
def test_bad_plans(mixed_tables, make_plan, match: str) -> None:
    quant = quantized(mixed_tables)
    with pytest.raises(ValueError, match=match):
        shard_quant_model(quant, world_size=2, plan=make_plan(quant))


class TwoTowers(nn.Module):
    def __init__(self, user: list[EmbeddingBagConfig], item: list[EmbeddingBagConfig]) -> None:
        super().__init__()
        self.user = EmbeddingBagCollection(user)
        self.towers = nn.ModuleDict({"item": EmbeddingBagCollection(item)})
        self.head = nn.Linear(4, 1)


def test_model_with_two_collections(mixed_tables, make_kjt: MakeKJT) -> None:
    model = quantize_inference_model(TwoTowers(mixed_tables[:2], mixed_tables[2:]), DataType.INT8)
    with pytest.raises(ValueError, match="one module plan given but the model has 2"):
        shard_quant_model(model, world_size=2, plan=quant_table_wise_plan(model.user, 2))
    with pytest.raises(ValueError, match=r"no entry for collection 'towers.item'"):
        shard_quant_model(model, world_size=2, plan=ShardingPlan({"user": quant_table_wise_plan(model.user, 2)}))
    user, item = model.user, model.towers["item"]
    kjt = make_kjt(mixed_tables, 6, seed=4)
    expected = (user(kjt).values(), item(kjt).values())
    head = model.head
    assert shard_quant_model(model, devices=["cpu", "cpu"]) is model
    assert isinstance(model.user, ShardedQuantEmbeddingBagCollection)
    assert isinstance(model.towers["item"], ShardedQuantEmbeddingBagCollection)
    assert model.head is head
    assert torch.equal(model.user(kjt).values(), expected[0])
    assert torch.equal(model.towers["item"](kjt).values(), expected[1])


def test_bad_arguments(mixed_tables) -> None:
    with pytest.raises(ValueError, match="no QuantEmbeddingBagCollection or QuantEmbeddingCollection; call quantize_inference_model"):
        shard_quant_model(EmbeddingBagCollection(mixed_tables), world_size=2)
    quant = quantized(mixed_tables)
    with pytest.raises(ValueError, match=r"pass devices=\[...\] or world_size=N"):
        shard_quant_model(quant)
    with pytest.raises(ValueError, match="2 devices but world_size 3"):
        shard_quant_model(quant, ["cpu", "cpu"], world_size=3)
    with pytest.raises(ValueError, match=r"mix types \['cpu', 'meta'\]; .*pass an explicit plan"):
        shard_quant_model(quant, ["cpu", "meta"])


def test_sharded_cannot_be_moved(mixed_tables) -> None:
    sharded = shard_quant_model(quantized(mixed_tables), world_size=2)
    sharded.to("cpu")
    with pytest.raises(ValueError, match="cannot be moved"):
        sharded.to("meta")
