"""QuantEmbeddingBagCollection against the float collection: contract, error bounds, bad input."""

from __future__ import annotations

import copy
import dataclasses
import io
from collections.abc import Callable

import pytest
import torch

from recsys_core import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbOptimType,
    FusedEmbeddingBagCollection,
    IdOutOfRangeError,
    KernelBackend,
    KeyedJaggedTensor,
    PoolingType,
)
from recsys_core.inference import QuantEmbeddingBagCollection
from recsys_core.kernels import fbgemm_available
from recsys_core.kernels.quant_tbe import row_error_bound

MakeKJT = Callable[..., KeyedJaggedTensor]

BACKENDS = [pytest.param(KernelBackend.AUTO, id="auto"), pytest.param(KernelBackend.TORCH, id="torch")]
INT_TYPES = [DataType.INT8, DataType.INT4, DataType.INT2]


def float_ebc(tables: list[EmbeddingBagConfig], weighted: bool = False, seed: int = 0) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    return EmbeddingBagCollection(tables, is_weighted=weighted)


def pooled_bound(
    ebc: EmbeddingBagCollection, per_row: dict[str, torch.Tensor], kjt: KeyedJaggedTensor
) -> torch.Tensor:
    """Per output element: sum over the bag of |w_i| * bound(row_i), / length for MEAN.

    ``per_row[table]`` is ``[rows]`` (one bound per row) or ``[rows, dim]`` (per element)."""
    features = kjt.to_dict()
    parts = []
    for config in ebc.embedding_bag_configs():
        bound = per_row[config.name]
        if bound.dim() == 1:
            bound = bound.unsqueeze(1).expand(-1, config.embedding_dim)
        for name in config.feature_names:
            jt = features[name]
            weights = jt.weights().abs() if ebc.is_weighted() else None
            pooled = torch.nn.functional.embedding_bag(
                jt.values(), bound.contiguous(), jt.offsets(), mode="sum",
                per_sample_weights=weights, include_last_offset=True,
            )
            if config.pooling is PoolingType.MEAN:
                pooled = pooled / jt.lengths().clamp(min=1).unsqueeze(1)
            parts.append(pooled)
    return torch.cat(parts, dim=1)


# ---- contract --------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_same_keys_shapes_and_order(mixed_tables, make_kjt: MakeKJT, backend: KernelBackend) -> None:
    ebc = float_ebc(mixed_tables)
    quant = QuantEmbeddingBagCollection.from_float(ebc, DataType.FP32, backend=backend)
    kjt = make_kjt(mixed_tables, 6, seed=1, keys=["f_small", "f_wide", "f_b", "f_mean", "f_a"])
    out, ref = quant(kjt), ebc(kjt)
    assert out.keys() == ref.keys() == ["f_a", "f_b", "f_mean", "f_wide", "f_small"]
    assert out.length_per_key() == ref.length_per_key() == [16, 16, 8, 36, 4]
    # FP32 storage: only float summation order differs from nn.EmbeddingBag.
    torch.testing.assert_close(out.values(), ref.values(), rtol=1e-6, atol=1e-6)


def test_backend_reported_and_fallback_equal(mixed_tables, make_kjt: MakeKJT) -> None:
    ebc = float_ebc(mixed_tables, weighted=True)
    auto = QuantEmbeddingBagCollection.from_float(ebc, DataType.INT4)
    torch_kernel = QuantEmbeddingBagCollection.from_float(ebc, DataType.INT4, backend=KernelBackend.TORCH)
    expected = KernelBackend.FBGEMM if fbgemm_available() else KernelBackend.TORCH
    assert auto.kernel_backend() is expected
    assert torch_kernel.kernel_backend() is KernelBackend.TORCH
    kjt = make_kjt(mixed_tables, 9, seed=2, weighted=True)
    torch.testing.assert_close(auto(kjt).values(), torch_kernel(kjt).values(), rtol=1e-6, atol=1e-6)


def test_quantizes_a_fused_collection(mixed_tables, make_kjt: MakeKJT) -> None:
    fused = FusedEmbeddingBagCollection(mixed_tables, EmbOptimType.EXACT_SGD, {"learning_rate": 0.1})
    ebc = EmbeddingBagCollection(mixed_tables)
    ebc.load_state_dict(fused.state_dict())
    kjt = make_kjt(mixed_tables, 4, seed=3)
    from_fused = QuantEmbeddingBagCollection.from_float(fused, DataType.INT8)
    from_ebc = QuantEmbeddingBagCollection.from_float(ebc, DataType.INT8)
    assert torch.equal(from_fused(kjt).values(), from_ebc(kjt).values())


