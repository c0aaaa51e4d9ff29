"""Fused optimizer configuration: strict parsing of fused_params and torch optimizer mapping."""

from __future__ import annotations

import pytest
import torch

from recsys_core.kernels import fbgemm_available
from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig, WeightDecayMode
from recsys_core.optim import RowWiseAdagrad


def test_tutorial_fused_params_dict() -> None:
    config = FusedOptimizerConfig.from_fused_params(
        {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.02, "eps": 0.002}
    )
    assert config.optimizer is EmbOptimType.EXACT_ROWWISE_ADAGRAD
    assert (config.learning_rate, config.eps) == (0.02, 0.002)


@pytest.mark.skipif(not fbgemm_available(), reason="fbgemm_gpu is not importable")
def test_fbgemm_enum_is_accepted() -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmOptim

    config = FusedOptimizerConfig.from_fused_params({"optimizer": FbgemmOptim.EXACT_ADAGRAD})
    assert config.optimizer is EmbOptimType.EXACT_ADAGRAD


def test_unknown_fused_param_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['learning_rat'\]"):
        FusedOptimizerConfig.from_fused_params({"optimizer": EmbOptimType.EXACT_SGD, "learning_rat": 0.1})


def test_unsupported_optimizer_lists_choices() -> None:
    with pytest.raises(ValueError, match="not supported.*EXACT_ROWWISE_ADAGRAD"):
        FusedOptimizerConfig(optimizer="shampoo")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"learning_rate": -1.0}, "learning_rate must be >= 0"),
        ({"eps": 0.0}, "eps must be > 0"),
        ({"beta1": 1.0}, r"beta1 must be in \[0, 1\)"),
        ({"optimizer": EmbOptimType.EXACT_SGD, "weight_decay": 0.1}, "takes no weight_decay"),
        ({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "weight_decay": 0.1}, "does nothing"),
    ],
)
def test_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FusedOptimizerConfig(**kwargs)


def test_torch_optimizer_mapping() -> None:
    sgd = FusedOptimizerConfig.from_torch_optimizer(torch.optim.SGD, {"lr": 0.5})
    assert (sgd.optimizer, sgd.learning_rate) == (EmbOptimType.EXACT_SGD, 0.5)
    ada = FusedOptimizerConfig.from_torch_optimizer(torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-6})
    assert (ada.optimizer, ada.eps) == (EmbOptimType.EXACT_ADAGRAD, 1e-6)
    row = FusedOptimizerConfig.from_torch_optimizer(RowWiseAdagrad, {"lr": 0.1, "weight_decay": 0.01})
    assert row.optimizer is EmbOptimType.EXACT_ROWWISE_ADAGRAD
    assert row.weight_decay_mode is WeightDecayMode.L2
    adam = FusedOptimizerConfig.from_torch_optimizer(torch.optim.Adam, {"lr": 0.001, "betas": (0.8, 0.9)})
    assert (adam.optimizer, adam.beta1, adam.beta2) == (EmbOptimType.ADAM, 0.8, 0.9)
    with pytest.raises(ValueError, match="momentum has no fused kernel"):
        FusedOptimizerConfig.from_torch_optimizer(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match="RMSprop has no fused embedding kernel"):
        FusedOptimizerConfig.from_torch_optimizer(torch.optim.RMSprop, {"lr": 0.1})
    with pytest.raises(ValueError, match=r"\['dampening'\] are not supported"):
        FusedOptimizerConfig.from_torch_optimizer(torch.optim.SGD, {"lr": 0.1, "dampening": 0.1})
