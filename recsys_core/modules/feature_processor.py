"""Position-weighted feature processors over dicts and KJTs (TorchRec's
``torchrec.modules.feature_processor``; the per-feature ``JaggedTensor`` versions used by
``FeatureProcessedEmbeddingBagCollection`` are in ``feature_processor_``).

Position weighting gives the id at position ``p`` of its bag (0-based) the learnable weight
``position_weights[feature][p]``; a weighted embedding bag then sums ``w_p * row(id)``::

    lengths [2, 3]   values [a b | c d e]   positions [0 1 | 0 1 2]
    weights = position_weights[feature][[0, 1, 0, 1, 2]]

Every weight starts at 1.0, so an untrained processor changes nothing. A position at or beyond
``max_feature_length`` is an indexing error (the bag is longer than the feature allows).
"""

import abc
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor
from recsys_core.sparse._fx import is_fx_tracing


@torch.fx.wrap
def offsets_to_range_traceble(offsets: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Each value's position inside its bag: ``[0, 1, .., len_0 - 1, 0, 1, ...]`` (int64)."""
    offsets = offsets.long()
    lengths = offsets[1:] - offsets[:-1]
    n = values.numel()
    starts = torch.repeat_interleave(offsets[:-1], lengths, output_size=n)
    return torch.arange(n, device=values.device, dtype=torch.long) - starts


def _check_lengths(max_feature_lengths: dict[str, int], owner: str) -> None:
    for key, length in max_feature_lengths.items():
        if length <= 0:
            raise ValueError(f"{owner}: max_feature_lengths[{key!r}] must be > 0, got {length}")


class BaseFeatureProcessor(nn.Module):
    """Maps per-feature ``JaggedTensor`` s to processed ``JaggedTensor`` s."""

    @abc.abstractmethod
    def forward(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        pass


@torch.fx.wrap
def position_weighted_module_update_features(
    features: dict[str, JaggedTensor], weighted_features: dict[str, JaggedTensor]
) -> dict[str, JaggedTensor]:
    features.update(weighted_features)
    return features


class PositionWeightedModule(BaseFeatureProcessor):
    """Position weights for the features named in ``max_feature_lengths``, over a dict of
    ``JaggedTensor``; other features pass through. Updates and returns the input dict."""

    def __init__(
        self, max_feature_lengths: dict[str, int], device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.max_feature_lengths = max_feature_lengths
        self.position_weights: nn.ParameterDict = nn.ParameterDict()
        for key, length in max_feature_lengths.items():
            self.position_weights[key] = nn.Parameter(torch.empty([length], device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for key in self.max_feature_lengths:
                self.position_weights[key].fill_(1.0)

    def forward(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        weighted: dict[str, JaggedTensor] = {}
        for key, position_weight in self.position_weights.items():
            jt = features[key]
            seq = offsets_to_range_traceble(jt.offsets(), jt.values())
            weighted[key] = JaggedTensor(
                values=jt.values(),
                lengths=jt.lengths(),
                offsets=jt.offsets(),
                weights=torch.gather(position_weight, dim=0, index=seq),
            )
        return position_weighted_module_update_features(features, weighted)


class BaseGroupedFeatureProcessor(nn.Module):
    """Maps a ``KeyedJaggedTensor`` to a processed ``KeyedJaggedTensor``."""

    @abc.abstractmethod
    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        pass


class PositionWeightedProcessor(BaseGroupedFeatureProcessor):
    """Position weights over a KJT (TorchRec's grouped processor).

    Returns a KJT of ONLY the features named in ``max_feature_lengths`` (in input order), with
    their position weights; a KJT without any of them is returned unchanged. If the input
    already carries weights they are read as the positions (pre-computed upstream).
    The state dict holds only ``position_weights.<feature>`` and there are no buffers.
    """

    def __init__(
        self, max_feature_lengths: dict[str, int], device: torch.device | None = None
    ) -> None:
        super().__init__()
        _check_lengths(max_feature_lengths, "PositionWeightedProcessor")
        self.max_feature_lengths = max_feature_lengths
        self.position_weights: nn.ParameterDict = nn.ParameterDict()
        for key, length in max_feature_lengths.items():
            self.position_weights[key] = nn.Parameter(torch.empty([length], device=device).fill_(1.0))

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if is_fx_tracing():
            # traced graphs see the processed features only, in parameter order
            per_key = features.to_dict()
            keys: list[str] = []
            values: list[torch.Tensor] = []
            lengths: list[torch.Tensor] = []
            weights: list[torch.Tensor] = []
            for key, position_weight in self.position_weights.items():
                jt = per_key[key]
                seq = offsets_to_range_traceble(jt.offsets(), jt.values())
                keys.append(key)
                values.append(jt.values())
                lengths.append(jt.lengths())
                weights.append(torch.gather(position_weight, dim=0, index=seq))
            return KeyedJaggedTensor.from_lengths_sync(
                keys=keys,
                values=torch.cat(values),
                lengths=torch.cat(lengths),
                weights=torch.cat(weights),
            )
        names = features.keys()
        processed = [n for n in names if n in self.max_feature_lengths]
        if not processed:
            return features
        in_weights = features.weights_or_none()
        all_seq = (
            offsets_to_range_traceble(features.offsets(), features.values())
            if in_weights is None
            else in_weights.long()
        )
        length_per_key = features.length_per_key()
        seqs = torch.split(all_seq, length_per_key)
        vbe = features.variable_stride_per_key()
        if len(processed) == len(names):
            new_weights = [
                torch.gather(self.position_weights[n], dim=0, index=seqs[i])
                for i, n in enumerate(names)
            ]
            return KeyedJaggedTensor(
                keys=names,
                values=features.values(),
                weights=torch.cat(new_weights),
                lengths=features.lengths(),
                offsets=features.offsets(),
                stride=features.stride(),
                length_per_key=length_per_key,
                offset_per_key=features.offset_per_key(),
                stride_per_key_per_rank=features.stride_per_key_per_rank() if vbe else None,
            )
        values_per_key = features.values().split(length_per_key)
        lengths_per_key = features.lengths().split(
            [sum(s) for s in features.stride_per_key_per_rank()] if vbe else features.stride()
        )
        keep = [i for i, n in enumerate(names) if n in self.max_feature_lengths]
        return KeyedJaggedTensor.from_lengths_sync(
            keys=[names[i] for i in keep],
            values=torch.cat([values_per_key[i] for i in keep]),
            lengths=torch.cat([lengths_per_key[i] for i in keep]),
            weights=torch.cat(
                [torch.gather(self.position_weights[names[i]], 0, seqs[i]) for i in keep]
            ),
            stride_per_key_per_rank=(
                [features.stride_per_key_per_rank()[i] for i in keep] if vbe else None
            ),
        )

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ()

    def state_dict(  # type: ignore[override]
        self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        if destination is None:
            destination = OrderedDict()
            destination._metadata = OrderedDict()
        for name, param in self.position_weights.items():
            destination[f"{prefix}position_weights.{name}"] = param if keep_vars else param.detach()
        return destination


__all__ = [
    "BaseFeatureProcessor",
    "BaseGroupedFeatureProcessor",
    "PositionWeightedModule",
    "PositionWeightedProcessor",
    "offsets_to_range_traceble",
    "position_weighted_module_update_features",
]
