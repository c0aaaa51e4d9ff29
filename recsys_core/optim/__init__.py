"""Optimizers: fused embedding optimizer types, keyed, combined and wrapping optimizers.

Mirrors ``torchrec.optim``: ``recsys_core.optim.keyed``, ``.clipping``, ``.warmup``, ``.fused``,
``.optimizers``, ``.rowwise_adagrad``, ``.semi_sync``, ``.test_utils`` and
``.apply_optimizer_in_backward`` hold TorchRec's names.
"""

from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig, WeightDecayMode
from recsys_core.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from recsys_core.optim.clipping import GradientClipping, GradientClippingOptimizer
from recsys_core.optim.fused import (
    EmbeddingFusedOptimizer,
    EmptyFusedOptimizer,
    FusedOptimizer,
    FusedOptimizerModule,
)
from recsys_core.optim.keyed import (
    CombinedOptimizer,
    KeyedOptimizer,
    KeyedOptimizerWrapper,
    OptimizerWrapper,
)
from recsys_core.optim.optimizers import (
    LAMB,
    SGD,
    Adagrad,
    Adam,
    LarsSGD,
    PartialRowWiseAdam,
    PartialRowWiseLAMB,
    RowWiseAdagrad,
    in_backward_optimizer_config,
    in_backward_optimizer_filter,
    recorded_fused_config,
)
from recsys_core.optim.semi_sync import SemisyncOptimizer
from recsys_core.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

__all__ = [
    "LAMB",
    "SGD",
    "Adagrad",
    "Adam",
    "LarsSGD",
    "PartialRowWiseAdam",
    "PartialRowWiseLAMB",
    "CombinedOptimizer",
    "EmbOptimType",
    "EmbeddingFusedOptimizer",
    "EmptyFusedOptimizer",
    "FusedOptimizer",
    "FusedOptimizerConfig",
    "FusedOptimizerModule",
    "GradientClipping",
    "GradientClippingOptimizer",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerWrapper",
    "RowWiseAdagrad",
    "SemisyncOptimizer",
    "WarmupOptimizer",
    "WarmupPolicy",
    "WarmupStage",
    "WeightDecayMode",
    "apply_optimizer_in_backward",
    "in_backward_optimizer_config",
    "in_backward_optimizer_filter",
    "recorded_fused_config",
]
