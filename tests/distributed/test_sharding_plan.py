"""Plan generators (hand-computed shards), the printed plan, JSON round trips, bad plans."""

from __future__ import annotations

import pytest
import torch

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from recsys_core.distributed.sharding_plan import (
    ParameterShardingGenerator,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_blocks,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
    validate_module_sharding_plan,
)
from recsys_core.distributed.types import (
    EmbeddingComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)

K = EmbeddingComputeKernel
T10x8 = EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=8, feature_names=["f"])
T2x8 = EmbeddingBagConfig(name="t", num_embeddings=2, embedding_dim=8, feature_names=["f"])


def shards(ps: ParameterSharding) -> list[tuple[list[int], list[int], str]]:
    return [(s.shard_offsets, s.shard_sizes, str(s.placement)) for s in ps.shards]


def test_row_blocks_follow_torchrec_ceil_rule() -> None:
    assert row_blocks(10, 4) == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert row_blocks(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]
    assert row_blocks(8, 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert row_blocks(4, 3) == [(0, 2), (2, 2), (4, 0)]


def test_row_wise_10x8_over_4() -> None:
    ps = row_wise()(T10x8, 4, 4, "cpu")
    # TorchRec's default kernel: DENSE unless an optimizer is applied in backward to the weight
    assert ps.sharding_type is ShardingType.ROW_WISE and ps.compute_kernel is K.DENSE
    assert ps.ranks == [0, 1, 2, 3]
    assert shards(ps) == [
        ([0, 0], [3, 8], "rank:0/cpu"),
        ([3, 0], [3, 8], "rank:1/cpu"),
        ([6, 0], [3, 8], "rank:2/cpu"),
        ([9, 0], [1, 8], "rank:3/cpu"),
    ]


def test_row_wise_keeps_empty_shards_for_every_rank() -> None:
    ps = row_wise()(T2x8, 4, 4, "cpu")
    assert ps.ranks == [0, 1, 2, 3]
    assert [s.shard_sizes for s in ps.shards] == [[1, 8], [1, 8], [0, 8], [0, 8]]
    assert [s.shard_offsets for s in ps.shards] == [[0, 0], [1, 0], [2, 0], [2, 0]]
    validate_module_sharding_plan([T2x8], EmbeddingModuleShardingPlan({"t": ps}), 4, 4)


def test_row_wise_cuda_placement_uses_local_index() -> None:
    ps = row_wise()(T10x8, 2, 4, "cuda")
    assert [str(s.placement) for s in ps.shards] == [
        "rank:0/cuda:0", "rank:1/cuda:1", "rank:2/cuda:0", "rank:3/cuda:1"
    ]


def test_column_wise() -> None:
    ps = column_wise([0, 1])(T10x8, 2, 2, "cpu")
    assert ps.sharding_type is ShardingType.COLUMN_WISE and ps.ranks == [0, 1]
    assert shards(ps) == [([0, 0], [10, 4], "rank:0/cpu"), ([0, 4], [10, 4], "rank:1/cpu")]
    twice = column_wise([1, 1], K.FUSED_UVM)(T10x8, 2, 2, "cpu")
    assert twice.ranks == [1, 1] and twice.compute_kernel is K.FUSED_UVM
    assert [s.shard_offsets for s in twice.shards] == [[0, 0], [0, 4]]


def test_column_wise_must_divide() -> None:
    with pytest.raises(ValueError, match=r"table 't': embedding_dim 8 .* into 3 equal column"):
        column_wise([0, 1, 2])(T10x8, 4, 4, "cpu")
    with pytest.raises(ValueError, match="ranks is empty"):
        column_wise([])


def test_table_wise_and_data_parallel() -> None:
    tw = table_wise(rank=2)(T10x8, 4, 4, "cpu")
    assert tw.sharding_type is ShardingType.TABLE_WISE and tw.ranks == [2]
    assert shards(tw) == [([0, 0], [10, 8], "rank:2/cpu")]
    dp = data_parallel()(T10x8, 2, 4, "cpu")
    assert dp.sharding_type is ShardingType.DATA_PARALLEL
    assert dp.ranks == [0, 1, 2, 3] and dp.sharding_spec is None and dp.compute_kernel is K.DENSE


def test_table_row_wise_on_second_host() -> None:
    ps = table_row_wise(host_index=1)(T10x8, 2, 4, "cpu")
    assert ps.sharding_type is ShardingType.TABLE_ROW_WISE and ps.ranks == [2, 3]
    assert shards(ps) == [([0, 0], [5, 8], "rank:2/cpu"), ([5, 0], [5, 8], "rank:3/cpu")]
    with pytest.raises(ValueError, match=r"table 't': host_index 2 is outside \[0, 2\)"):
        table_row_wise(host_index=2)(T10x8, 2, 4, "cpu")


def test_table_column_wise_on_second_host() -> None:
    ps = table_column_wise(host_index=1)(T10x8, 2, 4, "cpu")
    assert ps.sharding_type is ShardingType.TABLE_COLUMN_WISE and ps.ranks == [2, 3]
    assert shards(ps) == [([0, 0], [10, 4], "rank:2/cpu"), ([0, 4], [10, 4], "rank:3/cpu")]
    one = table_column_wise(host_index=0, ranks_per_table=1)(T10x8, 2, 4, "cpu")
    assert shards(one) == [([0, 0], [10, 8], "rank:0/cpu")]
    with pytest.raises(ValueError, match=r"table 't': ranks_per_table 3 is outside \[1, 2\]"):
        table_column_wise(host_index=0, ranks_per_table=3)(T10x8, 2, 4, "cpu")


def _ebc(*tables: tuple[str, int, int]) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{n}"])
         for n, r, d in tables],
        device="meta",
    )


