"""Batches on the training device, optionally pipelined with the sparse input all-to-all."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from dlrm_app.data.loader import Batch
from recsys_core.distributed.train_pipeline import pipelined_batches


def device_batches(batches: Iterable[Batch], device: torch.device, model: nn.Module,
                   pipelined: bool) -> Iterator[Batch]:
    """Batches on ``device``. Pipelined (``recsys_core.distributed.train_pipeline``): batch
    i+1 is copied and its sparse input all-to-all started before batch i is handed out, so both
    overlap batch i's forward and backward; results are identical to the plain loop.

    Closing this generator finishes the prefetched work and never raises: when a prefetch
    failed (a full or damaged offload disk), its error already stopped the loop at the batch
    that needed it, and the close (by the loop, or by the garbage collector once the error's
    traceback is gone) would only print it a second time as "Exception ignored in"."""
    if not pipelined:
        for batch in batches:
            yield batch.to(device, non_blocking=True)
        return
    stream = pipelined_batches(
        batches, model, to_device=lambda b: b.to(device, non_blocking=device.type == "cuda"),
        features=lambda b: b.sparse, device=device,
    )
    try:
        for batch in stream:  # not `yield from`: it would close `stream` itself, and raise
            yield batch
    finally:
        try:
            stream.close()
        except Exception:  # noqa: BLE001 - reported where the failed batch was used
            pass
