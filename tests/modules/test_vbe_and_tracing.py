"""Variable batch per key (VBE) on the EBC, and EBC/EC under torch.jit.script and torch.fx."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import recsys_core.fx
from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    KeyedTensor,
    PoolingType,
)

TABLES = [
    EmbeddingBagConfig(name="t1", embedding_dim=2, num_embeddings=5, feature_names=["a", "b"]),
    EmbeddingBagConfig(name="t2", embedding_dim=1, num_embeddings=6, feature_names=["b"], pooling=PoolingType.MEAN),
]
W1 = torch.arange(10.0).view(5, 2)
W2 = torch.arange(6.0).view(6, 1) * 10


def ebc(weighted: bool = False) -> EmbeddingBagCollection:
    module = EmbeddingBagCollection(TABLES, is_weighted=weighted)
    module.load_state_dict({"embedding_bags.t1.weight": W1, "embedding_bags.t2.weight": W2})
    return module


def vbe_kjt() -> KeyedJaggedTensor:
    # a: one bag [1] (batch 1); b: bags [2, 3], [4], [] (batch 3). Full batch of 4:
    # a's row 0 serves every sample; b's rows 0, 1, 2 serve samples 2, 0, 1 and 0 again.
    return KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3, 4]),
        lengths=torch.tensor([1, 2, 1, 0]),
        stride_per_key_per_rank=[[1], [3]],
        inverse_indices=(["b", "a"], torch.tensor([[2, 0, 1, 0], [0, 0, 0, 0]])),
    )


def plain_kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=["a", "b"], values=torch.tensor([1, 0, 4, 2, 3]), lengths=torch.tensor([1, 2, 2, 0]),
        weights=torch.tensor([0.5, 1.0, 2.0, 3.0, 0.25]),
    )


def test_vbe_pools_per_key_and_expands_with_inverse_indices() -> None:
    kt = ebc()(vbe_kjt())
    assert kt.keys() == ["a", "b@t1", "b@t2"]
    a = W1[1]
    b1 = [W1[2] + W1[3], W1[4], torch.zeros(2)]       # SUM over t1
    b2 = [(W2[2] + W2[3]) / 2, W2[4], torch.zeros(1)]  # MEAN over t2
    expected = torch.stack([torch.cat([a, b1[i], b2[i]]) for i in (2, 0, 1, 0)])
    torch.testing.assert_close(kt.values(), expected)


def test_vbe_without_inverse_indices_is_a_clear_error() -> None:
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 2, 1, 0]),
                            stride_per_key_per_rank=[[1], [3]])
    with pytest.raises(ValueError, match=r"different batch size per key \(\{'a': 1, 'b': 3\}\) and no inverse_indices"):
        ebc()(kjt)


def test_lengths_past_the_values_name_the_key() -> None:
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1, 1]))
    with pytest.raises(ValueError, match="key 'b' needs values"):
        ebc()(kjt)


class Model(nn.Module):
    def __init__(self, weighted: bool) -> None:
        super().__init__()
        self.sparse = ebc(weighted)
        self.dense = nn.Linear(5, 1)
        with torch.no_grad():
            self.dense.weight.copy_(torch.arange(5.0).view(1, 5))

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        kt: KeyedTensor = self.sparse(features)
        return self.dense(kt.values())


def scripted(module: nn.Module) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(module)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("compile_", ["script", "fx", "recsys_fx"])
def test_model_with_ebc_scripted_and_traced_equals_eager(weighted: bool, compile_: str) -> None:
    model = Model(weighted)
    compiled = {"script": scripted, "fx": torch.fx.symbolic_trace, "recsys_fx": recsys_core.fx.symbolic_trace}[compile_](model)
    inputs = [plain_kjt()] if weighted else [plain_kjt(), vbe_kjt()]
    for kjt in inputs:
        torch.testing.assert_close(compiled(kjt), model(kjt))


def test_traced_ebc_still_checks_its_input() -> None:
    traced = torch.fx.symbolic_trace(Model(False))
    with pytest.raises(ValueError, match=r"lacks feature\(s\) \['b'\]"):
        traced(KeyedJaggedTensor(keys=["a"], values=torch.tensor([1]), lengths=torch.tensor([1])))


def test_embedding_collection_scripted_and_traced() -> None:
    ec = EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=2, num_embeddings=5, feature_names=["a", "b"])],
                             need_indices=True)
    kjt = plain_kjt()
    eager = ec(kjt)
    for compiled in (scripted(ec), torch.fx.symbolic_trace(ec)):
        out = compiled(kjt)
        assert list(out) == ["a", "b"]
        for name, jt in eager.items():
            torch.testing.assert_close(out[name].values(), jt.values())
            assert torch.equal(out[name].lengths(), jt.lengths())
            assert torch.equal(out[name].weights(), jt.weights())


@pytest.mark.parametrize("trace", [torch.fx.symbolic_trace, recsys_core.fx.symbolic_trace])
def test_traced_collections_can_be_scripted(trace) -> None:
    bags = ebc(weighted=True)
    kjt = plain_kjt()
    graph = scripted(trace(bags))
    torch.testing.assert_close(graph(kjt).values(), bags(kjt).values())
    assert graph(kjt).keys() == ["a", "b@t1", "b@t2"]
    ec = EmbeddingCollection([
        EmbeddingConfig(name="t1", embedding_dim=2, num_embeddings=5, feature_names=["a", "b"]),
        EmbeddingConfig(name="t2", embedding_dim=2, num_embeddings=5, feature_names=["b"]),
    ])
    out = scripted(trace(ec))(features=kjt)
    assert list(out) == ["a", "b@t1", "b@t2"]
    torch.testing.assert_close(out["b@t2"].values(), ec.embeddings["t2"].weight[[2, 3]])


def test_fused_ebc_refuses_variable_batch_input() -> None:
    from recsys_core import FusedEmbeddingBagCollection

    fused = FusedEmbeddingBagCollection(TABLES, torch.optim.SGD, {"lr": 0.1})
    with pytest.raises(ValueError, match=r"different batch size per key \(\{'a': 1, 'b': 3\}\)"):
        fused(vbe_kjt())
