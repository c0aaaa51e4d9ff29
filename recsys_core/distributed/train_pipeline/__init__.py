"""TorchRec's ``torchrec.distributed.train_pipeline`` path: the train pipelines
(``train_pipelines``) and the sparse-dist prefetching they run on (``prefetch``)."""

from recsys_core.distributed.train_pipeline.prefetch import (
    Prefetching,
    pipelined_batches,
    prefetching_modules,
)
from recsys_core.distributed.train_pipeline.train_pipelines import (
    TrainPipeline,
    TrainPipelineBase,
    TrainPipelineSparseDist,
)

__all__ = [
    "Prefetching",
    "TrainPipeline",
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "pipelined_batches",
    "prefetching_modules",
]
