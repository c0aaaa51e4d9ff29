"""Dataset plumbing (TorchRec's ``torchrec.datasets.utils``): the ``Batch`` every TorchRec
model and train pipeline consumes, and train/validation splits over iterable datapipes."""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch
from torch.utils.data import IterDataPipe, functional_datapipe, get_worker_info

from recsys_core.sparse import KeyedJaggedTensor
from recsys_core.streamable import Pipelineable


@dataclass
class Batch(Pipelineable):
    """One training batch: ``dense_features [B, num_dense]``, ``sparse_features`` (a KJT with
    stride B) and ``labels [B]``."""

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            dense_features=self.dense_features.to(device=device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> Batch:
        return Batch(
            dense_features=self.dense_features.pin_memory(),
            sparse_features=self.sparse_features.pin_memory(),
            labels=self.labels.pin_memory(),
        )


def _check_train_perc(train_perc: float) -> None:
    if not 0.0 < train_perc < 1.0:
        raise ValueError(f"train_perc must be in range (0.0, 1.0), got {train_perc}")


class _IdxFilter(IterDataPipe):
    def __init__(self, datapipe: IterDataPipe, keep: Callable[[int], bool]) -> None:
        super().__init__()
        self.datapipe = datapipe
        self.keep = keep

    def __iter__(self) -> Iterator[Any]:
        for idx, row in enumerate(self.datapipe):
            if self.keep(idx):
                yield row


def _default_key_fn(idx: int) -> int:
    return idx


def train_filter(
    key_fn: Callable[[int], int], train_perc: float, decimal_places: int, idx: int
) -> bool:
    """Row ``idx`` is in the training split: ``key_fn(idx) mod 10^d < round(train_perc 10^d)``."""
    scale = 10**decimal_places
    return key_fn(idx) % scale < round(train_perc * scale)


def val_filter(
    key_fn: Callable[[int], int], train_perc: float, decimal_places: int, idx: int
) -> bool:
    """The complement of :func:`train_filter`."""
    return not train_filter(key_fn, train_perc, decimal_places, idx)


def idx_split_train_val(
    datapipe: IterDataPipe,
    train_perc: float,
    decimal_places: int = 2,
    key_fn: Callable[[int], int] = _default_key_fn,
) -> tuple[IterDataPipe, IterDataPipe]:
    """Deterministic split by row index: of every ``10^decimal_places`` consecutive rows the
    first ``round(train_perc * 10^decimal_places)`` train and the rest validate."""
    _check_train_perc(train_perc)
    return (
        _IdxFilter(datapipe, partial(train_filter, key_fn, train_perc, decimal_places)),
        _IdxFilter(datapipe, partial(val_filter, key_fn, train_perc, decimal_places)),
    )


class _RandFilter(IterDataPipe):
    """Keeps rows by draws from ``rand_gen``, restarted from the same state on every pass so
    the train and validation pipes (same seed) see complementary, repeatable draws."""

    def __init__(
        self,
        datapipe: IterDataPipe,
        keep: Callable[[random.Random], bool],
        rand_gen: random.Random,
    ) -> None:
        super().__init__()
        self.datapipe = datapipe
        self.keep = keep
        self.rand_gen = rand_gen
        self.rand_gen_init_state: tuple[Any, ...] = rand_gen.getstate()

    def __iter__(self) -> Iterator[Any]:
        self.rand_gen.setstate(self.rand_gen_init_state)
        for row in self.datapipe:
            if self.keep(self.rand_gen):
                yield row


def _rand_train(train_perc: float, rand_gen: random.Random) -> bool:
    return rand_gen.random() < train_perc


def _rand_val(train_perc: float, rand_gen: random.Random) -> bool:
    return not _rand_train(train_perc, rand_gen)


def rand_split_train_val(
    datapipe: IterDataPipe, train_perc: float, random_seed: int = 0
) -> tuple[IterDataPipe, IterDataPipe]:
    """Random split: each row trains with probability ``train_perc`` (``random.Random(seed)``),
    else validates; the two pipes are exact complements."""
    _check_train_perc(train_perc)
    return (
        _RandFilter(datapipe, partial(_rand_train, train_perc), random.Random(random_seed)),
        _RandFilter(datapipe, partial(_rand_val, train_perc), random.Random(random_seed)),
    )


T = TypeVar("T")


def safe_cast(val: T, dest_type: Callable[[T], T], default: T) -> T:
    """``dest_type(val)``, or ``default`` where that raises ValueError."""
    try:
        return dest_type(val)
    except ValueError:
        return default


@functional_datapipe("limit")
class Limit(IterDataPipe):
    """The first ``limit`` rows of ``datapipe`` (also ``datapipe.limit(n)``)."""

    def __init__(self, datapipe: IterDataPipe, limit: int) -> None:
        super().__init__()
        self.datapipe = datapipe
        self.limit = limit

    def __iter__(self) -> Iterator[Any]:
        for idx, row in enumerate(self.datapipe):
            if idx >= self.limit:
                break
            yield row


class ReadLinesFromCSV(IterDataPipe):
    """Rows (lists of strings) of every ``(path, open file)`` pair; ``kw`` goes to
    ``csv.reader`` (e.g. ``delimiter="\\t"``)."""

    def __init__(
        self,
        datapipe: IterDataPipe,
        skip_first_line: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__()
        self.datapipe = datapipe
        self.skip_first_line = skip_first_line
        self.kw = kw

    def __iter__(self) -> Iterator[list[str]]:
        for _, data in self.datapipe:
            reader = csv.reader(data, **self.kw)
            if self.skip_first_line:
                next(reader, None)
            yield from reader


class LoadFiles(IterDataPipe):
    """``(path, open file)`` for each path, opened with the built-in ``open`` (TorchRec goes
    through iopath; local paths behave the same)."""

    def __init__(
        self, datapipe: Iterable[str], mode: str = "b", length: int = -1, **open_kw: Any
    ) -> None:
        super().__init__()
        if mode not in ("b", "t", "rb", "rt", "r"):
            raise ValueError(f"Invalid mode {mode}")
        self.datapipe = datapipe
        self.mode = "r" + mode if mode in ("b", "t") else mode
        self.length = length
        self.open_kw = open_kw

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for path in self.datapipe:
            if not isinstance(path, str):
                raise TypeError(f"Expected string type for pathname, but got {type(path)}")
            yield path, open(path, self.mode, **self.open_kw)  # noqa: SIM115 - caller reads it

    def __len__(self) -> int:
        if self.length == -1:
            raise TypeError("LoadFiles has no length: pass length= when constructing it")
        return self.length


def _default_dp_selector(datapipes: Sequence[IterDataPipe]) -> Sequence[IterDataPipe]:
    """In a DataLoader worker, this worker's contiguous share of ``datapipes``."""
    info = get_worker_info()
    if info is None:
        return datapipes
    if info.num_workers > len(datapipes):
        raise ValueError(
            f"Number of workers {info.num_workers} exceeds number of datapipes "
            f"({len(datapipes)})!"
        )
    offsets = [0]
    for workers_left in range(info.num_workers, 0, -1):
        offsets.append(offsets[-1] + math.ceil((len(datapipes) - offsets[-1]) / workers_left))
    return datapipes[offsets[info.id] : offsets[info.id + 1]]


class ParallelReadConcat(IterDataPipe):
    """Concatenation of ``datapipes``; inside DataLoader workers each worker reads only the
    pipes ``dp_selector`` gives it."""

    def __init__(
        self,
        *datapipes: IterDataPipe,
        dp_selector: Callable[
            [Sequence[IterDataPipe]], Sequence[IterDataPipe]
        ] = _default_dp_selector,
    ) -> None:
        super().__init__()
        self.datapipes: tuple[IterDataPipe, ...] = datapipes
        self.dp_selector = dp_selector

    def __iter__(self) -> Iterator[Any]:
        for dp in self.dp_selector(self.datapipes):
            yield from dp


__all__ = [
    "Batch",
    "Limit",
    "LoadFiles",
    "ParallelReadConcat",
    "ReadLinesFromCSV",
    "idx_split_train_val",
    "rand_split_train_val",
    "safe_cast",
    "train_filter",
    "val_filter",
]
