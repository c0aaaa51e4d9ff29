"""Embedding towers (TorchRec's ``torchrec.modules.embedding_tower``): an embedding module
followed by an interaction module, sharded as one unit so the interaction runs where its
embeddings live; a collection of towers concatenates their outputs."""


import torch
from torch import nn

from recsys_core.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recsys_core.sparse import KeyedJaggedTensor


def tower_input_params(module: nn.Module) -> tuple[bool, bool]:
    """Which inputs a tower's embedding module takes: ``(features, weighted_features)``.

    An ``EmbeddingCollection`` takes the unweighted KJT, an ``EmbeddingBagCollection`` the one
    matching its ``is_weighted()``, any other module both.
    """
    if isinstance(module, EmbeddingCollection):
        return True, False
    if isinstance(module, EmbeddingBagCollection):
        return not module.is_weighted(), module.is_weighted()
    return True, True


class EmbeddingTower(nn.Module):
    """``interaction(embedding(*args, **kwargs))``."""

    def __init__(
        self,
        embedding_module: nn.Module,
        interaction_module: nn.Module,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.embedding = embedding_module
        self.interaction = interaction_module

    def forward(self, *args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003 - any embedding
        return self.interaction(self.embedding(*args, **kwargs))


class EmbeddingTowerCollection(nn.Module):
    """Runs each tower on the inputs its embedding module takes (see
    :func:`tower_input_params`) and concatenates the outputs along dim 1."""

    def __init__(self, towers: list[EmbeddingTower], device: torch.device | None = None) -> None:
        super().__init__()
        self.towers = nn.ModuleList(towers)
        self._input_params: list[tuple[bool, bool]] = [
            tower_input_params(t.embedding) for t in towers
        ]

    def forward(
        self,
        features: KeyedJaggedTensor | None = None,
        weighted_features: KeyedJaggedTensor | None = None,
    ) -> torch.Tensor:
        outputs = []
        for i, (tower, (takes_kjt, takes_wkjt)) in enumerate(
            zip(self.towers, self._input_params, strict=True)
        ):
            if takes_kjt and features is None:
                raise ValueError(f"EmbeddingTowerCollection: tower {i} needs `features`")
            if takes_wkjt and weighted_features is None:
                raise ValueError(f"EmbeddingTowerCollection: tower {i} needs `weighted_features`")
            if takes_kjt and takes_wkjt:
                outputs.append(tower(features, weighted_features))
            elif takes_wkjt:
                outputs.append(tower(weighted_features))
            else:
                outputs.append(tower(features))
        return torch.cat(outputs, dim=1)


__all__ = ["EmbeddingTower", "EmbeddingTowerCollection", "tower_input_params"]
