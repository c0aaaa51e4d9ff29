"""Per-feature processors for ``FeatureProcessedEmbeddingBagCollection`` (TorchRec's
``torchrec.modules.feature_processor_``): position weighting of one ``JaggedTensor``
(:class:`PositionWeightedModule`) or of every listed feature of a KJT
(:class:`PositionWeightedModuleCollection`). See ``feature_processor`` for the weighting.

``pre_process_input`` writes each value's position into the KJT's (float) weights ahead of
time, and the module then reads positions from the weights instead of recomputing them: the
split used by pipelines that run the processor after an input redistribution.
"""

import abc
from collections.abc import Mapping

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from recsys_core.modules.feature_processor import offsets_to_range_traceble
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor
from recsys_core.types import CopyMixIn


class FeatureProcessor(nn.Module):
    """Maps one feature's ``JaggedTensor`` to a processed one (typically new weights)."""

    @abc.abstractmethod
    def forward(self, features: JaggedTensor) -> JaggedTensor:
        pass


def _positions(features: JaggedTensor | KeyedJaggedTensor, pre_processed: bool) -> torch.Tensor:
    """Each value's position in its bag: from the weights where ``pre_process_input`` stored
    it, else computed from the offsets."""
    if pre_processed:
        return features.weights().clone().to(torch.int64)
    return offsets_to_range_traceble(features.offsets(), features.values())


class PositionWeightedModule(FeatureProcessor):
    """Learnable weight per position ``[0, max_feature_length)`` of one feature (start 1.0)."""

    def __init__(self, max_feature_length: int, device: torch.device | None = None) -> None:
        super().__init__()
        if max_feature_length <= 0:
            raise ValueError(
                f"PositionWeightedModule: max_feature_length must be > 0, got {max_feature_length}"
            )
        self.position_weight = nn.Parameter(
            torch.empty([max_feature_length], device=device), requires_grad=True
        )
        self._pre_processed = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.position_weight.fill_(1.0)

    def forward(self, features: JaggedTensor) -> JaggedTensor:
        seq = _positions(features, self._pre_processed)
        return JaggedTensor(
            values=features.values(),
            lengths=features.lengths(),
            offsets=features.offsets(),
            weights=torch.gather(self.position_weight, dim=0, index=seq),
        )

    def pre_process_input(self, features: JaggedTensor) -> None:
        """Store positions in ``features``' weights (in place); forward then reads them."""
        self._pre_processed = True
        seq = offsets_to_range_traceble(features.offsets(), features.values())
        features.weights().copy_(seq.to(torch.float32))


class FeatureProcessorsCollection(nn.Module):
    """Maps a ``KeyedJaggedTensor`` to one with processed weights (same keys and ids)."""

    @abc.abstractmethod
    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        pass


@torch.fx.wrap
def get_weights_list(
    cat_seq: torch.Tensor,
    features: KeyedJaggedTensor,
    position_weights: dict[str, nn.Parameter],
) -> torch.Tensor | None:
    """Position weights of the listed features, 1.0 for every other feature's ids."""
    weights = []
    seqs = torch.split(cat_seq, features.length_per_key())
    for key, seq in zip(features.keys(), seqs, strict=True):
        if key in position_weights:
            weights.append(torch.gather(position_weights[key], dim=0, index=seq))
        else:
            weights.append(torch.ones(seq.shape[0], device=features.values().device))
    return torch.cat(weights) if weights else features.weights_or_none()


@torch.fx.wrap
def get_stride_per_key_per_rank(kjt: KeyedJaggedTensor) -> list[list[int]] | None:
    return kjt.stride_per_key_per_rank() if kjt.variable_stride_per_key() else None


class PositionWeightedModuleCollection(FeatureProcessorsCollection, CopyMixIn):
    """Position weights for the KJT features named in ``max_feature_lengths``; the output
    keeps every key, with weight 1.0 for features not listed."""

    def __init__(
        self, max_feature_lengths: dict[str, int], device: torch.device | None = None
    ) -> None:
        super().__init__()
        for key, length in max_feature_lengths.items():
            if length <= 0:
                raise ValueError(
                    f"PositionWeightedModuleCollection: max_feature_lengths[{key!r}] must be "
                    f"> 0, got {length}"
                )
        self.max_feature_lengths = max_feature_lengths
        self._pre_processed = False
        self.position_weights: nn.ParameterDict = nn.ParameterDict()
        # a plain dict view of the same parameters: what the fx-wrapped function receives
        self.position_weights_dict: dict[str, nn.Parameter] = {}
        for key, length in max_feature_lengths.items():
            self.position_weights[key] = nn.Parameter(torch.empty([length], device=device))
        self.reset_parameters()

    def _sync_dict(self) -> None:
        for key, param in self.position_weights.items():
            self.position_weights_dict[key] = param

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for key in self.max_feature_lengths:
                self.position_weights[key].fill_(1.0)
        self._sync_dict()

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        cat_seq = _positions(features, self._pre_processed)
        return KeyedJaggedTensor(
            keys=features.keys(),
            values=features.values(),
            weights=get_weights_list(cat_seq, features, self.position_weights_dict),
            lengths=features.lengths(),
            offsets=features.offsets(),
            stride=features.stride(),
            length_per_key=features.length_per_key(),
            stride_per_key_per_rank=get_stride_per_key_per_rank(features),
        )

    def copy(self, device: torch.device) -> nn.Module:
        self.position_weights = self.position_weights.to(device=device)
        self._sync_dict()
        return self

    def _apply(self, *args, **kwargs) -> nn.Module:  # noqa: ANN002, ANN003 - nn.Module's
        super()._apply(*args, **kwargs)
        self._sync_dict()
        return self

    def load_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        result = super().load_state_dict(state_dict, strict, assign)
        self._sync_dict()
        return result

    def pre_process_input(self, features: KeyedJaggedTensor) -> None:
        """Store positions in ``features``' weights (in place); forward then reads them."""
        self._pre_processed = True
        seq = offsets_to_range_traceble(features.offsets(), features.values())
        features.weights().copy_(seq.to(torch.float32))


__all__ = [
    "FeatureProcessor",
    "FeatureProcessorsCollection",
    "PositionWeightedModule",
    "PositionWeightedModuleCollection",
    "get_stride_per_key_per_rank",
    "get_weights_list",
]
