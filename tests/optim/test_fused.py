"""The fused embedding optimizer as TorchRec's FusedOptimizer: lr forwarding on step/zero_grad,
set_optimizer_step (Adam bias correction), update_hyper_parameters, param-group checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch

from recsys_core import (
    EmbeddingBagConfig,
    EmbOptimType,
    FusedEmbeddingBagCollection,
    KernelBackend,
    KeyedJaggedTensor,
)
from recsys_core.kernels import fbgemm_available
from recsys_core.optim import (
    CombinedOptimizer,
    EmbeddingFusedOptimizer,
    EmptyFusedOptimizer,
    FusedOptimizer,
    FusedOptimizerModule,
    KeyedOptimizerWrapper,
    in_backward_optimizer_filter,
)

BACKENDS = [KernelBackend.TORCH] + ([KernelBackend.FBGEMM] if fbgemm_available() else [])
TABLE = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=3, feature_names=["f"])]


def one_id(row: int) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=["f"], values=torch.tensor([row]), lengths=torch.tensor([1]))


def members(fused: FusedEmbeddingBagCollection) -> list[EmbeddingFusedOptimizer]:
    return [opt for _, opt in fused.fused_optimizer.optimizers]  # type: ignore[misc]


def test_class_hierarchy_and_empty_optimizer() -> None:
    fused = FusedEmbeddingBagCollection(TABLE, EmbOptimType.EXACT_SGD, {"learning_rate": 0.1})
    assert all(isinstance(opt, FusedOptimizer) for opt in members(fused))
    empty = EmptyFusedOptimizer()
    empty.step()
    empty.zero_grad()
    assert empty.state_dict() == {"state": {}} and empty.params == {}
    assert issubclass(FusedOptimizerModule, object) and hasattr(FusedOptimizerModule, "fused_optimizer")


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_grad_and_update_hyper_parameters_set_the_kernel_lr(backend: KernelBackend) -> None:
    fused = FusedEmbeddingBagCollection(TABLE, EmbOptimType.EXACT_SGD, {"learning_rate": 0.1}, backend=backend)
    opt = fused.fused_optimizer
    opt.param_groups[0]["lr"] = 0.5
    opt.zero_grad()  # TorchRec's fused zero_grad forwards lr, like step()
    assert fused._kernels[0].get_learning_rate() == pytest.approx(0.5)
    opt.update_hyper_parameters({"lr": 2.0})
    assert opt.param_groups[0]["lr"] == 2.0
    before = fused.state_dict()["embedding_bags.t.weight"].clone()
    fused(one_id(1)).values().sum().backward()
    after = fused.state_dict()["embedding_bags.t.weight"]
    torch.testing.assert_close(after[1], before[1] - 2.0)  # d(sum)/dw = 1, lr 2
    with pytest.raises(NotImplementedError, match=r"\['eps'\].*only 'lr'"):
        opt.update_hyper_parameters({"eps": 0.1})


@pytest.mark.parametrize("backend", [KernelBackend.AUTO])  # FBGEMM has no CPU Adam kernel
def test_set_optimizer_step_drives_adam_bias_correction(backend: KernelBackend) -> None:
    lr, eps, b1, b2 = 0.1, 1e-8, 0.9, 0.999
    kwargs = {"learning_rate": lr, "eps": eps, "beta1": b1, "beta2": b2}
    fused = FusedEmbeddingBagCollection(TABLE, EmbOptimType.ADAM, kwargs, backend=backend)
    fused.fused_optimizer.set_optimizer_step(5)
    before = fused.state_dict()["embedding_bags.t.weight"].clone()
    out = fused(one_id(2)).values()
    (out * torch.tensor([[1.0, -3.0, 2.0, 0.5]])).sum().backward()
    # The sixth step from zero moments: m = (1-b1) g, v = (1-b2) g^2, bias-corrected at t = 6.
    g = torch.tensor([1.0, -3.0, 2.0, 0.5])
    t = 6
    m_hat = (1 - b1) * g / (1 - b1**t)
    v_hat = (1 - b2) * g * g / (1 - b2**t)
    expected = before[2] - lr * m_hat / (v_hat.sqrt() + eps)
    after = fused.state_dict()["embedding_bags.t.weight"]
    torch.testing.assert_close(after[2], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after[:2], before[:2])


def test_param_groups_in_checkpoint_reach_the_kernel() -> None:
    a = FusedEmbeddingBagCollection(TABLE, EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"learning_rate": 0.3})
    b = FusedEmbeddingBagCollection(TABLE, EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"learning_rate": 0.1})
    a(one_id(0)).values().sum().backward()
    sd = a.fused_optimizer.state_dict()
    assert set(sd) == {"state"}
    b.fused_optimizer.load_state_dict(copy.deepcopy(sd))  # lr is not in the checkpoint: kept
    assert b._kernels[0].get_learning_rate() == pytest.approx(0.1)
    torch.testing.assert_close(
        b.fused_optimizer.state_dict()["state"]["embedding_bags.t.weight"]["t.momentum1"],
        sd["state"]["embedding_bags.t.weight"]["t.momentum1"],
    )
    a.fused_optimizer.save_param_groups(True)
    b.fused_optimizer.save_param_groups(True)
    sd = a.fused_optimizer.state_dict()
    assert sd["param_groups"] == [{"params": ["embedding_bags.t.weight"], "lr": 0.3}]
    b.fused_optimizer.load_state_dict(copy.deepcopy(sd))
    assert b.fused_optimizer.param_groups[0]["lr"] == 0.3
    assert b._kernels[0].get_learning_rate() == pytest.approx(0.3)  # post_load_state_dict


def test_init_state_leaves_weights_and_state() -> None:
    fused = FusedEmbeddingBagCollection(TABLE, EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"learning_rate": 0.3})
    weights = fused.state_dict()["embedding_bags.t.weight"].clone()
    fused.fused_optimizer.init_state()
    torch.testing.assert_close(fused.state_dict()["embedding_bags.t.weight"], weights)
    state = fused.fused_optimizer.state_dict()["state"]["embedding_bags.t.weight"]["t.momentum1"]
    torch.testing.assert_close(state, torch.zeros_like(state))


def test_combined_fused_and_dense_state_dict() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sparse = FusedEmbeddingBagCollection(TABLE, EmbOptimType.EXACT_SGD, {"learning_rate": 0.1})
            self.dense = torch.nn.Linear(4, 1)

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.dense(self.sparse(kjt).values())

    model = Model()
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    assert list(dense) == ["dense.weight", "dense.bias"]
    opt = CombinedOptimizer([
        ("sparse", model.sparse.fused_optimizer),
        KeyedOptimizerWrapper(dense, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5)),
    ])
    assert set(opt.state_dict()) == {"state"}  # TorchRec: no param_groups unless asked
    opt.save_param_groups(True)
    sd = opt.state_dict()
    assert sd["param_groups"] == [
        {"params": ["sparse.embedding_bags.t.weight"], "lr": 0.1},
        # names sorted, as TorchRec saves them
        {"params": ["dense.bias", "dense.weight"], "lr": 0.1, "momentum": 0.5, "dampening": 0,
         "weight_decay": 0, "nesterov": False, "maximize": False, "foreach": None,
         "differentiable": False, "fused": None},
    ]
    bias = model.dense.bias.detach().clone()
    opt.zero_grad()
    model(one_id(1)).sum().backward()
    opt.step()
    torch.testing.assert_close(model.dense.bias.detach(), bias - 0.1)  # d(out)/d(bias) = 1
    assert set(opt.state_dict()["state"]) == {"sparse.embedding_bags.t.weight", "dense.weight", "dense.bias"}