def test_construct_module_plan_order_and_missing_tables() -> None:
    ebc = _ebc(("a", 10, 8), ("b", 6, 8), ("c", 4, 4))
    plan = construct_module_sharding_plan(
        ebc, {"c": table_wise(rank=1), "a": row_wise()}, world_size=2, local_size=2
    )
    assert list(plan) == ["a", "c"]  # module order; "b" is not sharded
    assert plan["c"].ranks == [1] and plan["a"].ranks == [0, 1]
    with pytest.raises(ValueError, match=r"\['nope'\], which are not tables .*\['a', 'b', 'c'\]"):
        construct_module_sharding_plan(ebc, {"nope": row_wise()}, world_size=2)


def test_construct_module_plan_for_embedding_collection() -> None:
    ec = EmbeddingCollection(
        [EmbeddingConfig(name="seq", num_embeddings=9, embedding_dim=6)], device="meta"
    )
    plan = construct_module_sharding_plan(ec, {"seq": column_wise([0, 1, 0])}, world_size=2)
    assert [s.shard_sizes for s in plan["seq"].shards] == [[9, 2]] * 3


def test_default_local_size(monkeypatch: pytest.MonkeyPatch) -> None:
    ebc = _ebc(("a", 10, 8))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    plan = construct_module_sharding_plan(ebc, {"a": table_row_wise(0)}, world_size=4)
    assert plan["a"].ranks == [0, 1, 2, 3]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # what torchrun exports
    plan = construct_module_sharding_plan(ebc, {"a": table_row_wise(1)}, world_size=4)
    assert plan["a"].ranks == [2, 3]
    with pytest.raises(ValueError, match="local_size 3 does not divide world_size 4"):
        construct_module_sharding_plan(ebc, {"a": row_wise()}, world_size=4, local_size=3)


def test_tutorial_plan_prints_exactly(tutorial_tables: list[EmbeddingBagConfig],
                                      tutorial_plan_lines: dict[str, list[str]]) -> None:
    ebc = EmbeddingBagCollection(tutorial_tables, device="meta")
    fused = K.FUSED  # the tutorial's plan comes from the planner, which picks FUSED
    plan = construct_module_sharding_plan(
        ebc,
        {"product_table": table_wise(rank=0, compute_kernel=fused),
         "user_table": table_wise(rank=0, compute_kernel=fused)},
        world_size=1,
        local_size=1,
    )
    # TorchRec's layout (conftest's lines, written by hand); modules separated by a blank line
    module = tutorial_plan_lines["cpu"]
    assert str(ShardingPlan({"": plan})) == "\n".join(["module: ", *module])
    two = str(ShardingPlan({"a": plan, "b": plan}))
    assert two == "\n".join(["module: a", *module, "", "module: b", *module])


