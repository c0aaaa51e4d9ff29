"""TorchRec's dense building blocks (MLP, cross nets, DeepFM/FM, SwishLayerNorm) against their
formulas written out in plain PyTorch."""

import itertools

import pytest
import torch
from torch import nn

from recsys_core.fx import symbolic_trace
from recsys_core.modules.activation import SwishLayerNorm
from recsys_core.modules.crossnet import (
    CrossNet,
    LowRankCrossNet,
    LowRankMixtureCrossNet,
    VectorCrossNet,
)
from recsys_core.modules.deepfm import DeepFM, FactorizationMachine
from recsys_core.modules.mlp import MLP, Perceptron
from recsys_core.modules.utils import deterministic_dedup, extract_module_or_tensor_callable


def _randomize(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()


def test_crossnet_is_the_dcn_formula() -> None:
    torch.manual_seed(0)
    x0 = torch.randn(4, 5)
    net = CrossNet(in_features=5, num_layers=2)
    _randomize(net)  # non-zero biases too
    x = x0
    for layer in range(2):
        W, b = net.kernels[layer], net.bias[layer].squeeze(1)
        x = x0 * (x @ W.T + b) + x
    torch.testing.assert_close(net(x0), x)
    assert [n for n, _ in net.named_parameters()] == ["kernels.0", "kernels.1", "bias.0", "bias.1"]


def test_low_rank_and_vector_crossnets() -> None:
    torch.manual_seed(1)
    x0 = torch.randn(3, 6)
    low = LowRankCrossNet(in_features=6, num_layers=2, low_rank=2)
    vec = VectorCrossNet(in_features=6, num_layers=2)
    _randomize(low)
    _randomize(vec)
    x = x0
    for layer in range(2):
        x = x0 * (x @ low.V_kernels[layer].T @ low.W_kernels[layer].T + low.bias[layer]) + x
    torch.testing.assert_close(low(x0), x)
    x = x0
    for layer in range(2):
        scalar = x @ vec.kernels[layer]  # [B, 1]
        x = x0 * scalar + vec.bias[layer].squeeze(1) + x
    torch.testing.assert_close(vec(x0), x)
    with pytest.raises(ValueError, match="low_rank"):
        LowRankCrossNet(in_features=6, num_layers=1, low_rank=0)


def test_mixture_crossnet_with_one_expert_is_one_low_rank_expert() -> None:
    torch.manual_seed(2)
    x0 = torch.randn(3, 4)
    net = LowRankMixtureCrossNet(in_features=4, num_layers=1, num_experts=1, low_rank=2)
    _randomize(net)
    U, C, V = net.U_kernels[0][0], net.C_kernels[0][0], net.V_kernels[0][0]
    expert = torch.relu(torch.relu(x0 @ V.T) @ C.T) @ U.T
    torch.testing.assert_close(net(x0), x0 * (expert + net.bias[0].squeeze(1)) + x0)
    assert net.gates is None
    assert LowRankMixtureCrossNet(4, 1, num_experts=3)(x0).shape == (3, 4)


def test_factorization_machine_is_sum_of_pairwise_products() -> None:
    torch.manual_seed(3)
    a, b = torch.randn(2, 2, 3), torch.randn(2, 1, 2)
    flat = torch.cat([a.flatten(1), b.flatten(1)], dim=1)
    expected = torch.stack(
        [sum(row[i] * row[j] for i, j in itertools.combinations(range(8), 2)) for row in flat]
    ).unsqueeze(1)
    torch.testing.assert_close(FactorizationMachine()([a, b]), expected)
    dense = nn.Linear(8, 3)
    torch.testing.assert_close(DeepFM(dense)([a, b]), dense(flat))


def test_mlp_layers_and_activations() -> None:
    torch.manual_seed(4)
    x = torch.randn(5, 6)
    mlp = MLP(6, [4, 3], activation="sigmoid", activation_on_last=False)
    l0, l1 = mlp._mlp[0]._linear, mlp._mlp[1]._linear
    torch.testing.assert_close(mlp(x), l1(torch.sigmoid(l0(x))))
    assert list(mlp.state_dict()) == [
        "_mlp.0._linear.weight", "_mlp.0._linear.bias", "_mlp.1._linear.weight", "_mlp.1._linear.bias"
    ]
    swish = MLP(6, [4], activation="swish_layernorm")
    ln = swish._mlp[0]._activation_fn.norm[0]
    h = swish._mlp[0]._linear(x)
    torch.testing.assert_close(swish(x), h * torch.sigmoid(ln(h)))
    # a factory gives each layer its own module; a module instance is shared
    per_layer = MLP(6, [4, 4], activation=lambda: nn.PReLU())
    assert per_layer._mlp[0]._activation_fn is not per_layer._mlp[1]._activation_fn
    shared = nn.ReLU()
    assert extract_module_or_tensor_callable(shared) is shared
    assert extract_module_or_tensor_callable(torch.relu) is torch.relu
    assert isinstance(extract_module_or_tensor_callable(nn.ReLU), nn.ReLU)
    with pytest.raises(ValueError, match="tanh"):
        MLP(6, [4], activation="tanh")
    assert Perceptron(6, 2, bias=False)._linear.bias is None


def test_swish_layernorm_and_scripting_after_fx() -> None:
    x = torch.randn(3, 4)
    sln = SwishLayerNorm(4)
    torch.testing.assert_close(sln(x), x * torch.sigmoid(nn.functional.layer_norm(x, (4,))))
    for module in (sln, CrossNet(4, 2), MLP(4, [3, 2]), FactorizationMachine()):
        scripted = torch.jit.script(symbolic_trace(module))
        arg = [x.unsqueeze(1)] if isinstance(module, FactorizationMachine) else x
        torch.testing.assert_close(scripted(arg), module(arg))


def test_deterministic_dedup_keeps_last_occurrence() -> None:
    ids, last = deterministic_dedup(torch.tensor([5, 3, 5, 1, 3]))
    assert ids.tolist() == [1, 3, 5]
    assert last.tolist() == [3, 4, 2]
