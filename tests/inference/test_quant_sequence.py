"""Quantized sequence collections (TorchRec's ``quant.EmbeddingCollection``, its managed-collision
and feature-processed siblings, their sharders) against the float modules they come from."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recsys_core import DataType, IdOutOfRangeError, KernelBackend, KeyedJaggedTensor
from recsys_core.distributed.quant_embedding import (
    QuantEmbeddingCollectionSharder,
    QuantManagedCollisionEmbeddingCollectionSharder,
)
from recsys_core.distributed.quant_state import WeightSpec
from recsys_core.distributed.types import CacheParams, MultiPassPrefetchConfig
from recsys_core.inference.modules import DEFAULT_SHARDERS, quantize_inference_model
from recsys_core.kernels import fbgemm_available
from recsys_core.kernels.quant_tbe import WeightType, quantize_rows, row_error_bound
from recsys_core.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, QuantConfig
from recsys_core.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recsys_core.modules.feature_processor_ import PositionWeightedModuleCollection
from recsys_core.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from recsys_core.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from recsys_core.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from recsys_core.quant.embedding_modules import (
    EmbeddingBagCollection as QuantEBC,
)
from recsys_core.quant.embedding_modules import (
    EmbeddingCollection as QuantEC,
)
from recsys_core.quant.embedding_modules import (
    FeatureProcessedEmbeddingBagCollection as QuantFPEBC,
)
from recsys_core.quant.embedding_modules import (
    QuantManagedCollisionEmbeddingCollection as QuantMCEC,
)
from recsys_core.quant.sharding import shard_quant_model

BACKENDS = [pytest.param(KernelBackend.AUTO, id="auto"), pytest.param(KernelBackend.TORCH, id="torch")]
WEIGHT_TYPES = {DataType.INT8: WeightType.INT8, DataType.INT4: WeightType.INT4,
                DataType.INT2: WeightType.INT2, DataType.FP16: WeightType.FP16}


def tables() -> list[EmbeddingConfig]:
    """t1 holds features a and c, t2 holds b and c: c is looked up in both (c@t1, c@t2)."""
    return [
        EmbeddingConfig(name="t1", num_embeddings=50, embedding_dim=8, feature_names=["a", "c"]),
        EmbeddingConfig(name="t2", num_embeddings=12, embedding_dim=8, feature_names=["b", "c"]),
    ]


def float_ec(need_indices: bool = False) -> EmbeddingCollection:
    torch.manual_seed(0)
    return EmbeddingCollection(tables(), need_indices=need_indices)


def batch() -> KeyedJaggedTensor:
    """Keys in an order of their own; B = 3: b [[3], [], [7, 7]], a [[1, 2], [49], []],
    c [[0], [5, 11], [4]]."""
    return KeyedJaggedTensor.from_lengths_sync(
        ["b", "a", "c"],
        torch.tensor([3, 7, 7, 1, 2, 49, 0, 5, 11, 4]),
        torch.tensor([1, 0, 2, 2, 1, 0, 1, 2, 1]),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("data_type", list(WEIGHT_TYPES))
def test_rows_are_the_dequantized_float_rows(backend: KernelBackend, data_type: DataType) -> None:
    """Each output row is its id's float row up to the row's quantization bound; names,
    lengths and ids (need_indices) are the float collection's."""
    ec = float_ec(need_indices=True)
    q = QuantEC.from_float(ec, dtype=data_type, backend=backend)
    assert [c.data_type for c in q.embedding_configs()] == [data_type, data_type]
    ref, out = ec(batch()), q(batch())
    assert list(out) == list(ref) == ["a", "c@t1", "b", "c@t2"]
    table_of = {"a": "t1", "c@t1": "t1", "b": "t2", "c@t2": "t2"}
    for name, jt in out.items():
        weight = ec.embeddings[table_of[name]].weight.detach()
        wt = WEIGHT_TYPES[data_type]
        bound = row_error_bound(weight, quantize_rows(weight, wt), wt)
        ids = ref[name].weights()
        assert torch.equal(jt.lengths(), ref[name].lengths())
        assert torch.equal(jt.weights(), ids)
        error = (jt.values() - ref[name].values()).abs().max(dim=1).values
        assert bool((error <= bound[ids] + 1e-7).all()), (name, error, bound[ids])
        assert jt.values().dtype == torch.float32


@pytest.mark.skipif(not fbgemm_available(), reason="compares FBGEMM's kernel with ours")
def test_fbgemm_and_torch_kernels_agree_bitwise() -> None:
    ec = float_ec()
    fbgemm = QuantEC.from_float(ec, dtype=DataType.INT4, backend=KernelBackend.FBGEMM)
    torch_ = QuantEC.from_float(ec, dtype=DataType.INT4, backend=KernelBackend.TORCH)
    assert fbgemm.kernel_backend() is KernelBackend.FBGEMM
    for name, jt in fbgemm(batch()).items():
        assert torch.equal(jt.values(), torch_(batch())[name].values())


