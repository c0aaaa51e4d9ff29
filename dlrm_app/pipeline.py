"""Batches on the training device, optionally pipelined with the sparse input all-to-all."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from dlrm_app.data.loader import Batch
from recsys_core.distributed.embeddingbag import ShardedEmbeddingBagCollection


def device_batches(batches: Iterable[Batch], device: torch.device, model: nn.Module,
                   pipelined: bool) -> Iterator[Batch]:
    """Batches on ``device``. Pipelined (TorchRec's ``TrainPipelineSparseDist`` idea): batch
    i+1 is copied (on a side CUDA stream) and its sparse input all-to-all started before batch i
    is handed out, so both overlap batch i's forward and backward. Results are identical to the
    plain loop: only ids move early, embeddings are looked up at batch i+1's forward."""
    if not pipelined:
        for batch in batches:
            yield batch.to(device, non_blocking=True)
        return
    sharded = [m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection)]
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def stage(batch: Batch) -> Batch:
        if stream is not None:
            with torch.cuda.stream(stream):
                batch = batch.to(device, non_blocking=True)
            torch.cuda.current_stream(device).wait_stream(stream)
        else:
            batch = batch.to(device)
        for module in sharded:
            module.prefetch(batch.sparse)
        return batch

    iterator = iter(batches)
    try:
        current = next(iterator, None)
        if current is None:
            return
        current = stage(current)
        for upcoming in iterator:
            upcoming = stage(upcoming)
            yield current
            current = upcoming
        yield current
    finally:
        for module in sharded:
            module.drop_prefetched()
