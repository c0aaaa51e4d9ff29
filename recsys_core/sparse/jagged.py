"""JaggedTensor: one feature's variable-length bags over a batch."""

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch.utils._pytree import GetAttrKey, KeyEntry, register_pytree_node

from recsys_core.sparse import _jit_ops
from recsys_core.sparse._fx import SparseTypeMeta
from recsys_core.sparse._utils import check_jagged_inputs, jagged_values_string
from recsys_core.sparse.jagged_tensor_validator import validate_jagged

_OWNER = "JaggedTensor"

class BatchedRows:
    """Per-row lengths and offsets views of a ``[K, B]`` lengths tensor, created together on
    first request: one ``unbind`` and one batched cumsum instead of K separate ones."""

    __slots__ = ("_lengths_2d", "_lengths", "_offsets")

    def __init__(self, lengths_2d: torch.Tensor) -> None:
        self._lengths_2d = lengths_2d
        # torch.jit.annotate: TorchScript types a plain None attribute as NoneType.
        self._lengths = torch.jit.annotate(Optional[list[torch.Tensor]], None)  # noqa: UP045
        self._offsets = torch.jit.annotate(Optional[list[torch.Tensor]], None)  # noqa: UP045

    def lengths(self, row: int) -> torch.Tensor:
        lengths = self._lengths
        if lengths is None:
            lengths = self._lengths_2d.unbind(0)
            self._lengths = lengths
        return lengths[row]

    def offsets(self, row: int) -> torch.Tensor:
        offsets = self._offsets
        if offsets is None:
            lengths = self._lengths_2d
            full = torch.zeros(
                [lengths.size(0), lengths.size(1) + 1], dtype=lengths.dtype, device=lengths.device
            )
            torch.cumsum(lengths, 1, out=full[:, 1:])
            offsets = full.unbind(0)
            self._offsets = offsets
        return offsets[row]


