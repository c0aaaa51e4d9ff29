"""Multi-layer perceptrons (TorchRec's ``torchrec.modules.mlp``).

Parameter names follow TorchRec (``_mlp.0._linear.weight``, ...) so state dicts load across.
"""

from collections.abc import Callable

import torch
from torch import nn

from recsys_core.modules.activation import SwishLayerNorm
from recsys_core.modules.utils import extract_module_or_tensor_callable

Activation = nn.Module | Callable[[torch.Tensor], torch.Tensor]


class Perceptron(nn.Module):
    """``activation(x @ W.T + b)``: one linear layer and its activation.

    Args:
        in_size: features per input row.
        out_size: features per output row.
        bias: learn an additive bias.
        activation: a module or tensor function applied to the linear output (default relu).
        device, dtype: of the linear layer's parameters.

    Example::

        p = Perceptron(40, 16)
        assert p(torch.randn(3, 40)).shape == (3, 16)
    """

    def __init__(
        self,
        in_size: int,
        out_size: int,
        bias: bool = True,
        activation: Activation = torch.relu,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self._in_size = in_size
        self._out_size = out_size
        self._linear: nn.Linear = nn.Linear(in_size, out_size, bias=bias, device=device, dtype=dtype)
        self._activation_fn: Callable[[torch.Tensor], torch.Tensor] = activation

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._activation_fn(self._linear(input))


_NAMED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
}


class MLP(nn.Module):
    """A stack of :class:`Perceptron` layers of widths ``layer_sizes``.

    Args:
        in_size: features per input row.
        layer_sizes: output width of each layer.
        bias: learn an additive bias in every layer.
        activation: ``"relu"``, ``"sigmoid"``, ``"swish_layernorm"`` (a :class:`SwishLayerNorm`
            per layer), a module or tensor function (shared by all layers), or a zero-argument
            factory returning a module (called once per layer: no shared parameters).
        device, dtype: of the parameters.
        activation_on_last: apply the activation after the last layer too (default True).

    Example::

        mlp = MLP(40, [16, 8, 4])
        assert mlp(torch.randn(3, 40)).shape == (3, 4)
    """

    def __init__(
        self,
        in_size: int,
        layer_sizes: list[int],
        bias: bool = True,
        activation: str | Callable[[], nn.Module] | Activation = torch.relu,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        activation_on_last: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(activation, str):
            if activation not in _NAMED_ACTIVATIONS and activation != "swish_layernorm":
                raise ValueError(
                    f"MLP activation {activation!r} is not supported: use 'relu', 'sigmoid', "
                    "'swish_layernorm', a module, or a callable"
                )
            activation = _NAMED_ACTIVATIONS.get(activation, activation)
        layers = []
        for i, out_size in enumerate(layer_sizes):
            if not activation_on_last and i == len(layer_sizes) - 1:
                act: Activation = nn.Identity()
            elif isinstance(activation, str):  # "swish_layernorm": the other names are resolved
                act = SwishLayerNorm(out_size, device=device)
            else:
                act = extract_module_or_tensor_callable(activation)
            in_i = layer_sizes[i - 1] if i > 0 else in_size
            layers.append(Perceptron(in_i, out_size, bias, act, device=device, dtype=dtype))
        self._mlp: nn.Module = nn.Sequential(*layers)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._mlp(input)


__all__ = ["MLP", "Perceptron"]
