"""KeyedJaggedTensor: several features' jagged bags over one batch, in one key-major layout."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import GetAttrKey, KeyEntry, register_pytree_node

from recsys_core.kernels import sparse_ops
from recsys_core.sparse import _kjt_ops
from recsys_core.sparse._utils import (
    check_values_and_weights,
    keyed_jagged_string,
    parse_lengths_offsets,
    validate_jagged,
)
from recsys_core.sparse.jagged_tensor import JaggedTensor

_OWNER = "KeyedJaggedTensor"


class KeyedJaggedTensor:
    """Jagged bags for ``len(keys)`` features over a batch of ``stride()`` rows.

    The layout is key-major: ``lengths`` holds key 0's whole batch, then key 1's, and
    ``values`` follows the same order. Two keys, batch of 3::

                    batch row 0   row 1     row 2
        "product"   [1, 2]        []        [3]
        "user"      [4]           [5, 6]    [7, 8, 9]

        keys            ["product", "user"]
        lengths         [2, 0, 1, 1, 2, 3]          len = keys * stride = 6
        offsets         [0, 2, 2, 3, 4, 6, 9]       len(lengths) + 1
        values          [1, 2, 3, 4, 5, 6, 7, 8, 9]
        stride()        3
        length_per_key  [3, 6]
        offset_per_key  [0, 3, 9]
        index_per_key   {"product": 0, "user": 1}

    ``weights`` (optional) has one float per value. Everything derivable is computed on first
    use and cached; ``length_per_key``/``offset_per_key`` need the lengths on the host (a device
    sync), which ``from_lengths_sync``/``from_offsets_sync``/``sync()`` do eagerly. The
    constructor only checks metadata; :meth:`validate` does the full, syncing check.
    """

    __slots__ = (
        "_keys",
        "_values",
        "_weights",
        "_lengths",
        "_offsets",
        "_stride",
        "_length_per_key",
        "_offset_per_key",
        "_index_per_key",
        "_jt_dict",
    )

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | Sequence[int] | None = None,
        offsets: torch.Tensor | Sequence[int] | None = None,
        stride: int | None = None,
        length_per_key: Sequence[int] | None = None,
        offset_per_key: Sequence[int] | None = None,
        index_per_key: dict[str, int] | None = None,
        jt_dict: dict[str, JaggedTensor] | None = None,
    ) -> None:
        if isinstance(keys, str):
            raise ValueError(f"{_OWNER}: keys must be a list of strings, got the string {keys!r}")
        keys = list(keys)
        check_values_and_weights(values, weights, _OWNER)
        lengths, offsets = parse_lengths_offsets(lengths, offsets, _OWNER, values.device)
        num_bags = lengths.numel() if lengths is not None else offsets.numel() - 1
        stride = _kjt_ops.check_layout(keys, num_bags, stride, length_per_key, offset_per_key)
        self._keys: list[str] = keys
        self._values = values
        self._weights = weights
        self._lengths: torch.Tensor | None = lengths
        self._offsets: torch.Tensor | None = offsets
        self._stride: int = stride
        self._length_per_key = None if length_per_key is None else list(length_per_key)
        self._offset_per_key = None if offset_per_key is None else list(offset_per_key)
        self._index_per_key = index_per_key
        self._jt_dict = jt_dict

    @classmethod
    def _trusted(
        cls,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None,
        lengths: torch.Tensor | None,
        offsets: torch.Tensor | None,
        stride: int,
        length_per_key: list[int] | None = None,
        offset_per_key: list[int] | None = None,
        index_per_key: dict[str, int] | None = None,
    ) -> KeyedJaggedTensor:
        """Skip the checks for results derived from an already-checked KJT (hot path)."""
        kjt = cls.__new__(cls)
        kjt._keys = keys
        kjt._values = values
        kjt._weights = weights
        kjt._lengths = lengths
        kjt._offsets = offsets
        kjt._stride = stride
        kjt._length_per_key = length_per_key
        kjt._offset_per_key = offset_per_key
        kjt._index_per_key = index_per_key
        kjt._jt_dict = None
        return kjt

    @classmethod
    def _from_parts(cls, parts: _kjt_ops.KJTParts) -> KeyedJaggedTensor:
        keys, values, weights, lengths, stride, length_per_key = parts
        return cls._trusted(keys, values, weights, lengths, None, stride, length_per_key)

    # -- constructors ---------------------------------------------------------------------

    @staticmethod
    def from_lengths_sync(
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor | Sequence[int],
        weights: torch.Tensor | None = None,
        stride: int | None = None,
    ) -> KeyedJaggedTensor:
        """Construct, :meth:`validate` and cache ``length_per_key`` (one device sync)."""
        kjt = KeyedJaggedTensor(keys, values, weights=weights, lengths=lengths, stride=stride)
        return kjt.validate()

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str],
        values: torch.Tensor,
        offsets: torch.Tensor | Sequence[int],
        weights: torch.Tensor | None = None,
        stride: int | None = None,
    ) -> KeyedJaggedTensor:
        """Construct, :meth:`validate` and cache ``length_per_key`` (one device sync)."""
        kjt = KeyedJaggedTensor(keys, values, weights=weights, offsets=offsets, stride=stride)
        return kjt.validate()

    @staticmethod
    def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        """One key per entry, in dict order. Every JaggedTensor needs the same batch size and
        either all or none carry weights. ``length_per_key`` comes from the value counts."""
        if not jt_dict:
            return KeyedJaggedTensor.empty()
        return KeyedJaggedTensor._from_parts(_kjt_ops.from_jt_dict(jt_dict))

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> KeyedJaggedTensor:
        """No keys, stride 0."""
        return KeyedJaggedTensor(
            keys=[],
            values=torch.empty(0, dtype=values_dtype, device=device),
            weights=torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            stride=0,
        )

    @staticmethod
    def empty_like(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """No keys, but ``kjt``'s stride, device and dtypes."""
        weights = kjt.weights_or_none()
        return KeyedJaggedTensor(
            keys=[],
            values=kjt.values().new_empty(0),
            weights=None if weights is None else weights.new_empty(0),
            lengths=kjt.lengths().new_empty(0),
            stride=kjt.stride(),
        )

    @staticmethod
    def concat(kjt_list: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Keys of all inputs side by side (same stride; all weighted or none)."""
        return KeyedJaggedTensor._from_parts(_kjt_ops.concat(kjt_list))

    # -- accessors --------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("This KeyedJaggedTensor has no weights; use weights_or_none().")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def lengths(self) -> torch.Tensor:
        if self._lengths is None:
            assert self._offsets is not None  # the constructor guarantees one of them
            self._lengths = sparse_ops.offsets_to_lengths(self._offsets)
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            assert self._lengths is not None
            self._offsets = sparse_ops.lengths_to_offsets(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        return self._offsets

    def device(self) -> torch.device:
        return self._values.device

    def stride(self) -> int:
        return self._stride

    def stride_per_key(self) -> list[int]:
        return [self._stride] * len(self._keys)

    def stride_per_key_per_rank(self) -> list[list[int]]:
        return [[self._stride] for _ in self._keys]

    def variable_stride_per_key(self) -> bool:
        return False

    def inverse_indices_or_none(self) -> None:
        return None

    def length_per_key(self) -> list[int]:
        """Number of values per key (host ints; computing them syncs once, then cached)."""
        if self._length_per_key is None:
            per_key = _kjt_ops.length_per_key(self)
            if sum(per_key) != self._values.numel():
                # Inconsistent input would otherwise fail later in an anonymous split/cat; the
                # full check names the key (this branch only runs on bad input).
                self.validate()
            self._length_per_key = per_key
        return self._length_per_key

    def length_per_key_or_none(self) -> list[int] | None:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        """Start of each key in ``values`` plus the end: ``len(keys) + 1`` host ints."""
        if self._offset_per_key is None:
            running, out = 0, [0]
            for n in self.length_per_key():
                running += n
                out.append(running)
            self._offset_per_key = out
        return self._offset_per_key

    def offset_per_key_or_none(self) -> list[int] | None:
        return self._offset_per_key

    def index_per_key(self) -> dict[str, int]:
        if self._index_per_key is None:
            self._index_per_key = {key: i for i, key in enumerate(self._keys)}
        return self._index_per_key

    def sync(self) -> KeyedJaggedTensor:
        """Compute and cache ``length_per_key``/``offset_per_key`` now."""
        self.offset_per_key()
        return self

    def unsync(self) -> KeyedJaggedTensor:
        """Drop the host-side caches (e.g. before tracing)."""
        self._length_per_key = None
        self._offset_per_key = None
        return self

    def validate(self) -> KeyedJaggedTensor:
        """Full check (one device sync): no negative lengths, offsets start at 0 and agree
        with lengths, every key's bags lie inside ``values`` and cover all of it, cached
        ``length_per_key``/``offset_per_key`` are right. Raises ``ValueError`` naming the key.
        Caches ``length_per_key`` as a side effect."""
        self._length_per_key = validate_jagged(
            _OWNER,
            self._keys,
            self._stride,
            self._values,
            self.lengths(),
            self._offsets,
            self._length_per_key,
            self._offset_per_key,
        )
        return self

    # -- per-key views ----------------------------------------------------------------------

    def __getitem__(self, key: str) -> JaggedTensor:
        index = self._key_index(key)
        if self._jt_dict is not None:
            return self._jt_dict[key]
        return _kjt_ops.key_view(self, index)

    def _key_index(self, key: str) -> int:
        try:
            return self.index_per_key()[key]
        except KeyError:
            raise KeyError(f"{_OWNER} has no key {key!r}; its keys are {self._keys}.") from None

    def to_dict(self) -> dict[str, JaggedTensor]:
        """``{key: JaggedTensor}``; values, weights, lengths and offsets are views (no copy
        per key). Per-key lengths/offsets are created when first asked for, for all keys at
        once (one unbind, one batched cumsum). The dict is cached on this KJT."""
        if self._jt_dict is None:
            self._jt_dict = _kjt_ops.to_dict(self)
        return self._jt_dict

    # -- key reordering -------------------------------------------------------------------

    def permute(
        self, indices: Sequence[int], indices_tensor: torch.Tensor | None = None
    ) -> KeyedJaggedTensor:
        """Keys in the order ``indices``; repeats are allowed (a key may appear twice).

        ``indices_tensor``, if given, is ``indices`` already on the device (int32) and saves a
        host-to-device copy. Values move with their keys::

            keys [a, b], lengths [1, 2 | 0, 3], permute([1, 0, 1])
            -> keys [b, a, b], lengths [0, 3 | 1, 2 | 0, 3]
        """
        return self._from_parts(_kjt_ops.permute(self, indices, indices_tensor))

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Consecutive groups of ``segments[i]`` keys; every part is a view (no copy)."""
        return [self._from_parts(part) for part in _kjt_ops.split(self, segments)]

    def index_select_batch(self, indices: torch.Tensor | Sequence[int]) -> KeyedJaggedTensor:
        """Keep batch rows ``indices`` (any order, repeats allowed) in every key.

        Not in TorchRec; our addition for sub-batching and re-ordering samples (e.g. moving
        rows between pipeline stages). ``stride()`` becomes ``len(indices)``. Indices are
        bounds-checked once on the host (one sync)::

            lengths [1, 2 | 0, 1], indices [1, 1, 0] -> lengths [2, 2, 1 | 1, 1, 0]
        """
        return self._from_parts(_kjt_ops.index_select_batch(self, indices))

    def flatten_lengths(self) -> KeyedJaggedTensor:
        """Same data with 1-D lengths (ours are always 1-D; kept for TorchRec code)."""
        return KeyedJaggedTensor._trusted(
            self._keys,
            self._values,
            self._weights,
            self.lengths().view(-1),
            None,
            self._stride,
            self._length_per_key,
        )

    # -- device movement ------------------------------------------------------------------

    def to(
        self,
        device: torch.device | str,
        non_blocking: bool = False,
        dtype: torch.dtype | None = None,
    ) -> KeyedJaggedTensor:
        """Move every tensor; ``dtype`` (if given) converts the weights only."""
        return self._map(
            lambda t: t.to(device, non_blocking=non_blocking),
            lambda w: w.to(device, dtype=dtype, non_blocking=non_blocking),
        )

    def pin_memory(self) -> KeyedJaggedTensor:
        return self._map(torch.Tensor.pin_memory, torch.Tensor.pin_memory)

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.record_stream(stream)

    def _map(
        self,
        fn: Callable[[torch.Tensor], torch.Tensor],
        weights_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> KeyedJaggedTensor:
        """Same keys and host caches, every tensor passed through ``fn``."""
        weights, lengths, offsets = self._weights, self._lengths, self._offsets
        return KeyedJaggedTensor._trusted(
            self._keys,
            fn(self._values),
            None if weights is None else weights_fn(weights),
            None if lengths is None else fn(lengths),
            None if offsets is None else fn(offsets),
            self._stride,
            self._length_per_key,
            self._offset_per_key,
            self._index_per_key,
        )

    def __str__(self) -> str:
        if not self._keys or (self._lengths is None and self._offsets is None):
            return "KeyedJaggedTensor()\n"
        return keyed_jagged_string(
            self._keys, self._values, self._weights, self.offsets().tolist(), self._stride
        )


_FIELDS = ("_values", "_weights", "_lengths", "_offsets")


def _flatten(kjt: KeyedJaggedTensor) -> tuple[list[torch.Tensor | None], list[str]]:
    return [kjt._values, kjt._weights, kjt._lengths, kjt._offsets], kjt._keys


def _flatten_with_keys(kjt: KeyedJaggedTensor) -> tuple[list[tuple[KeyEntry, Any]], list[str]]:
    children, keys = _flatten(kjt)
    return [(GetAttrKey(name), t) for name, t in zip(_FIELDS, children, strict=True)], keys


def _unflatten(children: Any, context: list[str]) -> KeyedJaggedTensor:
    values, weights, lengths, offsets = children
    return KeyedJaggedTensor(
        keys=list(context), values=values, weights=weights, lengths=lengths, offsets=offsets
    )


register_pytree_node(
    KeyedJaggedTensor,
    _flatten,
    _unflatten,
    serialized_type_name="recsys_core.sparse.KeyedJaggedTensor",
    flatten_with_keys_fn=_flatten_with_keys,
)
