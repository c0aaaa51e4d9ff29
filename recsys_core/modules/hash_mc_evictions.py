"""Eviction policies of ``HashZchManagedCollisionModule`` (TorchRec's
``torchrec.modules.hash_mc_evictions``).

Each id carries a score into the hash kernel and each slot keeps the score of the id that last
touched it. A slot is evictable for a new id when the slot's score is below the current
threshold (its time to live is over) and below the new id's score. Scores are hours since the
epoch::

    SINGLE_TTL_EVICTION       score = now_hour + single_ttl       threshold = now_hour
    PER_FEATURE_TTL_EVICTION  score = now_hour + ttl of the id's feature
    LRU_EVICTION              scores as SINGLE_TTL; a new id with no empty slot on its probe path
                              takes the expired slot with the oldest score
"""


import logging
import time
import warnings
from dataclasses import dataclass
from enum import Enum, unique

import torch

from recsys_core.sparse import JaggedTensor

logger = logging.getLogger(__name__)

__all__ = [
    "HashZchEvictionConfig",
    "HashZchEvictionModule",
    "HashZchEvictionPolicyName",
    "HashZchEvictionScorer",
    "HashZchOptEvictionModule",
    "HashZchPerFeatureTtlScorer",
    "HashZchSingleTtlScorer",
    "HashZchThresholdEvictionModule",
    "get_eviction_module",
    "get_eviction_scorer",
    "get_kernel_from_policy",
]


@unique
class HashZchEvictionPolicyName(Enum):
    SINGLE_TTL_EVICTION = "SINGLE_TTL_EVICTION"
    """Evict ids not seen for ``single_ttl`` hours."""
    PER_FEATURE_TTL_EVICTION = "PER_FEATURE_TTL_EVICTION"
    """Evict ids not seen for their feature's TTL (``per_feature_ttl``, one per feature)."""
    LRU_EVICTION = "LRU_EVICTION"
    """Evict the least recently seen expired id on the probe path."""


def _scripted_class(cls: type) -> type:
    """``torch.jit.script(cls)`` (as TorchRec's config is, so scripted modules can hold it)
    without torch's deprecation notice, which torch 2.14 prints at import (a FutureWarning) for
    every program that imports the managed-collision modules."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated")
        return torch.jit.script(cls)


@_scripted_class
@dataclass
class HashZchEvictionConfig:
    """What a TTL policy needs: the features (in input order) and their time to live in hours."""

    features: list[str]
    single_ttl: int | None = None
    per_feature_ttl: list[int] | None = None


@torch.fx.wrap
def get_kernel_from_policy(policy_name: HashZchEvictionPolicyName | None) -> int:
    """The hash kernel's eviction mode: 1 for LRU, else 0."""
    return 1 if policy_name is not None and policy_name == HashZchEvictionPolicyName.LRU_EVICTION else 0


def _hour() -> int:
    return int(time.time() / 3600)


class HashZchEvictionScorer:
    """No scores (ids never expire)."""

    def __init__(self, config: HashZchEvictionConfig) -> None:
        self._config: HashZchEvictionConfig = config

    def gen_score(self, feature: JaggedTensor, device: torch.device) -> torch.Tensor:
        return torch.empty(0, device=device)

    def gen_threshold(self) -> int:
        return -1


class HashZchSingleTtlScorer(HashZchEvictionScorer):
    """Every id scores ``now_hour + single_ttl``."""

    def gen_score(self, feature: JaggedTensor, device: torch.device) -> torch.Tensor:
        ttl = self._config.single_ttl
        if ttl is None:
            raise ValueError(
                "HashZchSingleTtlScorer: HashZchEvictionConfig.single_ttl is not set; the "
                "SINGLE_TTL and LRU eviction policies need a time to live in hours"
            )
        return torch.full_like(
            feature.values(), ttl + _hour(), dtype=torch.int32, device=device
        )

    def gen_threshold(self) -> int:
        return _hour()


