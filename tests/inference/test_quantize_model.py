"""quantize_inference_model: collections swapped anywhere in a model, dense layers untouched."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from recsys_core import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbOptimType,
    FusedEmbeddingBagCollection,
    KeyedJaggedTensor,
)
from recsys_core.inference import QuantEmbeddingBagCollection, quantize_inference_model

MakeKJT = Callable[..., KeyedJaggedTensor]


class TinyRanker(nn.Module):
    """Dense MLP + a collection nested one level down (like DLRM's sparse_arch)."""

    def __init__(self, tables: list[EmbeddingBagConfig], fused: bool = False) -> None:
        super().__init__()
        ebc = (FusedEmbeddingBagCollection(tables, EmbOptimType.EXACT_SGD, {"learning_rate": 0.1})
               if fused else EmbeddingBagCollection(tables))
        self.sparse = nn.ModuleDict({"ebc": ebc})
        self.dense = nn.Sequential(nn.Linear(3, 8), nn.ReLU())
        self.over = nn.Linear(8 + sum(c.embedding_dim * c.num_features for c in tables), 1)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse["ebc"](kjt).values()
        return self.over(torch.cat([self.dense(dense), pooled], dim=1))


@pytest.mark.parametrize("fused", [False, True])
def test_collections_swapped_in_place(mixed_tables, make_kjt: MakeKJT, fused: bool) -> None:
    torch.manual_seed(0)
    model = TinyRanker(mixed_tables, fused)
    float_model = copy.deepcopy(model) if not fused else None
    dense_before = {k: v.clone() for k, v in model.dense.state_dict().items()}
    kjt, dense = make_kjt(mixed_tables, 8, seed=1), torch.randn(8, 3)
    expected = model(dense, kjt)

    returned = quantize_inference_model(model, DataType.INT8)
    assert returned is model
    assert isinstance(model.sparse["ebc"], QuantEmbeddingBagCollection)
    assert isinstance(model.dense[0], nn.Linear) and isinstance(model.over, nn.Linear)
    for key, value in model.dense.state_dict().items():
        assert torch.equal(value, dense_before[key])
    torch.testing.assert_close(model(dense, kjt), expected, rtol=0.0, atol=2e-3)
    if float_model is not None:  # the float model we copied is unaffected
        assert isinstance(float_model.sparse["ebc"], EmbeddingBagCollection)


def test_root_collection_and_torch_dtype_aliases(mixed_tables, make_kjt: MakeKJT) -> None:
    ebc = EmbeddingBagCollection(mixed_tables)
    quant = quantize_inference_model(
        ebc, torch.quint4x2, table_dtypes={"t_wide": torch.float16, "t_small": torch.qint8}
    )
    assert isinstance(quant, QuantEmbeddingBagCollection)
    assert {c.name: c.data_type for c in quant.embedding_bag_configs()} == {
        "t_shared": DataType.INT4, "t_mean": DataType.INT4, "t_wide": DataType.FP16,
        "t_small": DataType.INT8,
    }
    kjt = make_kjt(mixed_tables, 4, seed=2)
    assert quant(kjt).keys() == ebc(kjt).keys()


def test_bad_arguments(mixed_tables) -> None:
    model = TinyRanker(mixed_tables)
    with pytest.raises(ValueError, match=r"table_dtypes names \['nope'\], which no collection"):
        quantize_inference_model(model, DataType.INT8, table_dtypes={"nope": DataType.INT4})
    with pytest.raises(ValueError, match="unsupported quantization dtype torch.bfloat16"):
        quantize_inference_model(model, torch.bfloat16)
    with pytest.raises(ValueError, match="unsupported quantization dtype 'int8'"):
        quantize_inference_model(model, "int8")  # type: ignore[arg-type]
    assert isinstance(model.sparse["ebc"], EmbeddingBagCollection)  # nothing half-done


def test_dynamic_int8_linear_option(mixed_tables, make_kjt: MakeKJT) -> None:
    torch.manual_seed(3)
    model = TinyRanker(mixed_tables)
    kjt, dense = make_kjt(mixed_tables, 8, seed=4), torch.randn(8, 3)
    expected = model(dense, kjt)
    quantize_inference_model(model, DataType.INT8, quantize_dense=True)
    assert isinstance(model.over, torch.ao.nn.quantized.dynamic.Linear)
    assert isinstance(model.dense[0], torch.ao.nn.quantized.dynamic.Linear)
    assert isinstance(model.sparse["ebc"], QuantEmbeddingBagCollection)
    torch.testing.assert_close(model(dense, kjt), expected, rtol=0.0, atol=0.02)
