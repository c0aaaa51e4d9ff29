"""EmbeddingBagCollection / EmbeddingCollection against hand-computed values and the tutorial."""

from __future__ import annotations

import pytest
import torch

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    IdOutOfRangeError,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    PoolingType,
)


def test_tutorial_embedding_bags_repr(tutorial_tables: list[EmbeddingBagConfig]) -> None:
    ebc = EmbeddingBagCollection(device="cpu", tables=tutorial_tables)
    assert str(ebc.embedding_bags) == (
        "ModuleDict(\n"
        "  (product_table): EmbeddingBag(4096, 64, mode='sum')\n"
        "  (user_table): EmbeddingBag(4096, 64, mode='sum')\n"
        ")"
    )


def test_tutorial_forward_shapes_and_values(tutorial_tables: list[EmbeddingBagConfig]) -> None:
    ebc = EmbeddingBagCollection(device="cpu", tables=tutorial_tables)
    product_jt = JaggedTensor(values=torch.tensor([1, 2, 1, 5]), lengths=torch.tensor([3, 1]))
    user_jt = JaggedTensor(values=torch.tensor([2, 3, 4, 1]), lengths=torch.tensor([2, 2]))
    kjt = KeyedJaggedTensor.from_jt_dict({"product": product_jt, "user": user_jt})
    result = ebc(kjt)
    assert isinstance(result, KeyedTensor)
    assert result.keys() == ["product", "user"]
    assert result.values().shape == torch.Size([2, 128])
    assert {k: v.shape for k, v in result.to_dict().items()} == {
        "product": torch.Size([2, 64]), "user": torch.Size([2, 64]),
    }
    p = ebc.embedding_bags["product_table"].weight
    u = ebc.embedding_bags["user_table"].weight
    expected = torch.stack([
        torch.cat([p[1] + p[2] + p[1], u[2] + u[3]]),
        torch.cat([p[5], u[4] + u[1]]),
    ])
    torch.testing.assert_close(result.values(), expected)


def small_tables(pooling: PoolingType = PoolingType.SUM) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=2, num_embeddings=5, feature_names=["a"], pooling=pooling),
        EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=4, feature_names=["b", "c"], pooling=pooling),
    ]


def set_weights(ebc: EmbeddingBagCollection) -> tuple[torch.Tensor, torch.Tensor]:
    w0 = torch.arange(10.0).view(5, 2)
    w1 = torch.arange(12.0).view(4, 3) * 10
    with torch.no_grad():
        ebc.embedding_bags["t0"].weight.copy_(w0)
        ebc.embedding_bags["t1"].weight.copy_(w1)
    return w0, w1


def kjt_abc(weights: bool = False) -> KeyedJaggedTensor:
    # batch 2: a [[0, 4], []], b [[1], [1, 2]], c [[], [3]]
    return KeyedJaggedTensor(
        keys=["a", "b", "c"],
        values=torch.tensor([0, 4, 1, 1, 2, 3]),
        lengths=torch.tensor([2, 0, 1, 2, 0, 1]),
        weights=torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25, 4.0]) if weights else None,
    )


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooling_by_hand_with_shared_table_and_empty_bags(pooling: PoolingType, weighted: bool) -> None:
    ebc = EmbeddingBagCollection(small_tables(pooling), is_weighted=weighted)
    w0, w1 = set_weights(ebc)
    kt = ebc(kjt_abc(weights=weighted))
    if weighted:
        a0 = 0.5 * w0[0] + 2.0 * w0[4]
        b0, b1 = 1.0 * w1[1], 3.0 * w1[1] + 0.25 * w1[2]
        c1 = 4.0 * w1[3]
    else:
        a0, b0, b1, c1 = w0[0] + w0[4], w1[1], w1[1] + w1[2], w1[3]
    if pooling is PoolingType.MEAN:
        a0, b1 = a0 / 2, b1 / 2
    expected = torch.stack([
        torch.cat([a0, b0, torch.zeros(3)]),
        torch.cat([torch.zeros(2), b1, c1]),
    ])
    assert kt.keys() == ["a", "b", "c"]
    assert kt.length_per_key() == [2, 3, 3]
    torch.testing.assert_close(kt.values(), expected)


def test_meta_device_allocates_nothing(tutorial_tables: list[EmbeddingBagConfig]) -> None:
    ebc = EmbeddingBagCollection(device="meta", tables=tutorial_tables)
    assert all(p.is_meta for p in ebc.parameters())
    ec = EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10**9)], device="meta")
    assert all(p.is_meta for p in ec.parameters())


def test_default_init_range_and_init_fn() -> None:
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100)])
    w = ebc.embedding_bags["t"].weight
    assert float(w.detach().abs().max()) <= 0.1 + 1e-7  # sqrt(1/100)
    ebc2 = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, init_fn=torch.nn.init.ones_)])
    assert torch.equal(ebc2.embedding_bags["t"].weight, torch.ones(100, 8))