GENERATORS: dict[str, ParameterShardingGenerator] = {
    "dp": data_parallel(),
    "tw": table_wise(rank=3, compute_kernel=K.FUSED_UVM_CACHING),
    "rw": row_wise(),
    "cw": column_wise([3, 0]),
    "twrw": table_row_wise(host_index=1),
    "twcw": table_column_wise(host_index=0, compute_kernel=K.FUSED_UVM),
}


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_json_round_trip_every_sharding_type(device_type: str) -> None:
    ebc = _ebc(*[(name, 11, 8) for name in GENERATORS])
    plan = construct_module_sharding_plan(ebc, GENERATORS, 4, 2, device_type)
    assert {ps.sharding_type for ps in plan.values()} == set(ShardingType) - {
        ShardingType.GRID_SHARD}
    full = ShardingPlan({"": plan, "over.arch": {"dp": plan["dp"]}})
    back = ShardingPlan.from_json(full.to_json())
    assert list(back) == ["", "over.arch"]
    for path in full:
        original, restored = full.plan[path], back.plan[path]
        assert isinstance(restored, EmbeddingModuleShardingPlan)
        assert list(restored) == list(original)
        for name, ps in original.items():
            got = restored[name]
            assert got.sharding_type is ps.sharding_type
            assert got.compute_kernel is ps.compute_kernel
            assert got.ranks == ps.ranks and got.cache_params == ps.cache_params
            assert got.sharding_spec == ps.sharding_spec
            assert got == ps
    assert str(back) == str(full)


# Bad plans for one 10 x 8 table "t" on world 4, 2 ranks per host.
def _ps(
    sharding_type: ShardingType,
    spec: list[tuple[list[int], list[int], int]] | None,
    kernel: EmbeddingComputeKernel = K.FUSED,
    ranks: list[int] | None = None,
) -> ParameterSharding:
    return ParameterSharding(
        sharding_type=sharding_type,
        compute_kernel=kernel,
        ranks=ranks if ranks is not None else [r for _, _, r in spec or []],
        sharding_spec=None if spec is None else [
            ShardMetadata(o, s, f"rank:{r}/cpu") for o, s, r in spec
        ],
    )


RW, CW, TW = ShardingType.ROW_WISE, ShardingType.COLUMN_WISE, ShardingType.TABLE_WISE
TWRW, TWCW = ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE
DP = ShardingType.DATA_PARALLEL
RW_OK = [([0, 0], [3, 8], 0), ([3, 0], [3, 8], 1), ([6, 0], [3, 8], 2), ([9, 0], [1, 8], 3)]

