"""Id range checks: every id must lie in ``[0, num_embeddings)`` of its feature's table.

Two tools, one message format (``feature 'f': id 10 is outside [0, 10) ...``):

- :class:`IdRangeCheck` checks a whole KeyedJaggedTensor in one vectorized pass before ids are
  sent anywhere (a sharded collection must not route a bad id to another rank, whose kernel
  would fail while this rank waits). Ids on the host are checked at once (no device sync
  exists to pay). Ids on an accelerator are checked asynchronously: the verdict is copied to
  pinned host memory behind the work already queued and read by :meth:`PendingIdCheck.result`
  at the next point where the caller synchronizes anyway (the input dist's split exchange).
- :func:`describe_bad_ids` diagnoses a kernel's anonymous bounds-check failure after the fact
  (costs nothing on the good path).

Example: keys ["a", "b"], tables of 5 and 3 rows, lengths [2, 1 | 1, 0], values [4, 0, 1, 3]:
per-value limits [5, 5, 5, 3]; value 3 of "b" is >= 3, so the error names feature 'b', id 3.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from recsys_core.sparse import KeyedJaggedTensor


class IdOutOfRangeError(IndexError, ValueError):
    """An id outside ``[0, num_embeddings)`` of its table (names feature, position and id)."""


def id_error_message(feature: str, bad_id: int, rows: int, where: str) -> str:
    """The one wording of an out-of-range id, shared by every check."""
    return (
        f"feature {feature!r}: id {bad_id} is outside [0, {rows}) of its table ({where}); hash "
        "or clip ids to the table size before lookup"
    )


@dataclass(frozen=True)
class PendingIdCheck:
    """The verdict of an :class:`IdRangeCheck` on device ids, possibly still being computed.

    ``verdict`` is a pinned host tensor ``[bad count, first bad id, its feature index]``, valid
    once ``ready`` has fired; None means the ids were already found good."""

    verdict: torch.Tensor | None
    ready: torch.cuda.Event | None
    keys: tuple[str, ...]
    limits: tuple[int, ...]
    where: str

    def result(self) -> None:
        """Raise :class:`IdOutOfRangeError` if the checked ids had a bad one."""
        if self.verdict is None:
            return
        if self.ready is not None:
            self.ready.synchronize()
        count, value, feature = (int(v) for v in self.verdict.tolist())
        if count:
            raise IdOutOfRangeError(
                id_error_message(self.keys[feature], value, self.limits[feature], self.where)
            )


_PASSED = PendingIdCheck(None, None, (), (), "")


class IdRangeCheck:
    """Checks all ids of a KJT against each feature's table size in one pass.

    ``rows_per_feature`` maps a feature to its table's row count; features it lacks are not
    checked. ``where`` is added to the message (e.g. ``"ShardedEmbeddingBagCollection, rank 1"``).
    """

    def __init__(self, rows_per_feature: Mapping[str, int], where: str) -> None:
        self._rows = dict(rows_per_feature)
        self._where = where
        self._limits: dict[tuple[tuple[str, ...], str], torch.Tensor] = {}

    def _limit_tensor(self, keys: tuple[str, ...], device: torch.device) -> torch.Tensor:
        cached = self._limits.get((keys, str(device)))
        if cached is None:
            limits = [self._rows.get(k, 2**62) for k in keys]
            cached = torch.tensor(limits, dtype=torch.int64, device=device)
            self._limits[(keys, str(device))] = cached
        return cached

    def start(self, features: KeyedJaggedTensor) -> PendingIdCheck:
        """Check ``features``: at once for host ids (raises here), asynchronously for device ids
        (call ``result()`` on the returned check before the ids leave this rank)."""
        values = features.values()
        if values.numel() == 0:
            return _PASSED
        keys = tuple(features.keys())
        limit_tensor = self._limit_tensor(keys, values.device)
        limits = tuple(self._rows.get(k, 2**62) for k in keys)
        if values.device.type == "cpu":  # the ids are on the host: nothing to overlap with
            self._check_on_host(features, keys, limits, limit_tensor)
            return _PASSED
        lengths = features.lengths()
        strides = features.stride_per_key()  # the batch per key (variable with VBE)
        key_of_length = torch.repeat_interleave(
            torch.arange(len(keys), device=values.device),
            torch.tensor(strides, device=values.device), output_size=lengths.numel(),
        )
        per_key = torch.zeros(len(keys), dtype=torch.int64, device=values.device)
        per_key.index_add_(0, key_of_length, lengths.long())
        per_value = torch.repeat_interleave(limit_tensor, per_key, output_size=values.numel())
        bad = (values < 0) | (values >= per_value)
        position = torch.argmax(bad.to(torch.int8))
        feature = torch.searchsorted(torch.cumsum(per_key, 0), position, right=True)
        verdict = torch.stack([bad.sum(), values[position].long(), feature])
        host = torch.empty(3, dtype=torch.int64, pin_memory=True)
        host.copy_(verdict, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return PendingIdCheck(host, ready, keys, limits, self._where)


    def _check_on_host(
        self,
        features: KeyedJaggedTensor,
        keys: tuple[str, ...],
        limits: tuple[int, ...],
        limit_tensor: torch.Tensor,
    ) -> None:
        values = features.values()
        per_key = features.length_per_key()
        per_value = torch.repeat_interleave(
            limit_tensor, torch.tensor(per_key), output_size=values.numel()
        )
        bad = (values < 0) | (values >= per_value)
        if not bool(bad.any()):
            return
        position = int(bad.nonzero()[0, 0])
        feature = bisect.bisect_right(list(itertools.accumulate(per_key)), position)
        raise IdOutOfRangeError(
            id_error_message(keys[feature], int(values[position]), limits[feature], self._where)
        )


def describe_bad_ids(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    feature_names: Sequence[str],
    rows_per_feature: Sequence[int],
) -> str | None:
    """The first feature with an id outside its table, as an actionable message (or None).

    ``indices`` / ``offsets`` are a kernel's inputs: feature-major bags, the same batch size
    for every feature."""
    num_features = len(feature_names)
    if num_features == 0 or offsets.numel() <= 1:
        return None
    batch = (offsets.numel() - 1) // num_features
    starts = offsets[::batch].tolist() if batch else [0] * (num_features + 1)
    for f, name in enumerate(feature_names):
        ids = indices[int(starts[f]) : int(starts[f + 1])]
        bad = ((ids < 0) | (ids >= rows_per_feature[f])).nonzero()
        if bad.numel():
            pos = int(bad[0, 0])
            sample = int(torch.searchsorted(offsets[f * batch : (f + 1) * batch + 1],
                                            torch.tensor(int(starts[f]) + pos), right=True)) - 1
            return (
                f"feature {name!r}: id {int(ids[pos])} (batch position {sample}) is outside "
                f"[0, {rows_per_feature[f]}) of its table; {bad.numel()} bad id(s) in this "
                "feature. Hash or clip ids to the table size before lookup."
            )
    return None