def test_embedding_collection_unpooled_by_hand() -> None:
    ec = EmbeddingCollection(
        [EmbeddingConfig(name="t", embedding_dim=2, num_embeddings=5, feature_names=["x", "y"])],
        need_indices=True,
    )
    w = torch.arange(10.0).view(5, 2)
    with torch.no_grad():
        ec.embeddings["t"].weight.copy_(w)
    kjt = KeyedJaggedTensor(keys=["x", "y"], values=torch.tensor([3, 1, 4, 0]), lengths=torch.tensor([2, 0, 1, 1]))
    out = ec(kjt)
    assert list(out) == ["x", "y"]
    torch.testing.assert_close(out["x"].values(), w[[3, 1]])
    assert out["x"].lengths().tolist() == [2, 0]
    torch.testing.assert_close(out["y"].values(), w[[4, 0]])
    assert out["y"].lengths().tolist() == [1, 1]
    assert out["y"].weights().tolist() == [4, 0]


def test_bad_inputs_raise_clear_errors() -> None:
    ebc = EmbeddingBagCollection(small_tables())
    with pytest.raises(ValueError, match=r"lacks feature\(s\) \['c'\]"):
        ebc(KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([0, 1]), lengths=torch.tensor([1, 1])))
    with pytest.raises(ValueError, match="must be int32 or int64"):
        ebc(KeyedJaggedTensor(keys=["a", "b", "c"], values=torch.tensor([0.0, 1.0, 2.0]), lengths=torch.tensor([1, 1, 1])))
    with pytest.raises(IdOutOfRangeError, match=r"feature 'b': id 4 is outside \[0, 4\)"):
        ebc(KeyedJaggedTensor(keys=["a", "b", "c"], values=torch.tensor([0, 4, 2]), lengths=torch.tensor([1, 1, 1])))
    with pytest.raises(IdOutOfRangeError, match=r"feature 'a': id -3"):
        ebc(KeyedJaggedTensor(keys=["a", "b", "c"], values=torch.tensor([-3, 1, 2]), lengths=torch.tensor([1, 1, 1])))
    weighted = EmbeddingBagCollection(small_tables(), is_weighted=True)
    with pytest.raises(ValueError, match="has no weights"):
        weighted(kjt_abc(weights=False))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "", "embedding_dim": 4, "num_embeddings": 10}, "empty name"),
        ({"name": "t", "embedding_dim": 0, "num_embeddings": 10}, "embedding_dim must be > 0"),
        ({"name": "t", "embedding_dim": 4, "num_embeddings": -1}, "num_embeddings must be > 0"),
        ({"name": "t", "embedding_dim": 4, "num_embeddings": 10, "feature_names": "f"}, "list of names"),
        ({"name": "t", "embedding_dim": 4, "num_embeddings": 10, "pooling": PoolingType.NONE}, "SUM or PoolingType.MEAN"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EmbeddingBagConfig(**kwargs)


def test_duplicate_table_names_rejected_shared_features_allowed() -> None:
    t = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])
    u = EmbeddingBagConfig(name="u", embedding_dim=4, num_embeddings=10, feature_names=["f"])
    with pytest.raises(ValueError, match="two tables are named 't'"):
        EmbeddingBagCollection([t, t])
    assert EmbeddingBagCollection([t, u])._embedding_names == ["f@t", "f@u"]


def test_non_fp32_tables_are_float16_with_float32_outputs() -> None:
    from recsys_core import DataType

    config = EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=4, data_type=DataType.FP16,
                                pooling=PoolingType.MEAN, init_fn=torch.nn.init.ones_)
    ebc = EmbeddingBagCollection([config], is_weighted=True)
    assert ebc.embedding_bags["t"].weight.dtype == torch.float16
    kjt = KeyedJaggedTensor(keys=["t"], values=torch.tensor([0, 1, 3]), lengths=torch.tensor([2, 1]),
                            weights=torch.tensor([0.5, 2.0, 4.0]))
    kt = ebc(kjt)
    assert kt.values().dtype == torch.float32
    torch.testing.assert_close(kt.values(), torch.tensor([[1.25, 1.25], [4.0, 4.0]]))  # (0.5 + 2) / 2, 4 / 1
    ec = EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=2, num_embeddings=4, data_type=DataType.INT8,
                                              init_fn=torch.nn.init.ones_)])
    assert ec.embeddings["t"].weight.dtype == torch.float16
    out = ec(KeyedJaggedTensor(keys=["t"], values=torch.tensor([3]), lengths=torch.tensor([1])))
    assert out["t"].values().dtype == torch.float32 and out["t"].values().tolist() == [[1.0, 1.0]]


def test_process_pooled_embeddings_expands_variable_batches() -> None:
    from recsys_core.modules.embedding_modules import process_pooled_embeddings

    t0 = torch.tensor([[1.0], [2.0]])  # table 0 pooled 2 distinct rows
    t1 = torch.tensor([[10.0, 11.0]])  # table 1 pooled 1 distinct row
    assert process_pooled_embeddings([t0, t0], torch.empty(0)).tolist() == [[1.0, 1.0], [2.0, 2.0]]
    out = process_pooled_embeddings([t0, t1], torch.tensor([[1, 0, 1], [0, 0, 0]]))
    assert out.tolist() == [[2.0, 10.0, 11.0], [1.0, 10.0, 11.0], [2.0, 10.0, 11.0]]
    with pytest.raises(IndexError):
        process_pooled_embeddings([t0, t1], torch.tensor([[0, 2, 0], [0, 0, 0]]))
