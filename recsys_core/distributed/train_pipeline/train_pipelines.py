"""TorchRec's train pipelines: ``progress(dataloader_iter)`` runs one training step and returns
the model's output, pipelining the next batch's host-to-device copy (and, for
:class:`TrainPipelineSparseDist`, its input all-to-all) with the current step.

The model follows TorchRec's convention: ``model(batch) -> (losses, output)``; a step is
``zero_grad``, forward, ``sum(losses).backward()``, ``optimizer.step()`` (forward only in eval
mode). ``progress`` raises ``StopIteration`` once the iterator is exhausted and every pipelined
batch has been run. Results equal the plain loop over the same batches.
"""

import abc
import logging
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from recsys_core.distributed.train_pipeline.prefetch import pipelined_batches
from recsys_core.sparse import KeyedJaggedTensor

In = TypeVar("In")
Out = TypeVar("Out")

logger = logging.getLogger(__name__)


def _sparse_features(batch: Any) -> KeyedJaggedTensor:
    """The KJT a TorchRec batch carries (``Batch.sparse_features`` or
    ``ModelInput.idlist_features``), whose input all-to-all the pipeline starts ahead."""
    for name in ("sparse_features", "idlist_features"):
        kjt = getattr(batch, name, None)
        if isinstance(kjt, KeyedJaggedTensor):
            return kjt
    raise TypeError(
        f"TrainPipelineSparseDist: the batch ({type(batch).__name__}) holds no KeyedJaggedTensor "
        "in 'sparse_features' or 'idlist_features', so its input all-to-all cannot be started "
        "ahead; give the batch such an attribute (TorchRec's Batch has sparse_features), or use "
        "TrainPipelineBase, which copies batches ahead without it")


class TrainPipeline(abc.ABC, Generic[In, Out]):
    @abc.abstractmethod
    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        pass


class _Pipeline(TrainPipeline[In, Out]):
    _prefetch_input_dist: bool

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        custom_model_fwd: Callable[[In], tuple[torch.Tensor, Out]] | None = None,
        execute_all_batches: bool = True,
    ) -> None:
        if not execute_all_batches:
            raise ValueError(
                f"{type(self).__name__}: execute_all_batches=False (drop the batches left in the "
                "pipeline at the end) is not supported; every batch is executed"
            )
        self._model = model
        self._optimizer = optimizer
        self._device = device
        self._model_fwd = custom_model_fwd or model
        self._source: Iterator[In] | None = None
        self._batches: Generator[In, None, None] | None = None

    def _stream(self, dataloader_iter: Iterator[In]) -> Iterator[In]:
        if self._source is not dataloader_iter or self._batches is None:
            if self._batches is not None:
                self._batches.close()
            self._source = dataloader_iter
            model = self._model if self._prefetch_input_dist else nn.Module()
            device = self._device
            batches = pipelined_batches(
                dataloader_iter,
                model,
                to_device=lambda b: b.to(device, non_blocking=True),
                features=_sparse_features,
                device=device,
            )
            # Finish the in-flight input dists while the process group still exists: when the
            # pipeline is dropped, or at interpreter exit (before torch tears down its tensors;
            # a pending all-to-all freed during that teardown aborts the process).
            weakref.finalize(self, batches.close)
            self._batches = batches
        return self._batches

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        batch = next(self._stream(dataloader_iter))  # StopIteration ends the epoch
        if self._model.training:
            self._optimizer.zero_grad()
        losses, output = self._model_fwd(batch)
        if self._model.training:
            torch.sum(losses).backward()
            self._optimizer.step()
        return output


class TrainPipelineBase(_Pipeline[In, Out]):
    """Copies batch i+1 to ``device`` (on a side CUDA stream) while batch i computes."""

    _prefetch_input_dist = False


class TrainPipelineSparseDist(_Pipeline[In, Out]):
    """As :class:`TrainPipelineBase`, and also starts batch i+1's input all-to-all on every
    sharded collection of the model before batch i's forward (the batch's KJT is its
    ``sparse_features`` or ``idlist_features``).

    ``async_inplace_copy`` (TorchRec 1.9, off by default) moves TorchRec's in-place batch copy
    to a background thread; TorchRec makes that copy only with ``enable_inplace_copy_batch``,
    which this pipeline does not take, so, as in TorchRec without it, nothing changes: on a
    device other than CUDA or MTIA it is turned off with a warning (TorchRec's), elsewhere it
    is recorded (``_async_inplace_copy``)."""

    _prefetch_input_dist = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        custom_model_fwd: Callable[[In], tuple[torch.Tensor, Out]] | None = None,
        *,
        async_inplace_copy: bool = False,
    ) -> None:
        if apply_jit:
            raise ValueError(
                "TrainPipelineSparseDist: apply_jit=True (TorchScript the dense part) is not "
                "supported; compile the dense modules with torch.compile instead"
            )
        super().__init__(model, optimizer, device, custom_model_fwd, execute_all_batches)
        if async_inplace_copy and device.type not in ("cuda", "mtia"):
            logger.warning(
                "async_inplace_copy requested on non-accelerator device %s; disabling.",
                device.type,
            )
            async_inplace_copy = False
        self._async_inplace_copy = async_inplace_copy


__all__ = ["TrainPipeline", "TrainPipelineBase", "TrainPipelineSparseDist"]
