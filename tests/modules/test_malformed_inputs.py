"""Malformed KJTs (validated lazily) raise a clear error naming the key in every collection."""

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
)
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingCollection

BAGS = [EmbeddingBagConfig(name="t1", embedding_dim=2, num_embeddings=5, feature_names=["a"]),
        EmbeddingBagConfig(name="t2", embedding_dim=2, num_embeddings=6, feature_names=["b"])]
SEQ = [EmbeddingConfig(name="t1", embedding_dim=2, num_embeddings=5, feature_names=["a"]),
       EmbeddingConfig(name="t2", embedding_dim=2, num_embeddings=6, feature_names=["b"])]


def build(kind: str, weighted: bool) -> torch.nn.Module:
    if kind == "ebc":
        return EmbeddingBagCollection(BAGS, is_weighted=weighted)
    if kind == "fused_ebc":
        return FusedEmbeddingBagCollection(BAGS, torch.optim.SGD, {"lr": 0.1}, is_weighted=weighted)
    if kind == "ec":
        return EmbeddingCollection(SEQ)
    return FusedEmbeddingCollection(SEQ, torch.optim.SGD, {"lr": 0.1})


KINDS = ["ebc", "fused_ebc", "ec", "fused_ec"]
VALUES = torch.tensor([1, 2, 3, 4])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lengths": torch.tensor([3, -1, 1, 1])}, "negative length -1 for key 'a' at batch position 1"),
        ({"offsets": torch.tensor([0, 3, 1, 3, 4])}, "negative length -2 for key 'a' at batch position 1"),
        # the sparse validator's whole-KJT check names no key; to_dict's per-key one does
        ({"lengths": torch.tensor([1, 1, 1, 2])},
         "key 'b' needs values|last element of offsets must equal to the number of values, but got 5 and 4"),
    ],
    ids=["negative_length", "decreasing_offsets", "lengths_past_values"],
)
def test_bad_layout_names_the_key(kind: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(kind, False)(KeyedJaggedTensor(keys=["a", "b"], values=VALUES, **kwargs))


@pytest.mark.parametrize("kind", KINDS)
def test_id_out_of_range_names_the_feature(kind: str) -> None:
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3, 40]), lengths=torch.tensor([1, 1, 1, 1]))
    with pytest.raises(IdOutOfRangeError, match=r"feature 'b': id 40 .*outside \[0, 6\)"):
        build(kind, False)(kjt)


@pytest.mark.parametrize("kind", ["ebc", "fused_ebc"])
def test_weights_not_matching_values(kind: str) -> None:
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=VALUES, lengths=torch.tensor([1, 1, 1, 1]),
                            weights=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="weights has 2 entries and values has 4"):
        build(kind, True)(kjt)
