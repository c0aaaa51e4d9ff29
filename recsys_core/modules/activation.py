"""Activation modules (TorchRec's ``torchrec.modules.activation``)."""

import torch
from torch import nn


class SwishLayerNorm(nn.Module):
    """Swish with layer normalization: ``y = x * sigmoid(LayerNorm(x))``.

    Args:
        input_dims: the trailing dimensions to normalize over (as ``nn.LayerNorm``): for an
            input of shape ``[B, d1, d2]``, ``input_dims=[d1, d2]`` normalizes both.
        device: where the LayerNorm's affine parameters live.

    The state dict holds ``norm.0.weight`` and ``norm.0.bias`` (TorchRec's names).
    """

    def __init__(
        self,
        input_dims: int | list[int] | torch.Size,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.norm: nn.Sequential = nn.Sequential(
            nn.LayerNorm(input_dims, device=device),
            nn.Sigmoid(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input * self.norm(input)


__all__ = ["SwishLayerNorm"]
