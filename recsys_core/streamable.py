"""TorchRec's ``torchrec.streamable``: the interfaces a pipelined batch implements.

A train pipeline copies the next batch to the device on a side stream while the current
batch computes. Any batch type works as long as it can move itself (``to``) and tell the
allocator which stream still reads its memory (``record_stream``). ``torch.Tensor``,
``JaggedTensor`` and ``KeyedJaggedTensor`` already have both methods; a compound batch
(dense tensor + KJT + labels) subclasses :class:`Pipelineable` and forwards to its parts.
"""

from __future__ import annotations

import abc

import torch


class Multistreamable(abc.ABC):
    """An object whose memory may be used from a CUDA stream other than the one that made it."""

    @abc.abstractmethod
    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor held as in use by ``stream`` (see ``torch.Tensor.record_stream``)."""


class Pipelineable(Multistreamable):
    """A batch a train pipeline can move across devices and streams.

    ``to`` may return ``self`` or a copy, exactly like ``torch.Tensor.to``: always assign the
    result (``batch = batch.to(device)``).
    """

    @abc.abstractmethod
    def to(self, device: torch.device, non_blocking: bool) -> Pipelineable:
        """Return this batch on ``device``."""


__all__ = ["Multistreamable", "Pipelineable"]
