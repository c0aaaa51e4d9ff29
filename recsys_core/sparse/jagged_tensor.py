"""JaggedTensor: one feature's variable-length bags over a batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import GetAttrKey, KeyEntry, register_pytree_node

from recsys_core.kernels import sparse_ops
from recsys_core.sparse._utils import (
    as_index_tensor,
    check_values_and_weights,
    jagged_values_string,
    parse_lengths_offsets,
    validate_jagged,
)

_OWNER = "JaggedTensor"


class JaggedTensor:
    """An (optionally weighted) batch of variable-length bags, stored flat.

    ``values`` holds every bag back to back; ``lengths`` (one entry per batch row) or
    ``offsets`` (``len(lengths) + 1`` entries, leading 0) say where each bag starts. Either
    one is enough: the other is computed on first use and cached. Batch of 3::

        bags     [[5], [], [7, 1]]
        values   [5, 7, 1]
        lengths  [1, 0, 2]
        offsets  [0, 1, 1, 3]
        weights  [0.5, 1.0, 2.0]     (optional, one per value: float, or int32/int64 ids as
                                      TorchRec's EmbeddingCollection(need_indices=True) stores)

    The constructor only checks metadata (dtypes, ranks, sizes) so it never waits for the
    device; call :meth:`validate` for the full check. ``lengths``/``offsets`` may be Python
    lists (converted to int64) or int32/int64 tensors.
    """

    __slots__ = ("_values", "_weights", "_lengths", "_offsets", "_rows", "_row")

    def __init__(
        self,
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | Sequence[int] | None = None,
        offsets: torch.Tensor | Sequence[int] | None = None,
    ) -> None:
        check_values_and_weights(values, weights, _OWNER, integer_weights_ok=True)
        lengths, offsets = parse_lengths_offsets(lengths, offsets, _OWNER, values.device)
        self._values: torch.Tensor = values
        self._weights: torch.Tensor | None = weights
        self._lengths: torch.Tensor | None = lengths
        self._offsets: torch.Tensor | None = offsets
        self._rows: BatchedRows | None = None
        self._row = 0

    @classmethod
    def _trusted(
        cls,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        lengths: torch.Tensor | None,
        offsets: torch.Tensor | None,
    ) -> JaggedTensor:
        """Skip the checks for parts sliced out of an already-checked tensor (hot path)."""
        jt = cls.__new__(cls)
        jt._values = values
        jt._weights = weights
        jt._lengths = lengths
        jt._offsets = offsets
        jt._rows = None
        jt._row = 0
        return jt

    @classmethod
    def _from_rows(
        cls, values: torch.Tensor, weights: torch.Tensor | None, rows: BatchedRows, row: int
    ) -> JaggedTensor:
        """Row ``row`` of a ``[K, B]`` lengths tensor: lengths/offsets views appear on first
        use, for all K rows at once (``KeyedJaggedTensor.to_dict`` builds these)."""
        jt = cls._trusted(values, weights, None, None)
        jt._rows = rows
        jt._row = row
        return jt

    # -- constructors ---------------------------------------------------------------------

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> JaggedTensor:
        """A batch of zero bags."""
        weights = torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None
        return JaggedTensor(
            values=torch.empty(0, dtype=values_dtype, device=device),
            weights=weights,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            offsets=torch.zeros(1, dtype=lengths_dtype, device=device),
        )

    @staticmethod
    def from_dense(
        values: Sequence[torch.Tensor], weights: Sequence[torch.Tensor] | None = None
    ) -> JaggedTensor:
        """One tensor per bag: ``[tensor([5]), tensor([7, 1])]`` -> lengths ``[1, 2]`` (int32)."""
        if len(values) == 0:
            raise ValueError(
                "JaggedTensor.from_dense: got no tensors, so the dtype is unknown; "
                "use JaggedTensor.empty(...) for an empty batch."
            )
        if weights is not None and len(weights) != len(values):
            raise ValueError(
                f"JaggedTensor.from_dense: got {len(values)} value tensors but {len(weights)} "
                "weight tensors; pass one weight tensor per bag."
            )
        flat = torch.cat(list(values))
        lengths = torch.tensor([v.size(0) for v in values], dtype=torch.int32, device=flat.device)
        flat_weights = None if weights is None else torch.cat(list(weights))
        return JaggedTensor(values=flat, weights=flat_weights, lengths=lengths)

    @staticmethod
    def from_dense_lengths(
        values: torch.Tensor,
        lengths: torch.Tensor | Sequence[int],
        weights: torch.Tensor | None = None,
    ) -> JaggedTensor:
        """Keep the first ``lengths[b]`` entries of row ``b`` of a padded ``[B, L]`` tensor."""
        lengths = as_index_tensor(
            lengths, "lengths", "JaggedTensor.from_dense_lengths", values.device
        )
        if values.dim() < 2 or values.size(0) != lengths.numel():
            raise ValueError(
                f"JaggedTensor.from_dense_lengths: values must be [B, L] with B = len(lengths) "
                f"= {lengths.numel()}, got shape {tuple(values.shape)}."
            )
        columns = torch.arange(values.size(1), device=values.device)
        mask = columns.unsqueeze(0) < lengths.unsqueeze(1)
        return JaggedTensor(
            values=values[mask],
            weights=None if weights is None else weights[mask],
            lengths=lengths,
        )

    # -- accessors --------------------------------------------------------------------------

    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("This JaggedTensor has no weights; use weights_or_none().")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def lengths(self) -> torch.Tensor:
        if self._rows is not None:
            self._materialize()
        if self._lengths is None:
            assert self._offsets is not None  # the constructor guarantees one of them
            self._lengths = sparse_ops.offsets_to_lengths(self._offsets)
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        if self._rows is not None:
            self._materialize()
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._rows is not None:
            self._materialize()
        if self._offsets is None:
            assert self._lengths is not None
            self._offsets = sparse_ops.lengths_to_offsets(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        if self._rows is not None:
            self._materialize()
        return self._offsets

    def _materialize(self) -> None:
        rows, self._rows = self._rows, None
        assert rows is not None
        self._lengths = rows.lengths(self._row)
        self._offsets = rows.offsets(self._row)

    def device(self) -> torch.device:
        return self._values.device

    def validate(self) -> JaggedTensor:
        """Full check (syncs with the device): lengths >= 0, offsets start at 0 and agree
        with lengths, and the bags cover exactly ``values``. Raises ``ValueError``."""
        validate_jagged(
            _OWNER, None, self.lengths().numel(), self._values, self.lengths(), self._offsets, None
        )
        return self

    # -- conversions ------------------------------------------------------------------------

    def to_dense(self) -> list[torch.Tensor]:
        """One view of ``values`` per bag."""
        return list(self._values.split(self.lengths().tolist()))

    def to_dense_weights(self) -> list[torch.Tensor] | None:
        if self._weights is None:
            return None
        return list(self._weights.split(self.lengths().tolist()))

    def to_padded_dense(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor:
        """``[B, L]``: each bag truncated or padded to ``L`` (default: the longest bag)."""
        return sparse_ops.jagged_to_padded_dense(
            self._values, self.offsets(), self._padded_length(desired_length), padding_value
        )

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor | None:
        if self._weights is None:
            return None
        return sparse_ops.jagged_to_padded_dense(
            self._weights, self.offsets(), self._padded_length(desired_length), padding_value
        )

    def _padded_length(self, desired_length: int | None) -> int:
        if desired_length is not None:
            if desired_length < 0:
                raise ValueError(f"desired_length must be >= 0, got {desired_length}.")
            return desired_length
        lengths = self.lengths()
        return int(lengths.max()) if lengths.numel() else 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        return JaggedTensor._trusted(*(_move(t, device, non_blocking) for t in self._parts()))

    def pin_memory(self) -> JaggedTensor:
        return JaggedTensor._trusted(
            *(None if t is None else t.pin_memory() for t in self._parts())
        )

    def record_stream(self, stream: torch.Stream) -> None:
        for t in self._parts():
            if t is not None:
                t.record_stream(stream)

    def _parts(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        if self._rows is not None:
            self._materialize()
        return self._values, self._weights, self._lengths, self._offsets

    def __str__(self) -> str:
        offsets = self.offsets().tolist()
        bags = len(offsets) - 1
        if self._weights is None:
            body = "    " + jagged_values_string(self._values, offsets, 0, bags)
        else:
            body = (
                '    "values": '
                + jagged_values_string(self._values, offsets, 0, bags)
                + ',\n    "weights": '
                + jagged_values_string(self._weights, offsets, 0, bags)
            )
        return "JaggedTensor({\n" + body + "\n})\n"


class BatchedRows:
    """Per-row lengths and offsets views of a ``[K, B]`` lengths tensor, created together on
    first request: one ``unbind`` and one batched cumsum instead of K separate ones."""

    __slots__ = ("_lengths_2d", "_lengths", "_offsets")

    def __init__(self, lengths_2d: torch.Tensor) -> None:
        self._lengths_2d = lengths_2d
        self._lengths: tuple[torch.Tensor, ...] | None = None
        self._offsets: tuple[torch.Tensor, ...] | None = None

    def lengths(self, row: int) -> torch.Tensor:
        if self._lengths is None:
            self._lengths = self._lengths_2d.unbind(0)
        return self._lengths[row]

    def offsets(self, row: int) -> torch.Tensor:
        if self._offsets is None:
            lengths = self._lengths_2d
            offsets = lengths.new_zeros(lengths.size(0), lengths.size(1) + 1)
            torch.cumsum(lengths, 1, out=offsets[:, 1:])
            self._offsets = offsets.unbind(0)
        return self._offsets[row]


def _move(
    t: torch.Tensor | None, device: torch.device | str, non_blocking: bool
) -> torch.Tensor | None:
    return None if t is None else t.to(device, non_blocking=non_blocking)


_FIELDS = ("_values", "_weights", "_lengths", "_offsets")


def _flatten(jt: JaggedTensor) -> tuple[list[torch.Tensor | None], None]:
    return list(jt._parts()), None


def _flatten_with_keys(jt: JaggedTensor) -> tuple[list[tuple[KeyEntry, Any]], None]:
    return [(GetAttrKey(name), t) for name, t in zip(_FIELDS, jt._parts(), strict=True)], None


def _unflatten(children: Any, context: None) -> JaggedTensor:
    values, weights, lengths, offsets = children
    return JaggedTensor(values=values, weights=weights, lengths=lengths, offsets=offsets)


register_pytree_node(
    JaggedTensor,
    _flatten,
    _unflatten,
    serialized_type_name="recsys_core.sparse.JaggedTensor",
    flatten_with_keys_fn=_flatten_with_keys,
)
