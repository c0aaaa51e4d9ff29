"""TorchRec's ``planner.estimator`` entry point: :class:`EmbeddingPerfEstimatorFactory`
creates a perf estimator by name (``constants.DEFAULT_PERF_ESTIMATOR``)."""

from __future__ import annotations

from typing import Any

from recsys_core.planner.constants import DEFAULT_PERF_ESTIMATOR
from recsys_core.planner.shard_estimators import EmbeddingPerfEstimator


class EmbeddingPerfEstimatorFactory:
    """``create(name, topology=..., constraints=..., is_inference=...)``: the one estimator this
    library has is DEFAULT_PERF_ESTIMATOR (its own cost model, see ``shard_estimators.py``)."""

    _registry: dict[str, type[EmbeddingPerfEstimator]] = {
        DEFAULT_PERF_ESTIMATOR: EmbeddingPerfEstimator,
    }

    @classmethod
    def create(cls, name: str = DEFAULT_PERF_ESTIMATOR, **kwargs: Any) -> EmbeddingPerfEstimator:
        if name not in cls._registry:
            raise ValueError(f"EmbeddingPerfEstimatorFactory: no estimator {name!r}; known: "
                             f"{sorted(cls._registry)}")
        return cls._registry[name](**kwargs)