def test_state_dict_round_trip(mixed_tables, make_kjt: MakeKJT) -> None:
    quant = QuantEmbeddingBagCollection.from_float(float_ebc(mixed_tables), DataType.INT4)
    state = quant.state_dict()
    assert list(state) == [f"embedding_bags.{c.name}.weight" for c in mixed_tables]
    # INT4 rows: 4 bytes of fp16 scale/bias + dim / 2 bytes of codes
    assert state["embedding_bags.t_wide.weight"].shape == (20, 4 + 36 // 2)
    assert state["embedding_bags.t_wide.weight"].dtype == torch.uint8
    configs = [dataclasses.replace(c, data_type=DataType.INT4) for c in mixed_tables]
    empty = QuantEmbeddingBagCollection(configs)
    kjt = make_kjt(mixed_tables, 5, seed=4)
    assert not torch.equal(empty(kjt).values(), quant(kjt).values())
    empty.load_state_dict(state)
    assert torch.equal(empty(kjt).values(), quant(kjt).values())
    given = QuantEmbeddingBagCollection(configs, table_name_to_quantized_weights=quant.quantized_weights())
    assert torch.equal(given(kjt).values(), quant(kjt).values())


def test_per_table_dtypes_from_configs(mixed_tables) -> None:
    quant = QuantEmbeddingBagCollection.from_float(
        float_ebc(mixed_tables),
        {"t_shared": DataType.INT8, "t_mean": DataType.INT4, "t_wide": DataType.FP16, "t_small": DataType.INT2},
    )
    assert [c.data_type for c in quant.embedding_bag_configs()] == [
        DataType.INT8, DataType.INT4, DataType.FP16, DataType.INT2
    ]
    sizes = quant.table_bytes()  # rows * row bytes, rounded up to 128-byte table alignment
    assert sizes == {"t_shared": 1280, "t_mean": 384, "t_wide": 1536, "t_small": 128}


# ---- error bounds ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", INT_TYPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_error_within_derived_bound(
    mixed_tables, make_kjt: MakeKJT, dtype: DataType, weighted: bool, backend: KernelBackend
) -> None:
    ebc = float_ebc(mixed_tables, weighted, seed=5)
    quant = QuantEmbeddingBagCollection.from_float(ebc, dtype, backend=backend)
    weight_type = quant.tbe.specs[0].weight_type
    per_row = {
        c.name: row_error_bound(ebc.embedding_bags[c.name].weight, quant.quantized_weights()[c.name], weight_type)
        for c in mixed_tables
    }
    kjt = make_kjt(mixed_tables, 16, seed=6, weighted=weighted, max_len=8)
    error = (quant(kjt).values() - ebc(kjt).values()).abs()
    bound = pooled_bound(ebc, per_row, kjt)
    assert bool((error <= bound + 1e-6).all()), (error - bound).max()
    # The brief's looser form: pooling factor * max over rows of (scale / 2 + fp16 rounding).
    lengths = torch.stack([kjt[f].lengths() for f in kjt.keys()], dim=1).float()
    worst = max(float(b.max()) for b in per_row.values())
    max_weight = float(kjt.weights().abs().max()) if weighted else 1.0
    assert bool(error.max() <= lengths.max() * max_weight * worst + 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_within_relative_rounding(mixed_tables, make_kjt: MakeKJT, backend: KernelBackend) -> None:
    ebc = float_ebc(mixed_tables, weighted=True, seed=7)
    quant = QuantEmbeddingBagCollection.from_float(ebc, DataType.FP16, backend=backend)
    # per element: |x - fp16(x)| <= 2^-11 |x| (normal range) or 2^-25 (subnormal)
    per_element = {
        c.name: ebc.embedding_bags[c.name].weight.detach().abs() * 2.0**-11 + 2.0**-25
        for c in mixed_tables
    }
    kjt = make_kjt(mixed_tables, 16, seed=8, weighted=True, max_len=8)
    error = (quant(kjt).values() - ebc(kjt).values()).abs()
    bound = pooled_bound(ebc, per_element, kjt)
    assert bool((error <= bound * (1 + 1e-3) + 1e-7).all()), (error - bound).max()


@pytest.mark.parametrize("dtype, max_relative", [(DataType.INT8, 0.01), (DataType.INT4, 0.15), (DataType.FP16, 1e-3)])
def test_realistic_pooled_relative_error(dtype: DataType, max_relative: float) -> None:
    """Trained-looking tables (normal(0, 0.02) with a few large outliers), Zipf-ish ids, 20 ids
    per bag: the whole-batch relative error of the pooled outputs."""
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=5000, embedding_dim=64, feature_names=[f"f{i}"])
        for i in range(3)
    ]
    gen = torch.Generator().manual_seed(9)
    ebc = EmbeddingBagCollection(tables)
    with torch.no_grad():
        for config in tables:
            weight = ebc.embedding_bags[config.name].weight
            weight.copy_(torch.randn(weight.shape, generator=gen) * 0.02)
            weight[torch.randint(0, 5000, (50,), generator=gen)] *= 10.0
    batch, per_bag = 256, 20
    ranks = torch.rand(3 * batch * per_bag, generator=gen)
    ids = (5000 * ranks**3).long().clamp(max=4999)  # skewed towards low ids
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=ids,
                            lengths=torch.full((3 * batch,), per_bag))
    ref = ebc(kjt).values().detach()
    out = QuantEmbeddingBagCollection.from_float(ebc, dtype)(kjt).values()
    relative = float((out - ref).norm() / ref.norm())
    assert relative < max_relative


