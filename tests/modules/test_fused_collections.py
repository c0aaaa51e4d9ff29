"""FusedEmbeddingCollection == EmbeddingCollection + torch optimizer; fuse_embedding_optimizer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    IdOutOfRangeError,
    KernelBackend,
    KeyedJaggedTensor,
)
from recsys_core.modules.fused_embedding_modules import (
    FusedEmbeddingCollection,
    fuse_embedding_optimizer,
)
from recsys_core.optim import CombinedOptimizer

EC_TABLES = [
    EmbeddingConfig(name="a", embedding_dim=3, num_embeddings=7, feature_names=["x", "y"]),
    EmbeddingConfig(name="b", embedding_dim=3, num_embeddings=5, feature_names=["z"]),
]


def seq_kjt(gen: torch.Generator) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (6,), generator=gen)
    rows = [7, 7, 5]
    values = torch.cat([
        torch.randint(0, rows[k], (int(lengths[2 * k : 2 * k + 2].sum()),), generator=gen) for k in range(3)
    ])
    return KeyedJaggedTensor(keys=["x", "y", "z"], values=values, lengths=lengths)


@pytest.mark.parametrize("backend", [KernelBackend.AUTO, KernelBackend.TORCH])
@pytest.mark.parametrize(
    "fused_type, fused_kwargs, ref_class, ref_kwargs",
    [(torch.optim.SGD, {"lr": 0.5}, torch.optim.SGD, {"lr": 0.5}),
     (torch.optim.Adagrad, {"lr": 0.5, "eps": 1e-3}, torch.optim.Adagrad, {"lr": 0.5, "eps": 1e-3})],
)
def test_fused_ec_equals_ec_with_torch_optimizer(backend, fused_type, fused_kwargs, ref_class, ref_kwargs) -> None:
    ec = EmbeddingCollection(EC_TABLES)
    fused = FusedEmbeddingCollection(EC_TABLES, fused_type, fused_kwargs, backend=backend)
    fused.load_state_dict(ec.state_dict())
    opt = ref_class(ec.parameters(), **ref_kwargs)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        batch = seq_kjt(gen)
        ref, out = ec(batch), fused(batch)
        assert list(out) == ["x", "y", "z"]
        for name in ref:
            torch.testing.assert_close(out[name].values(), ref[name].values())
            assert torch.equal(out[name].lengths(), ref[name].lengths())
        loss = sum((ref[n].values() * torch.arange(3.0)).sum() for n in ref)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sum((out[n].values() * torch.arange(3.0)).sum() for n in out).backward()
    for key, value in ec.state_dict().items():
        torch.testing.assert_close(fused.state_dict()[key], value)


def test_fused_ec_api_and_errors() -> None:
    fused = FusedEmbeddingCollection(EC_TABLES, torch.optim.SGD, {"lr": 0.1})
    assert fused.embedding_dim() == 3 and fused.optimizer_type() is torch.optim.SGD
    assert fused.optimizer_kwargs() == {"lr": 0.1}
    assert isinstance(fused.fused_optimizer(), CombinedOptimizer)
    assert sorted(fused.fused_optimizer().params) == ["embeddings.a.weight", "embeddings.b.weight"]
    bad = KeyedJaggedTensor(keys=["x", "y", "z"], values=torch.tensor([1, 2, 5]), lengths=torch.tensor([1, 0, 1, 0, 1, 0]))
    with pytest.raises(IdOutOfRangeError, match="feature 'z': id 5"):
        fused(bad)


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Sequential(EmbeddingBagCollection(
            [EmbeddingBagConfig(name="u", embedding_dim=2, num_embeddings=4, feature_names=["uid"])],
            is_weighted=True,
        ))
        self.item = EmbeddingCollection(
            [EmbeddingConfig(name="i", embedding_dim=2, num_embeddings=3, feature_names=["iid"])],
            need_indices=True,
        )
        self.dense = nn.Linear(2, 1)


def test_fuse_embedding_optimizer_replaces_collections_keeping_weights() -> None:
    model = TwoTower()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = fuse_embedding_optimizer(model, torch.optim.SGD, {"lr": 1.0}, device=torch.device("cpu"))
    assert out is model
    assert isinstance(model.user[0], FusedEmbeddingBagCollection) and model.user[0].is_weighted()
    assert isinstance(model.item, FusedEmbeddingCollection) and model.item.need_indices()
    assert isinstance(model.dense, nn.Linear)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])
    kjt = KeyedJaggedTensor(keys=["iid"], values=torch.tensor([2, 2]), lengths=torch.tensor([1, 1]))
    model.item(kjt)["iid"].values().sum().backward()  # SGD lr 1: row 2 gets -2 per element
    torch.testing.assert_close(model.item.embeddings["i"].weight.detach()[2], before["item.embeddings.i.weight"][2] - 2)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=3)])
    top = fuse_embedding_optimizer(ebc, torch.optim.SGD, {"lr": 0.1}, device="cpu")
    assert isinstance(top, FusedEmbeddingBagCollection)
    torch.testing.assert_close(top.embedding_bags["t"].weight, ebc.embedding_bags["t"].weight)


def test_fused_module_tree_is_the_collections() -> None:
    model = TwoTower()
    before = [list(dict(f()).keys()) for f in (model.named_modules, model.named_parameters, model.named_buffers)]
    shapes = {k: v.shape for k, v in model.named_parameters()}
    fuse_embedding_optimizer(model, torch.optim.SGD, {"lr": 0.02}, device=torch.device("cpu"))
    after = [list(dict(f()).keys()) for f in (model.named_modules, model.named_parameters, model.named_buffers)]
    assert after == before
    assert {k: v.shape for k, v in model.named_parameters()} == shapes
    model.eval()
    assert not any(m.training for m in model.modules())
    assert not model.user[0]._kernels[0].training and not model.item._kernels[0].training


def test_interfaces_and_fused_optimizer_module() -> None:
    from recsys_core import EmbeddingBagCollectionInterface
    from recsys_core.modules.embedding_modules import EmbeddingCollectionInterface
    from recsys_core.optim.fused import FusedOptimizerModule

    model = TwoTower()
    assert isinstance(model.user[0], EmbeddingBagCollectionInterface)
    assert isinstance(model.item, EmbeddingCollectionInterface)
    assert not isinstance(model.dense, EmbeddingBagCollectionInterface)
    assert not isinstance(model.user[0], FusedOptimizerModule)
    fuse_embedding_optimizer(model, torch.optim.SGD, {"lr": 0.02}, device="cpu")
    assert isinstance(model.user[0], EmbeddingBagCollectionInterface)
    assert isinstance(model.user[0], FusedOptimizerModule) and isinstance(model.item, FusedOptimizerModule)
    assert isinstance(model.item, EmbeddingCollectionInterface)


def test_convert_optimizer_type_and_kwargs() -> None:
    from recsys_core import EmbOptimType
    from recsys_core.modules.fused_embedding_modules import convert_optimizer_type_and_kwargs
    from recsys_core.optim import RowWiseAdagrad

    assert convert_optimizer_type_and_kwargs(torch.optim.SGD, {"lr": 0.1}) == (EmbOptimType.EXACT_SGD, {"learning_rate": 0.1})
    assert convert_optimizer_type_and_kwargs(RowWiseAdagrad, {"lr": 0.1, "eps": 1e-3}) == (
        EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"learning_rate": 0.1, "eps": 1e-3})
    assert convert_optimizer_type_and_kwargs(torch.optim.Adagrad, {})[0] is EmbOptimType.EXACT_ADAGRAD
    assert convert_optimizer_type_and_kwargs(torch.optim.Adam, {})[0] is EmbOptimType.ADAM
    assert convert_optimizer_type_and_kwargs(torch.optim.RMSprop, {"lr": 0.1}) is None
