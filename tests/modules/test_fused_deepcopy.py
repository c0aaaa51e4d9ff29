"""``copy.deepcopy`` of a fused collection is an independent module whose parameters stay the
copied kernels' tables: after a fused update of the copy, its ``state_dict`` equals what its
forward reads, and the original is untouched."""

from __future__ import annotations

import copy

import pytest
import torch

from recsys_core import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    EmbOptimType,
    FusedEmbeddingBagCollection,
    KeyedJaggedTensor,
)
from recsys_core.kernels import fbgemm_available
from recsys_core.kernels.config import KernelBackend
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingCollection

ROWS = 5
ALL_IDS = KeyedJaggedTensor(keys=["f"], values=torch.arange(ROWS), lengths=torch.ones(ROWS, dtype=torch.long))
ONE_ID = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1]), lengths=torch.tensor([1]))


def _rows_bag(module: FusedEmbeddingBagCollection) -> torch.Tensor:
    return module(ALL_IDS).values().detach()


def _rows_seq(module: FusedEmbeddingCollection) -> torch.Tensor:
    return module(ALL_IDS)["f"].values().detach()


@pytest.mark.parametrize("backend", [
    pytest.param(KernelBackend.FBGEMM, marks=pytest.mark.skipif(
        not fbgemm_available(), reason="fbgemm_gpu is not importable")),
    KernelBackend.TORCH,
])
@pytest.mark.parametrize("kind", ["bag", "sequence"])
def test_deepcopy_keeps_parameters_on_the_copied_kernels(kind: str, backend: KernelBackend) -> None:
    torch.manual_seed(0)
    if kind == "bag":
        tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=ROWS, feature_names=["f"])]
        module = FusedEmbeddingBagCollection(tables, EmbOptimType.EXACT_SGD, {"learning_rate": 0.5},
                                             backend=backend)
        rows, key, out = _rows_bag, "embedding_bags.t.weight", lambda m: m(ONE_ID).values()
    else:
        tables = [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=ROWS, feature_names=["f"])]
        module = FusedEmbeddingCollection(tables, EmbOptimType.EXACT_SGD, {"learning_rate": 0.5},
                                          backend=backend)
        rows, key, out = _rows_seq, "embeddings.t.weight", lambda m: m(ONE_ID)["f"].values()
    original = rows(module).clone()
    clone = copy.deepcopy(module)
    out(clone).sum().backward()  # SGD: row 1 of the copy moves by -0.5 in every column
    expected = original.clone()
    expected[1] -= 0.5
    torch.testing.assert_close(rows(clone), expected)
    torch.testing.assert_close(clone.state_dict()[key], expected)
    torch.testing.assert_close(rows(module), original)
    torch.testing.assert_close(module.state_dict()[key], original)
