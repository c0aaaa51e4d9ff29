"""A small DeepFM network (TorchRec's ``torchrec.models.deepfm``; arXiv:1703.04247).

Shapes (B samples, F sparse features, D embedding dim, H = deep_fm_dimension)::

    dense_features [B, in] --DenseArch--> [B, D] ---------------+
    sparse_features (KJT)  --SparseArch-> KeyedTensor (F x D) --FMInteractionArch-->
        [B, D + H + 1] (dense, DeepFM output, FM term) --OverArch--> sigmoid [B, 1]
"""

import torch
from torch import nn

from recsys_core.models.dlrm import _common_embedding_dim, _FourArches, _model_input_output
from recsys_core.modules.deepfm import DeepFM, FactorizationMachine
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.sparse import KeyedJaggedTensor, KeyedTensor


class SparseArch(nn.Module):
    """The embedding bag collection: KJT -> ``KeyedTensor``."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        self.embedding_bag_collection: EmbeddingBagCollection = embedding_bag_collection

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return self.embedding_bag_collection(features)


class DenseArch(nn.Module):
    """``Linear -> ReLU -> Linear -> ReLU``: ``[B, in_features] -> [B, embedding_dim]``."""

    def __init__(self, in_features: int, hidden_layer_size: int, embedding_dim: int) -> None:
        super().__init__()
        self.model: nn.Module = nn.Sequential(
            nn.Linear(in_features, hidden_layer_size),
            nn.ReLU(),
            nn.Linear(hidden_layer_size, embedding_dim),
            nn.ReLU(),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class FMInteractionArch(nn.Module):
    """Dense vector + each sparse feature's pooled embedding -> ``[dense, DeepFM, FM]``.

    ``fm_in_features`` is the flattened width (dense dim + sum of feature dims); the DeepFM
    part is ``Linear(fm_in_features, deep_fm_dimension) -> ReLU``.
    """

    def __init__(
        self, fm_in_features: int, sparse_feature_names: list[str], deep_fm_dimension: int
    ) -> None:
        super().__init__()
        self.sparse_feature_names: list[str] = sparse_feature_names
        self.deep_fm = DeepFM(
            dense_module=nn.Sequential(nn.Linear(fm_in_features, deep_fm_dimension), nn.ReLU())
        )
        self.fm = FactorizationMachine()

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedTensor) -> torch.Tensor:
        if len(self.sparse_feature_names) == 0:
            return dense_features
        tensors: list[torch.Tensor] = [dense_features]
        for name in self.sparse_feature_names:
            tensors.append(sparse_features[name])
        deep = self.deep_fm(tensors)
        fm = self.fm(tensors)
        return torch.cat([dense_features, deep, fm], dim=1)


class OverArch(nn.Module):
    """``Linear(in_features, 1) -> Sigmoid``: probabilities, not logits."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.model: nn.Module = nn.Sequential(nn.Linear(in_features, 1), nn.Sigmoid())

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class SimpleDeepFMNN(_FourArches):
    """DeepFM over a dense input and an embedding bag collection (one embedding dim).

    ``forward(dense_features [B, num_dense_features], sparse_features KJT) -> [B, 1]`` in
    (0, 1) (the over arch ends in a sigmoid).
    """

    def __init__(
        self,
        num_dense_features: int,
        embedding_bag_collection: EmbeddingBagCollection,
        hidden_layer_size: int,
        deep_fm_dimension: int,
    ) -> None:
        super().__init__()
        embedding_dim = _common_embedding_dim(embedding_bag_collection, "SimpleDeepFMNN")
        feature_names: list[str] = []
        fm_in_features = embedding_dim
        for conf in embedding_bag_collection.embedding_bag_configs():
            for name in conf.feature_names:
                feature_names.append(name)
                fm_in_features += conf.embedding_dim
        self.sparse_arch = SparseArch(embedding_bag_collection)
        self.dense_arch = DenseArch(num_dense_features, hidden_layer_size, embedding_dim)
        self.inter_arch = FMInteractionArch(fm_in_features, feature_names, deep_fm_dimension)
        self.over_arch = OverArch(embedding_dim + deep_fm_dimension + 1)


class SimpleDeepFMNNWrapper(SimpleDeepFMNN):
    """SimpleDeepFMNN over a ``ModelInput``-like batch (``float_features``,
    ``idlist_features``, ``label``): training returns ``(loss, pred)``, eval ``pred``. As in
    TorchRec the loss is BCE-with-logits applied to the model's (already sigmoid) output."""

    def forward(self, model_input) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        pred = super().forward(model_input.float_features, model_input.idlist_features)
        return _model_input_output(pred, model_input, self.training)


__all__ = ["DenseArch", "FMInteractionArch", "OverArch", "SimpleDeepFMNN",
    "SimpleDeepFMNNWrapper",
    "SparseArch",
]
