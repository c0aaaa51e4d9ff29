"""FusedEmbeddingBagCollection == EmbeddingBagCollection + a plain torch optimizer, step by step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbOptimType,
    FusedEmbeddingBagCollection,
    IdOutOfRangeError,
    KernelBackend,
    KeyedJaggedTensor,
    PoolingType,
)
from recsys_core.kernels import fbgemm_available
from recsys_core.optim import (
    CombinedOptimizer,
    KeyedOptimizerWrapper,
    RowWiseAdagrad,
    apply_optimizer_in_backward,
    in_backward_optimizer_filter,
)

TABLES = [
    EmbeddingBagConfig(name="t_sum", embedding_dim=8, num_embeddings=40, feature_names=["f0", "f1"], pooling=PoolingType.SUM),
    EmbeddingBagConfig(name="t_mean", embedding_dim=4, num_embeddings=25, feature_names=["f2"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t_sum2", embedding_dim=12, num_embeddings=30, feature_names=["f3"], pooling=PoolingType.SUM),
]
FEATURE_ROWS = {"f0": 40, "f1": 40, "f2": 25, "f3": 30}


def random_kjt(gen: torch.Generator, batch: int, keys: list[str], weighted: bool) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
    values = torch.cat([
        torch.randint(0, min(FEATURE_ROWS[k], 8), (int(lengths[i * batch : (i + 1) * batch].sum()),), generator=gen)
        for i, k in enumerate(keys)
    ])
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


CASES = [
    (EmbOptimType.EXACT_SGD, {"learning_rate": 0.3}, torch.optim.SGD, {"lr": 0.3}),
    (EmbOptimType.EXACT_ADAGRAD, {"learning_rate": 0.3, "eps": 1e-4}, torch.optim.Adagrad, {"lr": 0.3, "eps": 1e-4}),
    (EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"learning_rate": 0.3, "eps": 1e-4}, RowWiseAdagrad, {"lr": 0.3, "eps": 1e-4}),
]


@pytest.mark.parametrize("fused_type, fused_kwargs, ref_class, ref_kwargs", CASES, ids=lambda x: getattr(x, "name", None) or "")
@pytest.mark.parametrize("backend", [KernelBackend.AUTO, KernelBackend.TORCH])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("key_order", [["f0", "f1", "f2", "f3"], ["f3", "f2", "f1", "f0"]])
def test_fused_equals_unfused_after_steps(
    fused_type, fused_kwargs, ref_class, ref_kwargs, backend, weighted, key_order
) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES, is_weighted=weighted)
    fused = FusedEmbeddingBagCollection(TABLES, fused_type, fused_kwargs, is_weighted=weighted, backend=backend)
    fused.load_state_dict(ebc.state_dict())
    ref_opt = ref_class(ebc.parameters(), **ref_kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        kjt = random_kjt(gen, batch=5, keys=key_order, weighted=weighted)
        target = torch.randn(5, 32, generator=gen)
        out_ref = ebc(kjt)
        out_fused = fused(kjt)
        assert out_fused.keys() == out_ref.keys() == ["f0", "f1", "f2", "f3"]
        torch.testing.assert_close(out_fused.values(), out_ref.values(), atol=1e-5, rtol=1e-5)
        ref_opt.zero_grad()
        (out_ref.values() * target).sum().backward()
        ref_opt.step()
        (out_fused.values() * target).sum().backward()  # fused: update happens here
        fused.fused_optimizer().step()  # no-op apart from lr sync; the training loop calls it
    for name, w in fused.state_dict().items():
        torch.testing.assert_close(w, ebc.state_dict()[name], atol=1e-5, rtol=1e-5)


def test_state_dict_keys_match_ebc_and_round_trip_with_optimizer_state() -> None:
    kwargs = {"learning_rate": 0.2, "eps": 1e-3}
    a = FusedEmbeddingBagCollection(TABLES, EmbOptimType.EXACT_ROWWISE_ADAGRAD, kwargs)
    assert list(a.state_dict()) == list(EmbeddingBagCollection(TABLES).state_dict())
    gen = torch.Generator().manual_seed(4)
    keys = ["f0", "f1", "f2", "f3"]
    for _ in range(3):
        a(random_kjt(gen, 4, keys, False)).values().sum().backward()
    b = FusedEmbeddingBagCollection(TABLES, EmbOptimType.EXACT_ROWWISE_ADAGRAD, kwargs)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    optim_state = a.fused_optimizer().state_dict()
    assert set(optim_state["state"]) == {f"embedding_bags.{t.name}.weight" for t in TABLES}
    assert set(optim_state["state"]["embedding_bags.t_mean.weight"]) == {"t_mean.momentum1"}
    b.fused_optimizer().load_state_dict(copy.deepcopy(optim_state))
    for _ in range(2):
        kjt = random_kjt(gen, 4, keys, False)
        out_a, out_b = a(kjt), b(kjt)
        torch.testing.assert_close(out_a.values(), out_b.values())
        out_a.values().sum().backward()
        out_b.values().sum().backward()
    for name, w in a.state_dict().items():
        torch.testing.assert_close(w, b.state_dict()[name])
    # without the optimizer state the trajectories differ: the test can fail
    c = FusedEmbeddingBagCollection(TABLES, EmbOptimType.EXACT_ROWWISE_ADAGRAD, kwargs)
    c.load_state_dict(copy.deepcopy(a.state_dict()))
    kjt = random_kjt(gen, 4, keys, False)
    a(kjt).values().sum().backward()
    c(kjt).values().sum().backward()
    assert not torch.allclose(a.state_dict()["embedding_bags.t_sum.weight"], c.state_dict()["embedding_bags.t_sum.weight"])


def test_tutorial_fused_params_flow(tutorial_tables: list[EmbeddingBagConfig]) -> None:
    ebc = EmbeddingBagCollection(device="cpu", tables=tutorial_tables)
    fused_params = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.02, "eps": 0.002}
    optimizer = fused_params.pop("optimizer")
    fused = FusedEmbeddingBagCollection(ebc.embedding_bag_configs(), optimizer, fused_params)
    fused.load_state_dict(ebc.state_dict())
    assert repr(fused.fused_optimizer()) == ": EmbeddingFusedOptimizer (\nParameter Group 0\n    lr: 0.02\n)"
    assert isinstance(fused.fused_optimizer(), CombinedOptimizer)
    assert dict(in_backward_optimizer_filter(fused.named_parameters())) == {}
    kjt = KeyedJaggedTensor(keys=["product", "user"], values=torch.tensor([1, 2, 1, 5, 2, 3, 4, 1]), lengths=torch.tensor([3, 1, 2, 2]))
    out = fused(kjt).values()
    loss1 = torch.sum(torch.ones_like(out) - out)
    loss1.backward()
    out = fused(kjt).values()
    loss2 = torch.sum(torch.ones_like(out) - out)
    # no optimizer.step(): the loss fell because backward updated the tables.
    assert loss2.item() < loss1.item() - 1.0


def test_apply_optimizer_in_backward_then_convert(tutorial_tables: list[EmbeddingBagConfig]) -> None:
    ebc = EmbeddingBagCollection(device="cpu", tables=tutorial_tables)
    reference = copy.deepcopy(ebc)
    for _, param in ebc.named_parameters():
        apply_optimizer_in_backward(torch.optim.SGD, [param], {"lr": 0.5})
    fused = FusedEmbeddingBagCollection.from_embedding_bag_collection(ebc)
    assert repr(fused.fused_optimizer()) == ": EmbeddingFusedOptimizer (\nParameter Group 0\n    lr: 0.5\n)"
    kjt = KeyedJaggedTensor(keys=["product", "user"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    fused(kjt).values().sum().backward()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    reference(kjt).values().sum().backward()
    ref_opt.step()
    for name, w in fused.state_dict().items():
        torch.testing.assert_close(w, reference.state_dict()[name])
    with pytest.raises(ValueError, match="none recorded"):
        FusedEmbeddingBagCollection.from_embedding_bag_collection(
            EmbeddingBagCollection(tutorial_tables)
        )


def test_learning_rate_change_reaches_kernel() -> None:
    table = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=3, feature_names=["f"])]
    fused = FusedEmbeddingBagCollection(table, EmbOptimType.EXACT_SGD, {"learning_rate": 0.1})
    fused.fused_optimizer().param_groups[0]["lr"] = 1.0
    fused.fused_optimizer().step()
    before = fused.state_dict()["embedding_bags.t.weight"].clone()
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([2]), lengths=torch.tensor([1]))
    fused(kjt).values().sum().backward()
    after = fused.state_dict()["embedding_bags.t.weight"]
    torch.testing.assert_close(after[2], before[2] - 1.0)  # grad of sum is 1, lr 1.0
    torch.testing.assert_close(after[:2], before[:2])


def test_lr_scheduler_drives_fused_learning_rate() -> None:
    table = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=3, feature_names=["f"])]
    fused = FusedEmbeddingBagCollection(table, EmbOptimType.EXACT_SGD, {"learning_rate": 0.4})
    scheduler = torch.optim.lr_scheduler.StepLR(fused.fused_optimizer(), step_size=1, gamma=0.5)
    fused.fused_optimizer().step()
    scheduler.step()
    fused.fused_optimizer().step()
    assert fused._kernels[0].get_learning_rate() == pytest.approx(0.2)


def test_combined_with_dense_optimizer() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sparse = FusedEmbeddingBagCollection(TABLES, EmbOptimType.EXACT_SGD, {"learning_rate": 0.1})
            self.dense = nn.Linear(32, 1)

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.dense(self.sparse(kjt).values())

    model = Model()
    dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
    assert sorted(dense_params) == ["dense.bias", "dense.weight"]
    dense_opt = KeyedOptimizerWrapper(dense_params, lambda ps: torch.optim.SGD(ps, lr=0.1))
    opt = CombinedOptimizer([("sparse", model.sparse.fused_optimizer()), dense_opt])
    opt.save_param_groups(True)  # TorchRec's state_dict has param_groups only when asked
    state = opt.state_dict()
    assert "sparse.embedding_bags.t_sum.weight" in state["state"]
    assert [g["params"] for g in state["param_groups"]][-1] == ["dense.bias", "dense.weight"]  # sorted, as TorchRec
    bias_before = model.dense.bias.detach().clone()
    gen = torch.Generator().manual_seed(3)
    opt.zero_grad()
    model(random_kjt(gen, 4, ["f0", "f1", "f2", "f3"], False)).sum().backward()
    opt.step()
    torch.testing.assert_close(model.dense.bias.detach(), bias_before - 0.1 * 4)
    opt.load_state_dict(state)


def test_fused_errors() -> None:
    fused = FusedEmbeddingBagCollection(TABLES, EmbOptimType.EXACT_SGD, {"learning_rate": 0.1})
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=torch.tensor([0, 1, 25, 2]), lengths=torch.tensor([1, 1, 1, 1]))
    before = copy.deepcopy(fused.state_dict())
    with pytest.raises(IdOutOfRangeError, match=r"feature 'f2': id 25 \(batch position 0\) is outside \[0, 25\)"):
        fused(kjt)
    for name, w in fused.state_dict().items():
        assert torch.equal(w, before[name])
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lr'\]"):
        FusedEmbeddingBagCollection(TABLES, EmbOptimType.EXACT_SGD, {"lr": 0.1})
    with pytest.raises(ValueError, match="cannot be moved or cast"):
        fused.half()


@pytest.mark.skipif(not fbgemm_available(), reason="fbgemm_gpu is not importable")
def test_auto_uses_fbgemm_where_it_is_exact() -> None:
    fused = FusedEmbeddingBagCollection(TABLES, EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"learning_rate": 0.1})
    assert fused.kernel_backends() == [KernelBackend.FBGEMM, KernelBackend.FBGEMM]
    adam = FusedEmbeddingBagCollection(TABLES, EmbOptimType.ADAM, {"learning_rate": 0.1})
    assert adam.kernel_backends() == [KernelBackend.TORCH, KernelBackend.TORCH]


@pytest.mark.parametrize("backend", [KernelBackend.AUTO, KernelBackend.TORCH])
def test_lengths_values_mismatch_names_the_key(backend: KernelBackend) -> None:
    fused = FusedEmbeddingBagCollection(TABLES, EmbOptimType.EXACT_SGD, {"learning_rate": 0.1}, backend=backend)
    ebc = EmbeddingBagCollection(TABLES)
    # lengths sum to 5 but only 4 values: the last key's range runs past the end
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1", "f2", "f3"], values=torch.tensor([0, 1, 2, 3]), lengths=torch.tensor([1, 1, 1, 2])
    )
    for module in (fused, ebc):
        with pytest.raises(ValueError, match="f3"):
            module(kjt)


@pytest.mark.parametrize("backend", [KernelBackend.AUTO, KernelBackend.TORCH])
def test_two_tables_of_one_name_are_both_trained_last_one_exposed(backend: KernelBackend) -> None:
    # TorchRec accepts this: both tables work; the later one's weight is the one named.
    first = EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=4, feature_names=["a"])
    second = EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=4, feature_names=["b"])
    with pytest.warns(UserWarning, match="two tables are named 't'.*a checkpoint loses"):
        fused = FusedEmbeddingBagCollection(
            [first, second], EmbOptimType.EXACT_SGD, {"learning_rate": 1.0}, backend=backend
        )
    assert list(fused.state_dict()) == ["embedding_bags.t.weight"]
    exposed = fused.state_dict()["embedding_bags.t.weight"].clone()
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([0, 0]), lengths=torch.tensor([1, 1]))
    out = fused(kjt)
    assert out.keys() == ["a", "b"]
    assert torch.equal(out["b"].detach(), exposed[0:1])
    a_before = out["a"].detach().clone()
    assert not torch.equal(a_before, exposed[0:1])  # a reads the other table
    out["b"].sum().backward()  # SGD, lr 1: the exposed table's row 0 drops by 1
    torch.testing.assert_close(fused.state_dict()["embedding_bags.t.weight"][0], exposed[0] - 1)
    assert torch.equal(fused(kjt)["a"].detach(), a_before)  # the other table had no gradient
    assert list(fused.fused_optimizer.params) == ["embedding_bags.t.weight"]
