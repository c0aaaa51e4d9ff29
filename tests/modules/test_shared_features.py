"""A feature listed by several tables (TorchRec's ``f@t`` names), on every collection."""

from __future__ import annotations

import pytest
import torch

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    IdOutOfRangeError,
    KeyedJaggedTensor,
    PoolingType,
)
from recsys_core.modules.embedding_modules import get_embedding_names_by_table
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingCollection

# t1 holds f1 and f2; t2 holds f1 (shared) and f3; t3 holds f3 (shared).
BAG_TABLES = [
    EmbeddingBagConfig(name="t1", embedding_dim=2, num_embeddings=5, feature_names=["f1", "f2"]),
    EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=4, feature_names=["f1", "f3"],
                       pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t3", embedding_dim=1, num_embeddings=6, feature_names=["f3"]),
]
W1 = torch.arange(10.0).view(5, 2)
W2 = torch.arange(12.0).view(4, 3) * 10
W3 = torch.arange(6.0).view(6, 1) * 100


def kjt() -> KeyedJaggedTensor:
    # batch 2: f1 [[0, 3], [1]], f2 [[], [4]], f3 [[2], [0, 3]]
    return KeyedJaggedTensor(
        keys=["f1", "f2", "f3"],
        values=torch.tensor([0, 3, 1, 4, 2, 0, 3]),
        lengths=torch.tensor([2, 1, 0, 1, 1, 2]),
    )


def load(module: torch.nn.Module, prefix: str) -> None:
    module.load_state_dict({
        f"{prefix}.t1.weight": W1, f"{prefix}.t2.weight": W2, f"{prefix}.t3.weight": W3,
    })


def test_names_by_table() -> None:
    assert get_embedding_names_by_table(BAG_TABLES) == [["f1@t1", "f2"], ["f1@t2", "f3@t2"], ["f3@t3"]]


EXPECTED_KEYS = ["f1@t1", "f2", "f1@t2", "f3@t2", "f3@t3"]


def expected_pooled() -> torch.Tensor:
    rows = [
        [W1[0] + W1[3], torch.zeros(2), (W2[0] + W2[3]) / 2, W2[2], W3[2]],
        [W1[1], W1[4], W2[1], (W2[0] + W2[3]) / 2, W3[0] + W3[3]],
    ]
    return torch.stack([torch.cat(r) for r in rows])


@pytest.mark.parametrize("fused", [False, True])
def test_pooled_shared_feature_looked_up_in_each_table(fused: bool) -> None:
    ebc = (FusedEmbeddingBagCollection(BAG_TABLES, torch.optim.SGD, {"lr": 0.1}) if fused
           else EmbeddingBagCollection(BAG_TABLES))
    load(ebc, "embedding_bags")
    kt = ebc(kjt())
    assert kt.keys() == EXPECTED_KEYS
    assert kt.length_per_key() == [2, 2, 3, 3, 1]
    torch.testing.assert_close(kt.values(), expected_pooled())
    torch.testing.assert_close(kt["f1@t2"], torch.stack([(W2[0] + W2[3]) / 2, W2[1]]))


def test_fused_shared_feature_trains_each_table() -> None:
    fused = FusedEmbeddingBagCollection(BAG_TABLES, torch.optim.SGD, {"lr": 1.0})
    load(fused, "embedding_bags")
    fused(kjt())["f1@t2"].sum().backward()  # only t2's rows for f1 change: d(mean)/d(row) = 1/len
    after = dict(fused.state_dict())
    torch.testing.assert_close(after["embedding_bags.t1.weight"], W1)
    expected = W2.clone()
    expected[[0, 3]] -= 0.5
    expected[1] -= 1.0
    torch.testing.assert_close(after["embedding_bags.t2.weight"], expected)


EC_TABLES = [
    EmbeddingConfig(name="t1", embedding_dim=2, num_embeddings=5, feature_names=["f1", "f2"]),
    EmbeddingConfig(name="t2", embedding_dim=2, num_embeddings=4, feature_names=["f1"]),
]
V1 = torch.arange(10.0).view(5, 2)
V2 = -torch.arange(8.0).view(4, 2)


@pytest.mark.parametrize("fused", [False, True])
def test_sequence_shared_feature_dict_keys_and_rows(fused: bool) -> None:
    ec = (FusedEmbeddingCollection(EC_TABLES, torch.optim.SGD, {"lr": 0.1}, need_indices=True)
          if fused else EmbeddingCollection(EC_TABLES, need_indices=True))
    ec.load_state_dict({"embeddings.t1.weight": V1, "embeddings.t2.weight": V2})
    kjt2 = KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([0, 3, 1, 4]), lengths=torch.tensor([2, 1, 0, 1]))
    out = ec(kjt2)
    assert list(out) == ["f1@t1", "f2", "f1@t2"]
    assert ec.embedding_names_by_table() == [["f1@t1", "f2"], ["f1@t2"]]
    torch.testing.assert_close(out["f1@t1"].values(), V1[[0, 3, 1]])
    torch.testing.assert_close(out["f1@t2"].values(), V2[[0, 3, 1]])
    torch.testing.assert_close(out["f2"].values(), V1[[4]])
    assert out["f1@t2"].lengths().tolist() == [2, 1]
    assert out["f2"].lengths().tolist() == [0, 1]
    assert out["f1@t2"].weights().tolist() == [0, 3, 1]  # need_indices: the ids ride in weights


@pytest.mark.parametrize("cls", [EmbeddingCollection, FusedEmbeddingCollection])
def test_sequence_tables_need_one_dim(cls: type) -> None:
    tables = [EmbeddingConfig(name="a", embedding_dim=2, num_embeddings=3),
              EmbeddingConfig(name="b", embedding_dim=4, num_embeddings=3)]
    with pytest.raises(ValueError, match="table 'b' has 4, the first table has 2"):
        cls(tables)
    assert EmbeddingCollection(tables[:1]).embedding_dim() == 2


def test_shared_feature_bad_id_names_the_feature() -> None:
    ebc = EmbeddingBagCollection(BAG_TABLES)
    bad = KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.tensor([4, 0, 0]), lengths=torch.tensor([1, 0, 1, 0, 1, 0]))
    # f1's id 4 fits t1 (5 rows) but not t2 (4 rows)
    with pytest.raises(IdOutOfRangeError, match=r"feature 'f1': id 4 is outside \[0, 4\)"):
        ebc(bad)