class HashZchPerFeatureTtlScorer(HashZchEvictionScorer):
    """An id scores ``now_hour + its feature's TTL``; the feature of each id comes from the
    input's weights, which carry the ids per feature (``ManagedCollisionCollection`` passes
    them)."""

    def __init__(self, config: HashZchEvictionConfig) -> None:
        super().__init__(config)
        ttls = config.per_feature_ttl
        if ttls is None or len(ttls) != len(config.features):
            raise ValueError(
                "HashZchPerFeatureTtlScorer: per_feature_ttl must give one TTL per feature "
                f"({len(config.features)} features {config.features}, got {ttls})"
            )
        self._per_feature_ttl = torch.tensor(ttls, dtype=torch.int32)

    def gen_score(self, feature: JaggedTensor, device: torch.device) -> torch.Tensor:
        per_feature = feature.weights()
        if per_feature.size(0) != self._per_feature_ttl.size(0):
            raise ValueError(
                f"HashZchPerFeatureTtlScorer: the input has {per_feature.size(0)} features but "
                f"per_feature_ttl has {self._per_feature_ttl.size(0)}"
            )
        scores = self._per_feature_ttl.repeat_interleave(per_feature.to(torch.int64)) + _hour()
        return scores.to(device=device)

    def gen_threshold(self) -> int:
        return _hour()


@torch.fx.wrap
def get_eviction_scorer(
    policy_name: HashZchEvictionPolicyName, config: HashZchEvictionConfig
) -> HashZchEvictionScorer:
    if policy_name == HashZchEvictionPolicyName.PER_FEATURE_TTL_EVICTION:
        return HashZchPerFeatureTtlScorer(config)
    if policy_name in (
        HashZchEvictionPolicyName.SINGLE_TTL_EVICTION,
        HashZchEvictionPolicyName.LRU_EVICTION,
    ):
        return HashZchSingleTtlScorer(config)
    return HashZchEvictionScorer(config)


class HashZchThresholdEvictionModule(torch.nn.Module):
    """Scores each id and gives the current threshold (TTL and LRU policies)."""

    _eviction_scorer: HashZchEvictionScorer

    def __init__(
        self, policy_name: HashZchEvictionPolicyName, config: HashZchEvictionConfig
    ) -> None:
        super().__init__()
        self._policy_name: HashZchEvictionPolicyName = policy_name
        self._config: HashZchEvictionConfig = config
        self._eviction_scorer = get_eviction_scorer(policy_name, config)

    def forward(self, feature: JaggedTensor, device: torch.device) -> tuple[torch.Tensor, int]:
        return (
            self._eviction_scorer.gen_score(feature, device),
            self._eviction_scorer.gen_threshold(),
        )


class HashZchOptEvictionModule(torch.nn.Module):
    """A policy that needs no per-id scores: returns ``(None, -1)``."""

    def __init__(self, policy_name: HashZchEvictionPolicyName) -> None:
        super().__init__()
        self._policy_name: HashZchEvictionPolicyName = policy_name

    def forward(self, feature: JaggedTensor, device: torch.device) -> tuple[None, int]:
        return None, -1


@torch.fx.wrap
def get_eviction_module(
    policy_name: HashZchEvictionPolicyName, config: HashZchEvictionConfig | None
) -> torch.nn.Module:
    if policy_name in (
        HashZchEvictionPolicyName.SINGLE_TTL_EVICTION,
        HashZchEvictionPolicyName.PER_FEATURE_TTL_EVICTION,
        HashZchEvictionPolicyName.LRU_EVICTION,
    ):
        if config is None:
            raise ValueError(
                f"eviction policy {policy_name.value} needs a HashZchEvictionConfig "
                "(eviction_config=...)"
            )
        return HashZchThresholdEvictionModule(policy_name, config)
    return HashZchOptEvictionModule(policy_name)


class HashZchEvictionModule(torch.nn.Module):
    """The eviction policy of a hash module: ``forward(feature) -> (scores or None,
    threshold)``."""

    def __init__(
        self,
        policy_name: HashZchEvictionPolicyName,
        device: torch.device,
        config: HashZchEvictionConfig | None,
    ) -> None:
        super().__init__()
        self._policy_name: HashZchEvictionPolicyName = policy_name
        self._device: torch.device = device
        self._eviction_module: torch.nn.Module = get_eviction_module(policy_name, config)

    def forward(self, feature: JaggedTensor) -> tuple[torch.Tensor | None, int]:
        return self._eviction_module(feature, self._device)
