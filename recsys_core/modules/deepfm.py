"""DeepFM building blocks (TorchRec's ``torchrec.modules.deepfm``; arXiv:1703.04247).

Both modules take a list of embedding tensors ``[B, N_i, D_i]`` (any N and D, same B) and
flatten them into one ``[B, sum(N_i * D_i)]`` row per sample first.
"""

import torch
from torch import nn


@torch.fx.wrap
def _get_flatten_input(inputs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten(1) for t in inputs], dim=1)


class DeepFM(nn.Module):
    """The deep part: ``dense_module`` applied to the flattened, concatenated embeddings.

    Example::

        deepfm = DeepFM(dense_module=nn.Sequential(nn.Linear(192, 10), nn.ReLU()))
        out = deepfm([torch.randn(3, 2, 64), torch.randn(3, 2, 32)])  # (3, 10)
    """

    def __init__(self, dense_module: nn.Module) -> None:
        super().__init__()
        self.dense_module = dense_module

    def forward(self, embeddings: list[torch.Tensor]) -> torch.Tensor:
        return self.dense_module(_get_flatten_input(embeddings))


class FactorizationMachine(nn.Module):
    """Second-order interactions of all flattened input scalars ``v`` of each sample:
    ``0.5 * ((sum_i v_i)^2 - sum_i v_i^2) = sum_{i<j} v_i v_j``, shape ``[B, 1]``.

    As in TorchRec, the pairs range over every scalar of the flattened input (not over
    embedding vectors): ``FactorizationMachine()([x])`` equals ``sum_{i<j} x[:, i] * x[:, j]``.
    """

    def forward(self, embeddings: list[torch.Tensor]) -> torch.Tensor:
        v = _get_flatten_input(embeddings)
        total = torch.sum(v, dim=1, keepdim=True)
        return 0.5 * (total * total - torch.sum(v * v, dim=1, keepdim=True))


__all__ = ["DeepFM", "FactorizationMachine"]