BAD_PLANS = {
    "rank_out_of_world": (_ps(TW, [([0, 0], [10, 8], 4)]), r"rank 4 in ranks \[4\] is outside"),
    "negative_rank": (
        _ps(CW, [([0, 0], [10, 4], 0), ([0, 4], [10, 4], 1)], ranks=[-1, 1]), "rank -1"),
    "placement_out_of_world": (
        _ps(TW, [([0, 0], [10, 8], 7)], ranks=[0]), r"shard 0 is placed on rank 7"),
    "bad_placement": (
        ParameterSharding(TW, K.FUSED, [0], [ShardMetadata([0, 0], [10, 8], "cpu:0")]),
        "'rank:<r>/<device>'"),
    "ranks_mismatch": (
        _ps(CW, [([0, 0], [10, 4], 0), ([0, 4], [10, 4], 1)], ranks=[1, 0]),
        r"ranks \[1, 0\] do not match the shard placements \[0, 1\]"),
    "rw_overlap": (
        _ps(RW, [([0, 0], [4, 8], 0), ([3, 0], [3, 8], 1), ([6, 0], [3, 8], 2),
                 ([9, 0], [1, 8], 3)]),
        r"shard 1 starts at row 3 .* end at 4: it overlaps"),
    "rw_gap": (
        _ps(RW, [([0, 0], [2, 8], 0), ([3, 0], [3, 8], 1), ([6, 0], [3, 8], 2),
                 ([9, 0], [1, 8], 3)]),
        r"shard 1 starts at row 3 .* end at 2: it leaves a gap"),
    "rw_out_of_bounds": (
        _ps(RW, [*RW_OK[:3], ([9, 0], [2, 8], 3)]), r"shard 3 ends at row 11, past .* 10 rows"),
    "rw_short": (
        _ps(RW, [*RW_OK[:3], ([9, 0], [0, 8], 3)]), r"rows \[9, 10\) are in no shard"),
    "rw_partial_columns": (
        _ps(RW, [*RW_OK[:3], ([9, 0], [1, 4], 3)]), r"shard 3 spans columns \[0, 4\)"),
    "rw_not_on_all_ranks": (
        _ps(RW, [([0, 0], [5, 8], 0), ([5, 0], [5, 8], 1)]), "use table_row_wise"),
    "rw_negative_size": (
        _ps(RW, [*RW_OK[:3], ([9, 0], [-1, 8], 3)]), "non-negative"),
    "rw_float_offset": (
        _ps(RW, [*RW_OK[:3], ([9.0, 0], [1, 8], 3)]), r"offsets \[9.0, 0\] .* ints"),
    "cw_gap": (_ps(CW, [([0, 0], [10, 4], 0), ([0, 5], [10, 3], 1)]), "leaves a gap"),
    "cw_overlap": (_ps(CW, [([0, 0], [10, 4], 0), ([0, 3], [10, 5], 1)]), "overlaps"),
    "cw_not_dividing": (
        _ps(CW, [([0, 0], [10, 3], 0), ([0, 3], [10, 3], 1), ([0, 6], [10, 3], 2)]),
        r"ends at column 9, past the table's 8 columns"),
    "cw_short": (_ps(CW, [([0, 0], [10, 4], 0)]), r"columns \[4, 8\) are in no shard"),
    "cw_partial_rows": (
        _ps(CW, [([0, 0], [9, 4], 0), ([0, 4], [10, 4], 1)]), r"shard 0 spans rows \[0, 9\)"),
    "cw_empty_shard": (
        _ps(CW, [([0, 0], [10, 8], 0), ([0, 8], [10, 0], 1)]), "shard 1 has 0 columns"),
    "tw_partial": (_ps(TW, [([0, 0], [5, 8], 0)]), r"one shard \[0, 0\] / \[10, 8\]"),
    "tw_two_shards": (_ps(TW, [([0, 0], [10, 8], 0), ([0, 0], [10, 8], 1)]), "one shard"),
    "no_shards": (_ps(CW, []), "no shards"),
    "dp_with_spec": (_ps(DP, [([0, 0], [10, 8], 0)]), "set sharding_spec=None"),
    "dp_some_ranks": (_ps(DP, None, ranks=[0, 1]), r"ranks must be \[0, 1, 2, 3\]"),
    "twrw_two_hosts": (
        _ps(TWRW, [([0, 0], [5, 8], 1), ([5, 0], [5, 8], 2)]), r"span hosts \[0, 1\]"),
    "twrw_part_of_host": (_ps(TWRW, [([0, 0], [10, 8], 2)]), r"every rank of the host"),
    "twcw_two_hosts": (
        _ps(TWCW, [([0, 0], [10, 4], 0), ([0, 4], [10, 4], 3)]), r"span hosts \[0, 1\]"),
    "quant_in_training": (_ps(TW, [([0, 0], [10, 8], 0)], K.QUANT), "quant is for inference"),
    "key_value_kernel": (
        _ps(TW, [([0, 0], [10, 8], 0)], K.KEY_VALUE),
        "compute kernel key_value is not available in recsys_core: .*SSD key-value store"),
    "triton_kernel": (
        _ps(TW, [([0, 0], [10, 8], 0)], K.FUSED_TRITON), "fused_triton is not available"),
    "grid_two_hosts_per_block": (
        _ps(ShardingType.GRID_SHARD, [([0, 0], [5, 4], 1), ([5, 0], [5, 4], 2),
                                      ([0, 4], [5, 4], 0), ([5, 4], [5, 4], 1)]),
        r"column block at 0: .*span hosts \[0, 1\]"),
    "grid_uneven_columns": (
        _ps(ShardingType.GRID_SHARD, [([0, 0], [5, 2], 0), ([5, 0], [5, 2], 1),
                                      ([0, 2], [5, 6], 2), ([5, 2], [5, 6], 3)]),
        r"column blocks start at \[0, 2\] with widths \[2, 6\]"),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_bad_plan_names_table(case: str) -> None:
    sharding, pattern = BAD_PLANS[case]
    plan = EmbeddingModuleShardingPlan({"t": sharding})
    with pytest.raises(ValueError, match=r"table 't'.*" + pattern):
        validate_module_sharding_plan([T10x8], plan, world_size=4, local_size=2)


def test_unknown_table_in_plan() -> None:
    plan = EmbeddingModuleShardingPlan({"t": row_wise()(T10x8, 2, 4, "cpu")})
    ebc = _ebc(("a", 10, 8), ("b", 10, 8))
    with pytest.raises(ValueError, match=r"table 't', which the module does not have .*'a', 'b'"):
        validate_module_sharding_plan(ebc, plan, world_size=4, local_size=2)


def test_good_plans_pass_including_uneven_column_tiling() -> None:
    uneven = _ps(CW, [([0, 0], [10, 2], 1), ([0, 2], [10, 6], 0)])
    uneven_rows = _ps(RW, [([0, 0], [1, 8], 0), ([1, 0], [0, 8], 1), ([1, 0], [9, 8], 2),
                           ([10, 0], [0, 8], 3)])
    # Empty trailing row shards at i * block (past the table) hold nothing: accepted.
    literal_blocks = _ps(RW, [([0, 0], [1, 8], 0), ([1, 0], [1, 8], 1), ([2, 0], [0, 8], 2),
                              ([3, 0], [0, 8], 3)])
    validate_module_sharding_plan([T2x8], EmbeddingModuleShardingPlan({"t": literal_blocks}), 4, 2)
    for ps in (uneven, uneven_rows, *(g(T10x8, 2, 4, "cpu") for g in GENERATORS.values())):
        validate_module_sharding_plan([T10x8], EmbeddingModuleShardingPlan({"t": ps}), 4, 2)


def test_inference_plans_need_quant() -> None:
    ebc = _ebc(("a", 10, 8))
    plan = construct_module_sharding_plan(
        ebc, {"a": row_wise(K.QUANT)}, world_size=2, inference=True
    )
    assert plan["a"].compute_kernel is K.QUANT
    with pytest.raises(ValueError, match=r"table 'a'.*dense in an inference plan"):
        construct_module_sharding_plan(ebc, {"a": row_wise()}, world_size=2, inference=True)
    with pytest.raises(ValueError, match=r"table 'a'.*quant is for inference"):
        construct_module_sharding_plan(ebc, {"a": row_wise(K.QUANT)}, world_size=2, inference=False)
    # by default, a plan with a QUANT table is an inference plan: every table must be QUANT
    plan = construct_module_sharding_plan(ebc, {"a": row_wise(K.QUANT)}, world_size=2)
    assert plan["a"].compute_kernel is K.QUANT
    two = _ebc(("a", 10, 8), ("b", 10, 8))
    with pytest.raises(ValueError, match=r"table 'b'.*dense in an inference plan"):
        construct_module_sharding_plan(two, {"a": row_wise(K.QUANT), "b": row_wise()}, world_size=2)


def test_other_modules_are_rejected() -> None:
    with pytest.raises(TypeError, match="got a Linear"):
        construct_module_sharding_plan(torch.nn.Linear(2, 2), {}, world_size=1)
