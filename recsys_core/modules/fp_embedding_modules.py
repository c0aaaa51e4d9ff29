"""An embedding bag collection behind feature processors (TorchRec's
``torchrec.modules.fp_embedding_modules``): the processors turn each feature's ids into
weights (e.g. position weights) and a weighted ``EmbeddingBagCollection`` pools ``w * row``."""

import torch
from torch import nn

from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.modules.feature_processor_ import FeatureProcessor, FeatureProcessorsCollection
from recsys_core.sparse import KeyedJaggedTensor, KeyedTensor


@torch.fx.wrap
def apply_feature_processors_to_kjt(
    features: KeyedJaggedTensor, feature_processors: dict[str, nn.Module]
) -> KeyedJaggedTensor:
    """The same KJT with weights from each key's processor (1.0 for keys without one)."""
    weights = []
    per_key = features.to_dict()
    for key in features.keys():
        jt = per_key[key]
        if key in feature_processors:
            weights.append(feature_processors[key](jt).weights())
        else:
            weights.append(torch.ones(jt.values().shape[0], device=jt.values().device))
    return KeyedJaggedTensor(
        keys=features.keys(),
        values=features.values(),
        weights=torch.cat(weights) if weights else features.weights_or_none(),
        lengths=features.lengths(),
        offsets=features.offsets(),
        stride=features.stride(),
        length_per_key=features.length_per_key(),
        offset_per_key=features.offset_per_key(),
    )


class FeatureProcessorDictWrapper(FeatureProcessorsCollection):
    """A ``ModuleDict`` of per-feature processors seen as one KJT processor."""

    def __init__(self, feature_processors: nn.ModuleDict) -> None:
        super().__init__()
        self._feature_processors = feature_processors

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return apply_feature_processors_to_kjt(features, self._feature_processors)


class FeatureProcessedEmbeddingBagCollection(nn.Module):
    """``ebc(processors(features))``.

    Args:
        embedding_bag_collection: a WEIGHTED collection (``is_weighted=True``).
        feature_processors: one :class:`FeatureProcessor` per feature of the collection
            (exactly its features), or one :class:`FeatureProcessorsCollection` for the KJT.

    State-dict keys: ``_embedding_bag_collection.*`` and ``_feature_processors.*`` (TorchRec's).
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        feature_processors: dict[str, FeatureProcessor] | FeatureProcessorsCollection,
    ) -> None:
        super().__init__()
        self._embedding_bag_collection = embedding_bag_collection
        feature_names: list[str] = []
        for config in embedding_bag_collection.embedding_bag_configs():
            for name in config.feature_names:
                if name not in feature_names:
                    feature_names.append(name)
        self._feature_processors: nn.ModuleDict | FeatureProcessorsCollection
        if isinstance(feature_processors, FeatureProcessorsCollection):
            self._feature_processors = feature_processors
        else:
            if set(feature_names) != set(feature_processors):
                raise ValueError(
                    "Passed in feature processors do not match feature names of embedding bag: "
                    f"processors for {sorted(feature_processors)}, features {sorted(feature_names)}"
                )
            self._feature_processors = nn.ModuleDict(feature_processors)
        if not embedding_bag_collection.is_weighted():
            raise ValueError(
                "EmbeddingBagCollection must accept weighted inputs for feature processor: "
                "build it with is_weighted=True"
            )
        self._feature_names: list[str] = feature_names

    def split(self) -> tuple[FeatureProcessorsCollection, EmbeddingBagCollection]:
        """The processors as one KJT processor, and the collection (what sharders need)."""
        if isinstance(self._feature_processors, nn.ModuleDict):
            return FeatureProcessorDictWrapper(self._feature_processors), self._embedding_bag_collection
        return self._feature_processors, self._embedding_bag_collection

    def is_weighted(self) -> bool:
        return self._embedding_bag_collection.is_weighted()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if isinstance(self._feature_processors, FeatureProcessorsCollection):
            fp_features = self._feature_processors(features)
        else:
            per_key = features.to_dict()
            values, lengths, weights = [], [], []
            for key in self._feature_names:
                jt = self._feature_processors[key](per_key[key])
                values.append(jt.values())
                lengths.append(jt.lengths())
                weights.append(jt.weights())
            fp_features = KeyedJaggedTensor(
                keys=self._feature_names,
                values=torch.cat(values),
                lengths=torch.cat(lengths),
                weights=torch.cat(weights),
            )
        return self._embedding_bag_collection(fp_features)


__all__ = [
    "FeatureProcessedEmbeddingBagCollection",
    "FeatureProcessorDictWrapper",
    "apply_feature_processors_to_kjt",
]
