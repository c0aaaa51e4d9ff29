"""Meta device as TorchRec: no allocation, shaped meta outputs, materialize with to_empty."""

from __future__ import annotations

import pytest
import torch

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    KeyedJaggedTensor,
)

TABLES = [
    EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10**9, feature_names=["f1"]),
    EmbeddingBagConfig(name="t2", embedding_dim=5, num_embeddings=10, feature_names=["f1", "f2"]),
]


def meta_kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4], device="meta"),
        lengths=torch.tensor([1, 1, 1, 0, 1, 0], device="meta"),
    )


@pytest.mark.parametrize("how", ["context", "argument"])
def test_ebc_on_meta(how: str) -> None:
    if how == "context":
        with torch.device("meta"):
            ebc = EmbeddingBagCollection(TABLES)
    else:
        ebc = EmbeddingBagCollection(TABLES, device="meta")
    assert ebc.device == torch.device("meta")
    assert all(p.is_meta for p in ebc.parameters())
    kt = ebc(meta_kjt())
    assert kt.values().is_meta and kt.values().shape == (3, 13)
    assert kt.keys() == ["f1@t1", "f1@t2", "f2"]


def test_ec_on_meta_context() -> None:
    with torch.device("meta"):
        ec = EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10**9, feature_names=["f1", "f2"])])
    assert all(p.is_meta for p in ec.parameters())
    kjt = KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4], device="meta"),
                            lengths=torch.tensor([1, 1, 1, 0, 1, 0], device="meta"), length_per_key=[3, 1])
    out = ec(kjt)
    assert {k: tuple(v.values().shape) for k, v in out.items()} == {"f1": (3, 4), "f2": (1, 4)}
    assert all(v.values().is_meta for v in out.values())


def test_fused_ebc_on_meta() -> None:
    fused = FusedEmbeddingBagCollection(TABLES, torch.optim.SGD, {"lr": 0.1}, device=torch.device("meta"))
    assert all(p.is_meta for p in fused.parameters())
    out = fused(meta_kjt()).values()
    assert out.is_meta and out.shape == (3, 13)


def test_materialize_with_to_empty_and_reset_parameters() -> None:
    small = [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=4, init_fn=torch.nn.init.ones_),
             EmbeddingBagConfig(name="u", embedding_dim=2, num_embeddings=100, feature_names=["g"])]
    ebc = EmbeddingBagCollection(small, device="meta")
    ebc.to_empty(device="cpu")
    ebc.reset_parameters()
    assert torch.equal(ebc.embedding_bags["t"].weight, torch.ones(4, 2))
    assert float(ebc.embedding_bags["u"].weight.abs().max()) <= 0.1  # uniform(-sqrt(1/100), +)
    kjt = KeyedJaggedTensor(keys=["t", "g"], values=torch.tensor([0, 3, 7]), lengths=torch.tensor([2, 1]))
    kt = ebc(kjt)
    torch.testing.assert_close(kt["t"], torch.full((1, 2), 2.0))
    torch.testing.assert_close(kt["g"], ebc.embedding_bags["u"].weight[7:8])


def test_fused_ec_on_meta() -> None:
    from recsys_core.modules.fused_embedding_modules import FusedEmbeddingCollection

    tables = [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10**9, feature_names=["f1", "f2"])]
    fused = FusedEmbeddingCollection(tables, torch.optim.SGD, {"lr": 0.1}, device="meta")
    assert all(p.is_meta for p in fused.parameters())
    kjt = KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4], device="meta"),
                            lengths=torch.tensor([1, 1, 1, 0, 1, 0], device="meta"), length_per_key=[3, 1])
    out = fused(kjt)
    assert {k: tuple(v.values().shape) for k, v in out.items()} == {"f1": (3, 4), "f2": (1, 4)}
