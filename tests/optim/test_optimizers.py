"""in_backward_optimizer_filter, apply_optimizer_in_backward's import paths and TorchRec's
placeholder optimizer classes (torchrec.optim.optimizers)."""

from __future__ import annotations

import copy

import pytest
import torch

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedEmbeddingBagCollection,
    KeyedJaggedTensor,
)
from recsys_core.optim import SGD, Adam, in_backward_optimizer_filter
from recsys_core.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from recsys_core.optim.optimizers import (
    LAMB,
    Adagrad,
    LarsSGD,
    PartialRowWiseAdam,
    PartialRowWiseLAMB,
)

TABLES = [
    EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=2, feature_names=["f1"]),
    EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=2, feature_names=["f2"]),
]
KJT = KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([1, 0, 1]), lengths=torch.tensor([1, 1, 1, 0]))


def test_in_backward_optimizer_filter() -> None:
    ebc = EmbeddingBagCollection(tables=TABLES)
    apply_optimizer_in_backward(torch.optim.SGD, ebc.embedding_bags["t1"].parameters(), {"lr": 1.0})
    included = dict(in_backward_optimizer_filter(ebc.named_parameters(), include=True))
    excluded = dict(in_backward_optimizer_filter(ebc.named_parameters(), include=False))
    assert set(included) == {"embedding_bags.t1.weight"}
    assert set(excluded) == {"embedding_bags.t2.weight"}


def test_placeholder_names_the_fused_optimizer() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=TABLES)
    reference = copy.deepcopy(ebc)
    apply_optimizer_in_backward(SGD, ebc.parameters(), {"lr": 0.5})
    fused = FusedEmbeddingBagCollection.from_embedding_bag_collection(ebc)
    fused(KJT).values().sum().backward()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    reference(KJT).values().sum().backward()
    ref_opt.step()
    for name, weight in fused.state_dict().items():
        torch.testing.assert_close(weight, reference.state_dict()[name], rtol=0, atol=0)


def test_unconverted_placeholder_refuses_to_step() -> None:
    ebc = EmbeddingBagCollection(tables=TABLES)
    apply_optimizer_in_backward(Adam, ebc.parameters(), {"lr": 0.1})
    with pytest.raises(NotImplementedError, match="placeholder that names a fused embedding"):
        ebc(KJT).values().sum().backward()


@pytest.mark.parametrize("cls", [SGD, Adam, Adagrad, LAMB, LarsSGD, PartialRowWiseAdam, PartialRowWiseLAMB])
def test_placeholders_keep_their_kwargs(cls: type) -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = cls([p], lr=0.1, max_gradient=1.0)
    assert opt._kwargs == {"lr": 0.1, "max_gradient": 1.0}
    with pytest.raises(NotImplementedError):
        opt.step()
