"""Position-weighted processors, the feature-processed EBC, KTRegroupAsDict and embedding
towers, against hand-computed values."""

import pytest
import torch
from torch import nn

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor
from recsys_core.fx import symbolic_trace
from recsys_core.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection
from recsys_core.modules.feature_processor import (
    PositionWeightedProcessor,
    offsets_to_range_traceble,
)
from recsys_core.modules.feature_processor_ import (
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)
from recsys_core.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from recsys_core.modules.regroup import KTRegroupAsDict


def _kjt() -> KeyedJaggedTensor:
    # f1: [[0, 1], [2]]   f2: [[3], [4, 5, 6]]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f1", "f2"],
        values=torch.tensor([0, 1, 2, 3, 4, 5, 6]),
        lengths=torch.tensor([2, 1, 1, 3]),
    )


def test_positions_inside_bags() -> None:
    offsets = torch.tensor([0, 2, 2, 5])
    assert offsets_to_range_traceble(offsets, torch.zeros(5)).tolist() == [0, 1, 0, 1, 2]


def test_position_weighted_collection_weights_by_position() -> None:
    pw = PositionWeightedModuleCollection({"f2": 3})
    with torch.no_grad():
        pw.position_weights["f2"].copy_(torch.tensor([10.0, 20.0, 30.0]))
    out = pw(_kjt())
    assert out.keys() == ["f1", "f2"]
    # f1 has no processor: weight 1; f2 positions [0 | 0, 1, 2]
    assert out.weights().tolist() == [1.0, 1.0, 1.0, 10.0, 10.0, 20.0, 30.0]
    scripted = torch.jit.script(symbolic_trace(pw))
    assert scripted(_kjt()).weights().tolist() == out.weights().tolist()
    with pytest.raises(ValueError, match="max_feature_lengths"):
        PositionWeightedModuleCollection({"f2": 0})


def test_position_weighted_processor_keeps_only_its_features() -> None:
    pw = PositionWeightedProcessor({"f2": 3})
    with torch.no_grad():
        pw.position_weights["f2"].copy_(torch.tensor([1.0, 2.0, 3.0]))
    out = pw(_kjt())
    assert out.keys() == ["f2"]
    assert out.values().tolist() == [3, 4, 5, 6]
    assert out.weights().tolist() == [1.0, 1.0, 2.0, 3.0]
    assert list(pw.state_dict()) == ["position_weights.f2"]


def test_feature_processed_ebc_equals_weighted_lookup_by_hand() -> None:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name="t1", embedding_dim=2, num_embeddings=8, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=8, feature_names=["f2"]),
    ]
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=True)
    processors = {"f1": PositionWeightedModule(2), "f2": PositionWeightedModule(3)}
    with torch.no_grad():
        processors["f2"].position_weight.copy_(torch.tensor([1.0, 0.5, 0.25]))
    fp_ebc = FeatureProcessedEmbeddingBagCollection(ebc, processors)
    out = fp_ebc(_kjt()).to_dict()
    w1, w2 = ebc.embedding_bags["t1"].weight, ebc.embedding_bags["t2"].weight
    torch.testing.assert_close(out["f1"], torch.stack([w1[0] + w1[1], w1[2]]))
    torch.testing.assert_close(out["f2"], torch.stack([w2[3], w2[4] + 0.5 * w2[5] + 0.25 * w2[6]]))
    with pytest.raises(ValueError, match="weighted"):
        FeatureProcessedEmbeddingBagCollection(
            EmbeddingBagCollection(tables=tables), processors
        )
    with pytest.raises(ValueError, match="do not match"):
        FeatureProcessedEmbeddingBagCollection(ebc, {"f1": PositionWeightedModule(2)})


def test_kt_regroup_as_dict() -> None:
    a = KeyedTensor(keys=["a", "b"], length_per_key=[1, 2], values=torch.tensor([[1.0, 2, 3]]))
    c = KeyedTensor(keys=["c"], length_per_key=[1], values=torch.tensor([[4.0]]))
    regroup = KTRegroupAsDict(groups=[["c", "a"], ["b"]], keys=["user", "item"])
    out = regroup([a, c])
    assert out["user"].tolist() == [[4.0, 1.0]] and out["item"].tolist() == [[2.0, 3.0]]
    scripted = torch.jit.script(symbolic_trace(regroup))
    assert scripted([a, c])["user"].tolist() == [[4.0, 1.0]]
    with pytest.raises(ValueError, match="same length"):
        KTRegroupAsDict(groups=[["a"]], keys=["x", "y"])
    with pytest.raises(ValueError, match="no input has"):
        KTRegroupAsDict(groups=[["zzz"]], keys=["x"])([a])


def test_embedding_tower_collection_routes_inputs_and_concatenates() -> None:
    tables = [EmbeddingBagConfig(name="t1", embedding_dim=2, num_embeddings=8, feature_names=["f1"])]
    weighted = [EmbeddingBagConfig(name="w", embedding_dim=3, num_embeddings=8, feature_names=["f2"])]

    class Values(nn.Module):
        def forward(self, kt: KeyedTensor) -> torch.Tensor:
            return kt.values()

    towers = EmbeddingTowerCollection(
        [
            EmbeddingTower(EmbeddingBagCollection(tables=tables), Values()),
            EmbeddingTower(EmbeddingBagCollection(tables=weighted, is_weighted=True), Values()),
        ]
    )
    kjt = _kjt()
    f1 = KeyedJaggedTensor.from_lengths_sync(["f1"], kjt["f1"].values(), kjt["f1"].lengths())
    f2 = KeyedJaggedTensor.from_lengths_sync(
        ["f2"], kjt["f2"].values(), kjt["f2"].lengths(), weights=torch.ones(4)
    )
    out = towers(features=f1, weighted_features=f2)
    assert out.shape == (2, 5)
    with pytest.raises(ValueError, match="weighted_features"):
        towers(features=f1)
