"""Collections built on meta skip ``nn.EmbeddingBag`` / ``nn.Embedding``'s ``normal_`` (whose
meta decomposition cost 0.45 s on its first call in a process), and nothing else changes: the
weights are meta tensors of the table's shape and dtype that train; on CPU the modules' own
initialization still runs (the random stream a seeded program sees is unchanged)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recsys_core import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)


def _tables(kind: type) -> list:
    return [kind(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f"]),
            kind(name="b", embedding_dim=4, num_embeddings=7, feature_names=["g"],
                 data_type=DataType.FP16)]


def _build(collection: type, config: type, device: str | None, context: str | None):
    if context is not None:
        with torch.device(context):
            return collection(tables=_tables(config))
    return collection(tables=_tables(config), device=device)


@pytest.mark.parametrize("collection, config", [(EmbeddingBagCollection, EmbeddingBagConfig),
                                                (EmbeddingCollection, EmbeddingConfig)])
@pytest.mark.parametrize("device, context", [("meta", None), (None, "meta")])
def test_meta_tables_skip_the_modules_normal_init(
    collection: type, config: type, device: str | None, context: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[torch.Size] = []
    real = nn.init.normal_
    monkeypatch.setattr(nn.init, "normal_", lambda t, *a, **k: calls.append(t.shape) or real(t, *a, **k))
    module = _build(collection, config, device, context)
    assert calls == []
    weights = dict(module.named_parameters())
    a = next(w for n, w in weights.items() if n.endswith(".a.weight"))
    b = next(w for n, w in weights.items() if n.endswith(".b.weight"))
    assert a.is_meta and a.shape == (10, 4) and a.dtype == torch.float32 and a.requires_grad
    assert b.is_meta and b.shape == (7, 4) and b.dtype == torch.float16


@pytest.mark.parametrize("collection, config", [(EmbeddingBagCollection, EmbeddingBagConfig),
                                                (EmbeddingCollection, EmbeddingConfig)])
def test_cpu_tables_keep_their_initialization_and_random_stream(
    collection: type, config: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[torch.Size] = []
    real = nn.init.normal_
    monkeypatch.setattr(nn.init, "normal_", lambda t, *a, **k: calls.append(t.shape) or real(t, *a, **k))
    torch.manual_seed(0)
    module = collection(tables=_tables(config), device="cpu")
    assert calls == [torch.Size([10, 4]), torch.Size([7, 4])]
    torch.manual_seed(0)
    again = collection(tables=_tables(config), device="cpu")
    for (name, w), (_, v) in zip(module.state_dict().items(), again.state_dict().items(),
                                 strict=True):
        assert not w.is_meta and torch.equal(w, v), name