# ---- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [DataType.BF16, DataType.UINT8])
def test_unsupported_dtype(mixed_tables, dtype: DataType) -> None:
    with pytest.raises(ValueError, match=rf"table 't_shared': data_type {dtype.value} cannot be served quantized; use one of FP32, FP16, INT8, INT4, INT2"):
        QuantEmbeddingBagCollection.from_float(float_ebc(mixed_tables), dtype)


def test_int4_odd_dim_is_refused() -> None:
    tables = [EmbeddingBagConfig(name="odd", num_embeddings=10, embedding_dim=7)]
    with pytest.raises(ValueError, match=r"table 'odd': INT4 packs 2 values per byte.*got 7"):
        QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(tables), DataType.INT4)
    # odd dims are fine for INT8 and FP16 on FBGEMM's CPU kernel
    for dtype in (DataType.INT8, DataType.FP16):
        QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(tables), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad_id", [-1, 7, 60])
def test_out_of_range_id_names_the_feature(mixed_tables, backend: KernelBackend, bad_id: int) -> None:
    quant = QuantEmbeddingBagCollection.from_float(float_ebc(mixed_tables), DataType.INT8, backend=backend)
    keys = ["f_a", "f_b", "f_mean", "f_wide", "f_small"]
    values = torch.tensor([1, 2, 3, 4, bad_id])  # f_small: table t_small has 7 rows
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=torch.ones(5, dtype=torch.int64))
    with pytest.raises(IdOutOfRangeError, match=rf"feature 'f_small': id {bad_id} .*outside \[0, 7\)"):
        quant(kjt)


def test_missing_feature_and_weights(mixed_tables, make_kjt: MakeKJT) -> None:
    quant = QuantEmbeddingBagCollection.from_float(float_ebc(mixed_tables, weighted=True), DataType.INT8)
    kjt = make_kjt(mixed_tables, 2, seed=10, keys=["f_a", "f_b", "f_mean", "f_wide"], weighted=True)
    with pytest.raises(ValueError, match=r"lacks feature\(s\) \['f_small'\]"):
        quant(kjt)
    with pytest.raises(ValueError, match="is weighted.*has no weights"):
        quant(make_kjt(mixed_tables, 2, seed=10))


def test_cannot_be_moved(mixed_tables) -> None:
    quant = QuantEmbeddingBagCollection.from_float(float_ebc(mixed_tables), DataType.INT8)
    quant.to("cpu")  # a no-op move is fine
    with pytest.raises(ValueError, match="cannot be moved.*shard_quant_model"):
        quant.to("meta")


def test_meta_collection_is_refused(mixed_tables) -> None:
    with pytest.raises(ValueError, match="meta device"):
        QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(mixed_tables, device="meta"))


def test_serving_modes_and_copies(mixed_tables, make_kjt: MakeKJT) -> None:
    """inference_mode, deepcopy and torch.save keep the per-table views tied to the kernel buffer."""
    quant = QuantEmbeddingBagCollection.from_float(float_ebc(mixed_tables), DataType.INT8)
    kjt = make_kjt(mixed_tables, 4, seed=11)
    expected = quant(kjt).values()
    with torch.inference_mode():
        assert torch.equal(quant(kjt).values(), expected)
    buffer = io.BytesIO()
    torch.save(quant, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(quant), torch.load(buffer, weights_only=False)):
        assert torch.equal(clone(kjt).values(), expected)
        clone.load_state_dict({k: torch.zeros_like(v) for k, v in clone.state_dict().items()})
        assert not clone(kjt).values().any()  # the views write through to the kernel's buffer
    assert torch.equal(quant(kjt).values(), expected)