def test_fp32_storage_is_exact_and_state_dict_round_trips() -> None:
    """FP32 tables give the float rows exactly; a collection built empty and loaded from the
    state dict gives the same outputs; keys are the float collection's."""
    ec = float_ec()
    q = QuantEC.from_float(ec, dtype=DataType.FP32)
    for name, jt in q(batch()).items():
        assert torch.equal(jt.values(), ec(batch())[name].values())
    int8 = QuantEC.from_float(ec, dtype=DataType.INT8)
    assert sorted(int8.state_dict()) == sorted(ec.state_dict()) == [
        "embeddings.t1.weight", "embeddings.t2.weight"]
    empty = QuantEC(int8.embedding_configs())
    assert not torch.equal(empty(batch())["a"].values(), int8(batch())["a"].values())
    empty.load_state_dict(int8.state_dict())
    for name, jt in empty(batch()).items():
        assert torch.equal(jt.values(), int8(batch())[name].values())


def test_output_dtype_fp16_is_the_fp32_result_rounded_once() -> None:
    ec = float_ec()
    fp32 = QuantEC.from_float(ec, dtype=DataType.INT8)
    fp16 = QuantEC.from_float(ec, dtype=DataType.INT8, output_dtype=torch.float16)
    for name, jt in fp16(batch()).items():
        assert jt.values().dtype == torch.float16
        assert torch.equal(jt.values(), fp32(batch())[name].values().half())


def test_bad_inputs_name_the_feature_and_the_fix() -> None:
    q = QuantEC.from_float(float_ec(), dtype=DataType.INT8)
    bad = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b", "c"], torch.tensor([1, 12, 0]), torch.tensor([1, 1, 1])
    )
    with pytest.raises(IdOutOfRangeError, match="'b'.*12"):
        q(bad)
    with pytest.raises(ValueError, match="lacks feature"):
        q(KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1]), torch.tensor([1])))
    with pytest.raises(ValueError, match="same embedding_dim"):
        QuantEC([EmbeddingConfig(name="x", num_embeddings=4, embedding_dim=4, feature_names=["x"],
                                 data_type=DataType.INT8),
                 EmbeddingConfig(name="y", num_embeddings=4, embedding_dim=8, feature_names=["y"],
                                 data_type=DataType.INT8)])
    with pytest.raises(ValueError, match="quant_state_dict_split_scale_bias"):
        QuantEC(q.embedding_configs(), quant_state_dict_split_scale_bias=True)
    with pytest.raises(ValueError, match="cannot be moved"):
        q.to("meta")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ec = EmbeddingCollection(tables())
        self.ebc = EmbeddingBagCollection([
            EmbeddingBagConfig(name="bag", num_embeddings=50, embedding_dim=4, feature_names=["a"])
        ])


def test_torchrec_quantize_dynamic_recipe_reads_the_qconfig() -> None:
    """TorchRec's recipe: ``quantize_dynamic`` with a qconfig whose weight observer says
    ``torch.quint4x2`` gives INT4 tables; a QuantConfig's per-table dtype overrides one table;
    the activation dtype is the output dtype."""
    quant = torch.ao.quantization
    model = _Model()
    qconfig = QuantConfig(
        activation=quant.PlaceholderObserver.with_args(dtype=torch.float16),
        weight=quant.PlaceholderObserver.with_args(dtype=torch.quint4x2),
        per_table_weight_dtype={"t2": torch.qint8},
    )
    quantize_dynamic = quant.quantize_dynamic
    out = quantize_dynamic(
        model,
        qconfig_spec={EmbeddingCollection: qconfig, EmbeddingBagCollection: qconfig},
        mapping={EmbeddingCollection: QuantEC, EmbeddingBagCollection: QuantEBC},
        inplace=False,
    )
    assert isinstance(out.ec, QuantEC) and isinstance(out.ebc, QuantEBC)
    assert {c.name: c.data_type for c in out.ec.embedding_configs()} == {
        "t1": DataType.INT4, "t2": DataType.INT8}
    assert out.ebc.embedding_bag_configs()[0].data_type is DataType.INT4
    assert out.ec.output_dtype() is torch.float16
    assert out.ec(batch())["a"].values().dtype == torch.float16
    assert out.ebc(batch()).values().dtype == torch.float16


