"""TorchRec's ``torchrec.distributed.embedding_types`` path: the names sharders and planners share.

The definitions live in :mod:`recsys_core.plan` (the layer below the planner and the runtime).
"""

from recsys_core.plan.types import EmbeddingComputeKernel, ShardingType

__all__ = ["EmbeddingComputeKernel", "ShardingType"]