class JaggedTensor(metaclass=SparseTypeMeta):
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

    As in TorchRec the constructor only stores its inputs (it checks that lengths or offsets
    is given and that they are integers), so it never waits for the device; call
    :meth:`validate` for the full check. ``lengths``/``offsets`` may be Python lists in eager
    mode (converted to int64). The class is TorchScript-able and fx-traceable (constructing
    one from traced tensors records the constructor in the graph).
    """

    __slots__ = ("_values", "_weights", "_lengths", "_offsets", "_rows", "_row")

    def __init__(
        self,
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> None:
        if not torch.jit.is_scripting():
            lengths, offsets = check_jagged_inputs(_OWNER, values, lengths, offsets)
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._rows = torch.jit.annotate(Optional[BatchedRows], None)  # noqa: UP045
        self._row = 0

    # -- constructors ---------------------------------------------------------------------

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: Optional[torch.device] = None,  # noqa: UP045 (TorchScript)
        values_dtype: Optional[torch.dtype] = None,  # noqa: UP045
        weights_dtype: Optional[torch.dtype] = None,  # noqa: UP045
        lengths_dtype: torch.dtype = torch.int32,
    ) -> "JaggedTensor":
        """A batch of zero bags."""
        weights = torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None
        return JaggedTensor(
            values=torch.empty(0, dtype=values_dtype, device=device),
            weights=weights,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            offsets=torch.empty(0, dtype=lengths_dtype, device=device),
        )

    @staticmethod
    def empty_like(jt: "JaggedTensor") -> "JaggedTensor":
        """No bags, but ``jt``'s device and dtypes (weighted if ``jt`` is)."""
        weights = jt.weights_or_none()
        return JaggedTensor(
            values=jt.values().new_empty(0),
            weights=None if weights is None else weights.new_empty(0),
            lengths=jt.lengths().new_empty(0),
            offsets=None,
        )

    @staticmethod
    def from_dense(
        values: list[torch.Tensor], weights: list[torch.Tensor] | None = None
    ) -> "JaggedTensor":
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
        return JaggedTensor(values=flat, weights=flat_weights, lengths=lengths, offsets=None)

    @staticmethod
    def from_dense_lengths(
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> "JaggedTensor":
        """Keep the first ``lengths[b]`` entries of row ``b`` of a padded ``[B, L]`` tensor."""
        return _jt_from_dense_lengths(values, lengths, weights)

    # -- accessors --------------------------------------------------------------------------

    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        weights = self._weights
        if weights is None:
            raise ValueError("This JaggedTensor has no weights; use weights_or_none().")
        return weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def lengths(self) -> torch.Tensor:
        if self._rows is not None:
            self._materialize()
        lengths = self._lengths
        if lengths is None:
            offsets = self._offsets
            assert offsets is not None, "JaggedTensor needs lengths or offsets"
            lengths = _jit_ops.offsets_to_lengths(offsets)
            self._lengths = lengths
        return lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        self._materialize()
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._rows is not None:
            self._materialize()
        offsets = self._offsets
        if offsets is None:
            lengths = self._lengths
            assert lengths is not None, "JaggedTensor needs lengths or offsets"
            offsets = _jit_ops.lengths_to_offsets(lengths)
            self._offsets = offsets
        return offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        self._materialize()
        return self._offsets

    def _materialize(self) -> None:
        rows = self._rows
        if rows is not None:
            self._rows = None
            self._lengths = rows.lengths(self._row)
            self._offsets = rows.offsets(self._row)

    def device(self) -> torch.device:
        return self._values.device

    def size_in_bytes(self) -> int:
        """Bytes held by values, weights, lengths and offsets (those computed so far)."""
        self._materialize()
        size = self._values.element_size() * self._values.numel()
        for t in (self._weights, self._lengths, self._offsets):
            if t is not None:
                size += t.element_size() * t.numel()
        return size

    @torch.jit.unused
    def validate(self) -> "JaggedTensor":
        """Full check (syncs with the device): lengths >= 0, offsets start at 0 and agree
        with lengths, the bags cover exactly ``values`` and there is one weight per value.
        Raises ``ValueError``."""
        validate_jagged(
            _OWNER,
            None,
            [self.lengths().numel()],
            self._values,
            self._weights,
            self.lengths(),
            self.offsets_or_none(),
        )
        return self

    # -- conversions ------------------------------------------------------------------------

    @torch.jit.unused
    def _ensure_safe(self) -> None:
        """Lengths/offsets/weights in bounds before kernels read them (see ``_safety``)."""
        from recsys_core.sparse._safety import ensure_safe_jagged

        ensure_safe_jagged(self)

    def to_dense(self) -> list[torch.Tensor]:
        """One view of ``values`` per bag."""
        if not torch.jit.is_scripting():
            self._ensure_safe()
        sizes: list[int] = self.lengths().tolist()
        return list(torch.split(self._values, sizes))

    def to_dense_weights(self) -> list[torch.Tensor] | None:
        weights = self._weights
        if weights is None:
            return None
        if not torch.jit.is_scripting():
            self._ensure_safe()
        sizes: list[int] = self.lengths().tolist()
        return list(torch.split(weights, sizes))

    def to_padded_dense(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor:
        """``[B, L]``: each bag truncated or padded to ``L`` (default: the longest bag)."""
        if not torch.jit.is_scripting():
            self._ensure_safe()
        return _jit_ops.padded_dense(
            self._values, self._bag_offsets(), self._padded_length(desired_length), padding_value
        )

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor | None:
        weights = self._weights
        if weights is None:
            return None
        if not torch.jit.is_scripting():
            self._ensure_safe()
        return _jit_ops.padded_dense(
            weights, self._bag_offsets(), self._padded_length(desired_length), padding_value
        )

    def _bag_offsets(self) -> torch.Tensor:
        """Offsets with at least the leading 0 (``empty()`` has none, as in TorchRec)."""
        offsets = self.offsets()
        return offsets if offsets.numel() > 0 else offsets.new_zeros(1)

    def _padded_length(self, desired_length: int | None) -> int:
        if desired_length is not None:
            if desired_length < 0:
                raise ValueError(f"desired_length must be >= 0, got {desired_length}.")
            return desired_length
        lengths = self.lengths()
        return int(lengths.max().item()) if lengths.numel() > 0 else 0

    def to(self, device: torch.device, non_blocking: bool = False) -> "JaggedTensor":
        self._materialize()
        weights, lengths, offsets = self._weights, self._lengths, self._offsets
        return JaggedTensor(
            values=self._values.to(device, non_blocking=non_blocking),
            weights=None if weights is None else weights.to(device, non_blocking=non_blocking),
            lengths=None if lengths is None else lengths.to(device, non_blocking=non_blocking),
            offsets=None if offsets is None else offsets.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "JaggedTensor":
        self._materialize()
        weights, lengths, offsets = self._weights, self._lengths, self._offsets
        return JaggedTensor(
            values=self._values.pin_memory(),
            weights=None if weights is None else weights.pin_memory(),
            lengths=None if lengths is None else lengths.pin_memory(),
            offsets=None if offsets is None else offsets.pin_memory(),
        )

    @torch.jit.unused
    def record_stream(self, stream: torch.Stream) -> None:
        for t in _parts(self):
            if t is not None:
                t.record_stream(stream)

    @torch.jit.unused
    def __str__(self) -> str:
        if self._values.dim() > 2:
            raise ValueError(
                f"JaggedTensor prints 1-D or 2-D values, got {self._values.dim()}-D values of "
                f"shape {tuple(self._values.shape)}; print values() instead."
            )
        offsets = self.offsets().tolist() or [0]
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


@torch.fx.wrap
def _jt_from_dense_lengths(
    values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None
) -> JaggedTensor:
    """JaggedTensor.from_dense_lengths' body: one node in an fx graph (it checks shapes)."""
    if not torch.jit.is_scripting():
        lengths, _ = check_jagged_inputs("JaggedTensor.from_dense_lengths", values, lengths, None)
    if values.dim() < 2 or values.size(0) != lengths.numel():
        raise ValueError(
            f"JaggedTensor.from_dense_lengths: values must be [B, L] with B = len(lengths) "
            f"= {lengths.numel()}, got shape {values.shape}."
        )
    columns = torch.arange(values.size(1), device=values.device)
    mask = columns.unsqueeze(0) < lengths.unsqueeze(1)
    return JaggedTensor(
        values=values[mask],
        weights=None if weights is None else weights[mask],
        lengths=lengths,
        offsets=None,
    )


def jagged_view(
    values: torch.Tensor,
    weights: torch.Tensor | None,
    lengths: torch.Tensor | None,
    offsets: torch.Tensor | None,
    rows: BatchedRows | None = None,
    row: int = 0,
) -> "JaggedTensor":
    """A JaggedTensor over parts of an already-built KJT: eager skips the input checks (hot
    path, e.g. ``to_dict`` builds one per key); ``rows`` gives lengths/offsets on first use."""
    if torch.jit.is_scripting():
        jt = JaggedTensor(values=values, weights=weights, lengths=lengths, offsets=offsets)
    else:
        jt = object.__new__(JaggedTensor)
        jt._values, jt._weights = values, weights
        jt._lengths, jt._offsets = lengths, offsets
    jt._rows = rows
    jt._row = row
    return jt


def row_views_eager(
    keys: list[str],
    value_parts: Sequence[torch.Tensor],
    weight_parts: Sequence[torch.Tensor] | None,
    rows: BatchedRows,
) -> dict[str, "JaggedTensor"]:
    """Eager only (``KeyedJaggedTensor.to_dict``'s hot loop): one JaggedTensor per key over
    row ``i`` of ``rows``, without a call per key."""
    out: dict[str, JaggedTensor] = {}
    new = object.__new__
    for i, key in enumerate(keys):
        jt = new(JaggedTensor)
        jt._values, jt._lengths, jt._offsets, jt._rows, jt._row = (
            value_parts[i],
            None,
            None,
            rows,
            i,
        )
        jt._weights = None if weight_parts is None else weight_parts[i]
        out[key] = jt
    return out


_FIELDS = ("_values", "_weights", "_lengths", "_offsets")


def _parts(
    jt: JaggedTensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    jt._materialize()
    return jt._values, jt._weights, jt._lengths, jt._offsets


def _flatten(jt: JaggedTensor) -> tuple[list[torch.Tensor | None], None]:
    return list(_parts(jt)), None


def _flatten_with_keys(jt: JaggedTensor) -> tuple[list[tuple[KeyEntry, Any]], None]:
    return [(GetAttrKey(name), t) for name, t in zip(_FIELDS, _parts(jt), strict=True)], None


def _unflatten(children: Any, context: None) -> "JaggedTensor":
    values, weights, lengths, offsets = children
    return JaggedTensor(values=values, weights=weights, lengths=lengths, offsets=offsets)


register_pytree_node(
    JaggedTensor,
    _flatten,
    _unflatten,
    serialized_type_name="recsys_core.sparse.JaggedTensor",
    flatten_with_keys_fn=_flatten_with_keys,
)
