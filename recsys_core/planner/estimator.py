"""TorchRec's ``planner.estimator`` entry point: :class:`EmbeddingPerfEstimatorFactory`
creates a perf estimator by hardware name. ``constants.DEFAULT_PERF_ESTIMATOR``: TorchRec's
formulas with its OSS coefficients (``torchrec_perf.py``); ``"recsys_core"``: this library's
calibrated cost model. ``register(name)`` adds a ``HardwarePerfConfig`` subclass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from recsys_core.planner.constants import DEFAULT_PERF_ESTIMATOR
from recsys_core.planner.shard_estimators import CalibratedPerfEstimator, EmbeddingPerfEstimator
from recsys_core.planner.torchrec_perf import HardwarePerfConfig


class EmbeddingPerfEstimatorFactory:
    """``create(name, topology=..., constraints=..., is_inference=...)``."""

    _registry: dict[str, type[HardwarePerfConfig]] = {DEFAULT_PERF_ESTIMATOR: HardwarePerfConfig}

    @classmethod
    def register(cls, name: str) -> Callable[[type[HardwarePerfConfig]], type[HardwarePerfConfig]]:
        def decorator(config: type[HardwarePerfConfig]) -> type[HardwarePerfConfig]:
            cls._registry[name.lower()] = config
            return config

        return decorator

    @classmethod
    def create(cls, hardware_name: str = DEFAULT_PERF_ESTIMATOR, is_inference: bool = False,
               topology: Any = None, constraints: Any = None, **kwargs: Any) -> Any:
        name = hardware_name.lower()
        if name != "recsys_core" and name not in cls._registry:
            raise ValueError(f"Unknown hardware: '{hardware_name}'. Available: "
                             f"{[*cls._registry, 'recsys_core']}.")
        if topology is None:
            raise ValueError("EmbeddingPerfEstimatorFactory.create: topology is required")
        if name == "recsys_core":
            return CalibratedPerfEstimator(topology, constraints, is_inference)
        return EmbeddingPerfEstimator(topology, constraints, is_inference,
                                      config=cls._registry[name]())

    @classmethod
    def create_with_config(cls, config: HardwarePerfConfig, is_inference: bool = False,
                           topology: Any = None, constraints: Any = None,
                           **kwargs: Any) -> EmbeddingPerfEstimator:
        if topology is None:
            raise ValueError("EmbeddingPerfEstimatorFactory.create_with_config: topology is "
                             "required")
        return EmbeddingPerfEstimator(topology, constraints, is_inference, config=config)

    @classmethod
    def list_registered(cls) -> list[str]:
        return [*cls._registry, "recsys_core"]

    @classmethod
    def is_registered(cls, name: str) -> bool:
        return name.lower() in cls._registry or name.lower() == "recsys_core"
