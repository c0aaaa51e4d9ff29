"""``inference.modules.quantize_embeddings`` (TorchRec's helper, used by its DLRM predict
example): every EmbeddingBagCollection becomes a quantized one; each pooled value is within the
row-wise quantization step of the float module's (half a step per id: int8 255 steps, int4 15
steps between the row's min and max)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recsys_core.inference.modules import quantize_embeddings
from recsys_core.quant.embedding_modules import EmbeddingBagCollection as QuantEBC


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(EmbeddingBagCollection([
        EmbeddingBagConfig(name="t8", feature_names=["a"], num_embeddings=10, embedding_dim=8),
        EmbeddingBagConfig(name="t4", feature_names=["b"], num_embeddings=10, embedding_dim=8),
    ]))


def _bound(weight: torch.Tensor, ids: list[list[int]], levels: int) -> torch.Tensor:
    step = (weight.max(1).values - weight.min(1).values) / levels
    return torch.stack([step[bag].sum() / 2 for bag in map(torch.tensor, ids)])


def test_quantized_bags_are_within_the_rows_quantization_step() -> None:
    model = _model()
    original = copy.deepcopy(model)
    quantized = quantize_embeddings(model, torch.qint8, inplace=False,
                                    per_table_weight_dtype={"t4": torch.quint4x2})
    assert isinstance(quantized[0], QuantEBC)
    assert type(model[0]) is EmbeddingBagCollection  # not in place
    bags = {"a": [[1, 2], [3]], "b": [[4], [5, 6, 7]]}
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.tensor([1, 2, 3, 4, 5, 6, 7]),
        lengths=torch.tensor([2, 1, 1, 3]))
    want = original[0](kjt).to_dict()
    got = quantized[0](kjt).to_dict()
    for key, table, levels in (("a", "t8", 255), ("b", "t4", 15)):
        weight = original[0].embedding_bags[table].weight.detach()
        error = (got[key] - want[key]).abs().amax(1)
        assert (error <= _bound(weight, bags[key], levels) + 1e-6).all(), key
        assert error.max() > 0  # really quantized
    in_place = quantize_embeddings(model, torch.qint8, inplace=True)
    assert in_place is model and isinstance(model[0], QuantEBC)
