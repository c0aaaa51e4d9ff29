"""Sparse-dist pipelining: batch i+1's copy and input all-to-all overlap batch i's compute.

TorchRec's ``TrainPipelineSparseDist`` idea as one generator over the user's batches::

    for batch in pipelined_batches(loader, dmp, to_device=lambda b: b.to(dev),
                                   features=lambda b: b.sparse):
        loss = loss_fn(dmp(batch.dense, batch.sparse), batch.labels)   # uses the prefetch
        ...

Batch i+1 is moved to the device (on a side CUDA stream) and every sharded collection of the
model starts its input dist for batch i+1's features before batch i is handed out. Results
are identical to the plain loop: only ids move early; embeddings are looked up in batch i+1's
own forward (which finds the prefetched input dist by identity of the KJT object). Every rank
must iterate the same number of batches (collectives match in issue order).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator, Iterable
from typing import Protocol, TypeVar

import torch
from torch import nn

from recsys_core.sparse import KeyedJaggedTensor

BatchT = TypeVar("BatchT")


class Prefetching(Protocol):
    """A sharded module whose input dist can start ahead of its forward."""

    def prefetch(self, features: KeyedJaggedTensor) -> None: ...

    def drop_prefetched(self) -> None: ...


def prefetching_modules(model: nn.Module) -> list[Prefetching]:
    """The sharded collections of ``model`` fed by the model's input: those with ``input_dist``,
    ``prefetch`` and ``drop_prefetched`` (a cached kernel inside one also prefetches, but rows,
    not KJTs), except those inside another sharded module with an ``input_dist`` or one that
    ``remaps_features`` (the embedding collection of a sharded managed-collision collection
    reads remapped ids, not the input)."""
    found: list[Prefetching] = []
    outer: list[str] = []  # modules that take the model's features, parents first
    for path, m in model.named_modules():
        takes_features = callable(getattr(m, "input_dist", None))
        if not (takes_features or getattr(m, "remaps_features", False)):
            continue
        if any(path.startswith(p + ".") for p in outer):
            continue
        outer.append(path)
        if not takes_features:
            continue
        if all(callable(getattr(m, name, None)) for name in ("prefetch", "drop_prefetched")):
            found.append(m)
    return found


def pipelined_batches(
    batches: Iterable[BatchT],
    model: nn.Module,
    to_device: Callable[[BatchT], BatchT],
    features: Callable[[BatchT], KeyedJaggedTensor],
    device: torch.device | None = None,
) -> Generator[BatchT, None, None]:
    """``to_device(batch)`` for each batch, one batch ahead, with the input dists of
    ``features(batch)`` already started on every sharded collection of ``model``.

    With a CUDA ``device`` the copy runs on a side stream that the current stream waits for.
    Closing the generator early finishes and discards the prefetched input dists.
    """
    sharded = prefetching_modules(model)
    stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None

    def stage(batch: BatchT) -> BatchT:
        if stream is not None:
            with torch.cuda.stream(stream):
                batch = to_device(batch)
            torch.cuda.current_stream(device).wait_stream(stream)
        else:
            batch = to_device(batch)
        for module in sharded:
            module.prefetch(features(batch))
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
            try:
                module.drop_prefetched()
            except RuntimeError:
                # The loop is already unwinding (an error, or a peer rank gone): the error that
                # stopped it is the one to report, not this cleanup's lost connection.
                if sys.exc_info()[0] is None:
                    raise
