"""Optimizers: fused embedding optimizer types, keyed and combined optimizers."""

from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig, WeightDecayMode
from recsys_core.optim.fused import EmbeddingFusedOptimizer
from recsys_core.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from recsys_core.optim.optimizers import (
    RowWiseAdagrad,
    apply_optimizer_in_backward,
    in_backward_optimizer_config,
    in_backward_optimizer_filter,
    recorded_fused_config,
)

__all__ = [
    "CombinedOptimizer",
    "EmbOptimType",
    "EmbeddingFusedOptimizer",
    "FusedOptimizerConfig",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "RowWiseAdagrad",
    "WeightDecayMode",
    "apply_optimizer_in_backward",
    "in_backward_optimizer_config",
    "in_backward_optimizer_filter",
    "recorded_fused_config",
]