def test_quantize_inference_model_quantizes_sequence_collections() -> None:
    model = quantize_inference_model(_Model(), per_table_weight_dtype={"t1": torch.quint4x2})
    assert isinstance(model.ec, QuantEC) and isinstance(model.ebc, QuantEBC)
    assert {c.name: c.data_type for c in model.ec.embedding_configs()} == {
        "t1": DataType.INT4, "t2": DataType.INT8}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sharded_equals_unsharded_exactly(world_size: int) -> None:
    """Tables spread over devices table-wise; outputs bitwise those of the unsharded module,
    keys in its order; DEFAULT_SHARDERS holds the sequence collection's sharder."""
    q = QuantEC.from_float(float_ec(need_indices=True), dtype=DataType.INT8)
    ref = q(batch())
    sharded = shard_quant_model(q, world_size=world_size)
    assert type(sharded).__name__ == "ShardedQuantEmbeddingCollection"
    placed = sorted(t for names in sharded.tables_per_rank().values() for t in names)
    assert placed == ["t1", "t2"]
    out = sharded(batch())
    assert list(out) == list(ref)
    for name, jt in out.items():
        assert torch.equal(jt.values(), ref[name].values())
        assert torch.equal(jt.lengths(), ref[name].lengths())
        assert torch.equal(jt.weights(), ref[name].weights())
    assert any(isinstance(s, QuantEmbeddingCollectionSharder) for s in DEFAULT_SHARDERS)


def _mc_ec() -> ManagedCollisionEmbeddingCollection:
    torch.manual_seed(0)
    configs = [EmbeddingConfig(name="t", num_embeddings=16, embedding_dim=4, feature_names=["f"])]
    mcc = ManagedCollisionCollection(
        {"t": MCHManagedCollisionModule(
            zch_size=16, device=torch.device("cpu"), eviction_interval=1,
            eviction_policy=DistanceLFU_EvictionPolicy(),
        )},
        configs,
    )
    return ManagedCollisionEmbeddingCollection(
        EmbeddingCollection(configs), mcc, return_remapped_features=True
    )


def test_managed_collision_quantized_keeps_the_frozen_mapping() -> None:
    """After training steps admit raw ids, the quantized module remaps them exactly as the float
    module in eval mode (same slots) and looks up the quantized rows of those slots; a second
    forward changes no slot (inference mode: no profiling, no eviction)."""
    mc = _mc_ec()
    raw = KeyedJaggedTensor.from_lengths_sync(
        ["f"], torch.tensor([1000, 2000, 3000, 1000, 4000]), torch.tensor([2, 3])
    )
    mc.train()
    for _ in range(3):
        mc(raw)
    mc.eval()
    ref, ref_remapped = mc(raw)
    q = QuantMCEC.from_float(mc, dtype=DataType.FP32)
    assert isinstance(q, QuantMCEC)
    for _ in range(2):
        out, remapped = q(raw)
        assert torch.equal(remapped.values(), ref_remapped.values())
        assert torch.equal(out["f"].values(), ref["f"].values())
    slots = ref_remapped.values()
    assert bool(((slots >= 0) & (slots < 16)).all()) and len(set(slots.tolist())) == 4
    sharded = QuantManagedCollisionEmbeddingCollectionSharder(QuantEmbeddingCollectionSharder())
    assert sharded.module_type is QuantMCEC


def test_feature_processed_quantized_equals_quantized_lookup_of_processed_features() -> None:
    """The quantized FP-EBC runs the float processors, then the weighted quantized lookup: equal
    to a quantized EBC fed the processed KJT."""
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"])],
        is_weighted=True,
    )
    processors = PositionWeightedModuleCollection({"f": 3})
    with torch.no_grad():
        processors.position_weights["f"].copy_(torch.tensor([1.0, 0.5, 2.0]))
    fp = FeatureProcessedEmbeddingBagCollection(ebc, processors)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2, 3, 4]), torch.tensor([3, 1]))
    q = QuantFPEBC.from_float(fp, dtype=DataType.INT8)
    plain = QuantEBC.from_float(ebc, dtype=DataType.INT8)
    assert torch.equal(q(kjt).values(), plain(processors(kjt)).values())
    # by hand: bag 0 = 1*row1 + 0.5*row2 + 2*row3 (dequantized rows), bag 1 = 1*row4
    rows = plain(KeyedJaggedTensor.from_lengths_sync(
        ["f"], torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 1, 1]),
        weights=torch.ones(4))).values()
    expected = torch.stack([rows[0] + 0.5 * rows[1] + 2 * rows[2], rows[3]])
    torch.testing.assert_close(q(kjt).values(), expected)
    sharded = shard_quant_model(q, world_size=2)
    assert torch.equal(sharded(kjt).values(), q(kjt).values())


def test_torchrec_names_for_plans_and_weights() -> None:
    spec = WeightSpec("ebc.embedding_bags.t.weight", [500, 0], [500, 64], "row_wise")
    assert spec.virtual_table_dim_offsets is None and spec.shard_sizes == [500, 64]
    config = MultiPassPrefetchConfig()
    assert (config.num_passes, config.min_splitable_pass_size) == (12, 6 * 1024 * 1024)
    params = CacheParams(load_factor=0.1, multipass_prefetch_config=MultiPassPrefetchConfig(10))
    assert params.multipass_prefetch_config.num_passes == 10
