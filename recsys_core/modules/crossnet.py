"""Cross networks (DCN, DCN-v2; TorchRec's ``torchrec.modules.crossnet``).

Every variant maps ``[B, N] -> [B, N]`` with ``num_layers`` crossing steps
``x_{l+1} = x_0 * f_l(x_l) + x_l`` and differs only in ``f_l``. Parameters are created in
TorchRec's order with TorchRec's initializers (xavier-normal kernels, zero biases), so a seeded
model starts from the same weights and state dicts use the same names.
"""

from collections.abc import Callable

import torch
from torch import nn


def _xavier(*shape: int) -> nn.Parameter:
    return nn.Parameter(nn.init.xavier_normal_(torch.empty(*shape)))


def _zeros(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape))


def _per_layer(
    num_layers: int, init: Callable[..., nn.Parameter], *shape: int
) -> nn.ParameterList:
    """One ``init(*shape)`` parameter per layer, made in layer order."""
    return nn.ParameterList(init(*shape) for _ in range(num_layers))


class CrossNet(nn.Module):
    """Full-rank cross network: ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l`` with ``W_l`` N x N.

    Example::

        dcn = CrossNet(in_features=10, num_layers=2)
        assert dcn(torch.randn(3, 10)).shape == (3, 10)
    """

    def __init__(self, in_features: int, num_layers: int) -> None:
        super().__init__()
        self._num_layers = num_layers
        self.kernels: nn.ParameterList = _per_layer(num_layers, _xavier, in_features, in_features)
        self.bias: nn.ParameterList = _per_layer(num_layers, _zeros, in_features, 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x_0 = input.unsqueeze(2)  # (B, N, 1)
        x_l = x_0
        for layer in range(self._num_layers):
            x_l = x_0 * (torch.matmul(self.kernels[layer], x_l) + self.bias[layer]) + x_l
        return x_l.squeeze(2)


class LowRankCrossNet(nn.Module):
    """DCN-v2 low-rank cross: ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``.

    ``W_l`` is N x r and ``V_l`` is r x N (``low_rank = r >= 1``): 2Nr instead of N^2 weights.
    """

    def __init__(self, in_features: int, num_layers: int, low_rank: int = 1) -> None:
        super().__init__()
        if low_rank < 1:
            raise ValueError(f"LowRankCrossNet: low_rank must be >= 1, got {low_rank}")
        self._num_layers = num_layers
        self._low_rank = low_rank
        self.W_kernels: nn.ParameterList = _per_layer(num_layers, _xavier, in_features, low_rank)
        self.V_kernels: nn.ParameterList = _per_layer(num_layers, _xavier, low_rank, in_features)
        self.bias: nn.ParameterList = _per_layer(num_layers, _zeros, in_features)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x_0 = input
        x_l = x_0
        for layer in range(self._num_layers):
            x_lv = nn.functional.linear(x_l, self.V_kernels[layer])
            x_lw = nn.functional.linear(x_lv, self.W_kernels[layer])
            x_l = x_0 * (x_lw + self.bias[layer]) + x_l
        return x_l


class VectorCrossNet(nn.Module):
    """DCN-v1 vector cross: ``x_{l+1} = x_0 * (w_l . x_l) + b_l + x_l`` with ``w_l`` an N-vector
    (the scalar ``w_l . x_l`` scales ``x_0``)."""

    def __init__(self, in_features: int, num_layers: int) -> None:
        super().__init__()
        self._num_layers = num_layers
        self.kernels: nn.ParameterList = _per_layer(num_layers, _xavier, in_features, 1)
        self.bias: nn.ParameterList = _per_layer(num_layers, _zeros, in_features, 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x_0 = input.unsqueeze(2)  # (B, N, 1)
        x_l = x_0
        for layer in range(self._num_layers):
            xl_w = torch.tensordot(x_l, self.kernels[layer], dims=([1], [0]))  # (B, 1, 1)
            x_l = torch.matmul(x_0, xl_w) + self.bias[layer] + x_l
        return x_l.squeeze(2)


class LowRankMixtureCrossNet(nn.Module):
    """DCN-v2 mixture of low-rank experts.

    Expert i of layer l: ``x_0 * (U_li g(C_li g(V_li x_l)) + b_l)`` with ``U`` N x r,
    ``C`` r x r, ``V`` r x N and ``g`` the activation; the layer adds the softmax-gated sum of
    its experts to ``x_l`` (one linear gate per expert on ``x_l``). With one expert there is no
    gate: the expert is added directly.
    """

    def __init__(
        self,
        in_features: int,
        num_layers: int,
        num_experts: int = 1,
        low_rank: int = 1,
        activation: nn.Module | Callable[[torch.Tensor], torch.Tensor] = torch.relu,
    ) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"LowRankMixtureCrossNet: num_experts must be >= 1, got {num_experts}")
        if low_rank < 1:
            raise ValueError(f"LowRankMixtureCrossNet: low_rank must be >= 1, got {low_rank}")
        self._num_layers = num_layers
        self._num_experts = num_experts
        self._low_rank = low_rank
        self._in_features = in_features
        self.U_kernels: nn.ParameterList = _per_layer(
            num_layers, _xavier, num_experts, in_features, low_rank
        )
        self.V_kernels: nn.ParameterList = _per_layer(
            num_layers, _xavier, num_experts, low_rank, in_features
        )
        self.bias: nn.ParameterList = _per_layer(num_layers, _zeros, in_features, 1)
        self.gates: nn.ModuleList | None = (
            nn.ModuleList(nn.Linear(in_features, 1, bias=False) for _ in range(num_experts))
            if num_experts > 1
            else None
        )
        self._activation = activation
        self.C_kernels: nn.ParameterList = _per_layer(
            num_layers, _xavier, num_experts, low_rank, low_rank
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x_0 = input.unsqueeze(2)  # (B, N, 1)
        x_l = x_0
        for layer in range(self._num_layers):
            experts = []
            for i in range(self._num_experts):
                e = torch.matmul(self.V_kernels[layer][i], x_l)  # (B, r, 1)
                e = torch.matmul(self.C_kernels[layer][i], self._activation(e))  # (B, r, 1)
                e = torch.matmul(self.U_kernels[layer][i], self._activation(e))  # (B, N, 1)
                experts.append((x_0 * (e + self.bias[layer])).squeeze(2))
            stacked = torch.stack(experts, 2)  # (B, N, K)
            gates = self.gates
            if gates is not None:
                gating = torch.stack([g(x_l.squeeze(2)) for g in gates], 1)  # (B, K, 1)
                x_l = torch.matmul(stacked, torch.softmax(gating, 1)) + x_l
            else:
                x_l = stacked + x_l
        return x_l.squeeze(2)


__all__ = ["CrossNet", "LowRankCrossNet", "LowRankMixtureCrossNet", "VectorCrossNet"]
