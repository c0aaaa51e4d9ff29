"""KeyedJaggedTensor: several features' jagged bags over one batch, in one key-major layout."""

from typing import Any, Optional

import torch
from torch.fx._pytree import register_pytree_flatten_spec
from torch.utils._pytree import GetAttrKey, KeyEntry, TreeSpec, register_pytree_node

from recsys_core.sparse import _jit_ops, _kjt_ops
from recsys_core.sparse._fx import SparseTypeMeta
from recsys_core.sparse._safety import ensure_safe_layout, fixed_batch_fast_path
from recsys_core.sparse._utils import (
    check_kjt_inputs,
    index_select_batch,
    keyed_jagged_string,
)
from recsys_core.sparse.jagged import JaggedTensor
from recsys_core.sparse.jagged_tensor_validator import check_keyed_jagged_tensor

_OWNER = "KeyedJaggedTensor"
_INDEX = (torch.int32, torch.int64)


class KeyedJaggedTensor(metaclass=SparseTypeMeta):
    """Jagged bags for ``len(keys)`` features over a batch, key-major.

    ``lengths`` holds key 0's whole batch, then key 1's, and ``values`` follows the same
    order. Two keys, batch of 3::

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

    Variable batch per key (VBE): ``stride_per_key_per_rank[k][r]`` bags of key ``k`` came
    from rank ``r``; key ``k`` owns the next ``sum(stride_per_key_per_rank[k])`` lengths::

        keys ["a", "b"], stride_per_key_per_rank [[2], [3]], lengths [1, 0 | 2, 1, 1]
        stride_per_key() [2, 3]    stride() 3 (the largest, or inverse_indices' batch)

    ``inverse_indices`` ``(keys, [len(keys), B] tensor)`` maps each row of the full batch ``B``
    to its deduplicated bag, for expanding pooled outputs back to ``B`` rows.

    As in TorchRec the constructor only stores its inputs: everything derivable is computed
    on first use and cached (``length_per_key``/``offset_per_key`` read the lengths on the host,
    which ``from_lengths_sync``/``from_offsets_sync``/``sync()`` do at once). Validation is
    explicit: :meth:`validate` or ``jagged_tensor_validator.validate_keyed_jagged_tensor``.
    TorchScript-able and fx-traceable.
    """

    __slots__ = (
        "_keys",
        "_values",
        "_weights",
        "_lengths",
        "_offsets",
        "_stride",
        "_stride_per_key_per_rank",
        "_stride_per_key",
        "_length_per_key",
        "_lengths_offset_per_key",
        "_offset_per_key",
        "_index_per_key",
        "_jt_dict",
        "_inverse_indices",
        "_checked",
    )

    def __init__(
        self,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: list[list[int]] | None = None,
        stride_per_key: list[int] | None = None,
        length_per_key: list[int] | None = None,
        lengths_offset_per_key: list[int] | None = None,
        offset_per_key: list[int] | None = None,
        index_per_key: dict[str, int] | None = None,
        jt_dict: dict[str, JaggedTensor] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> None:
        if not torch.jit.is_scripting():
            # the common case needs no conversion: skip the call (a third of a construction)
            plain = (
                type(keys) is list
                and type(values) is torch.Tensor
                and stride_per_key_per_rank is None
                and (lengths is None or (type(lengths) is torch.Tensor and lengths.dtype in _INDEX))
                and (offsets is None or (type(offsets) is torch.Tensor and offsets.dtype in _INDEX))
            )
            if not plain:
                keys, lengths, offsets, stride_per_key_per_rank = check_kjt_inputs(
                    keys,
                    values,
                    lengths,
                    offsets,
                    stride_per_key_per_rank,
                    length_per_key,
                    offset_per_key,
                )
        self._keys: list[str] = keys
        self._values: torch.Tensor = values
        self._weights: torch.Tensor | None = weights
        self._lengths: torch.Tensor | None = lengths
        self._offsets: torch.Tensor | None = offsets
        self._stride: int | None = stride
        self._stride_per_key_per_rank: list[list[int]] | None = stride_per_key_per_rank
        self._stride_per_key: list[int] | None = stride_per_key
        self._length_per_key: list[int] | None = length_per_key
        self._lengths_offset_per_key: list[int] | None = lengths_offset_per_key
        self._offset_per_key: list[int] | None = offset_per_key
        self._index_per_key: dict[str, int] | None = index_per_key
        self._jt_dict: dict[str, JaggedTensor] | None = jt_dict
        self._inverse_indices: tuple[list[str], torch.Tensor] | None = inverse_indices
        # Layout proven safe for kernels (``_safety.ensure_safe_layout``); eager only.
        self._checked: bool = False

    # -- constructors ---------------------------------------------------------------------

    @staticmethod
    def from_lengths_sync(
        keys: list[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: list[list[int]] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> "KeyedJaggedTensor":
        """Construct and :meth:`sync` (``length_per_key``/``offset_per_key`` on the host)."""
        # positional: binding keyword arguments is a quarter of a construction's cost
        kjt = KeyedJaggedTensor(
            keys, values, weights, lengths, None, stride, stride_per_key_per_rank,
            inverse_indices=inverse_indices,
        )
        return kjt.sync()

    @staticmethod
    def from_offsets_sync(
        keys: list[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: list[list[int]] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> "KeyedJaggedTensor":
        """Construct and :meth:`sync` (``length_per_key``/``offset_per_key`` on the host)."""
        kjt = KeyedJaggedTensor(
            keys, values, weights, None, offsets, stride, stride_per_key_per_rank,
            inverse_indices=inverse_indices,
        )
        return kjt.sync()

    @staticmethod
    def from_jt_dict(
        jt_dict: dict[str, JaggedTensor], force_variable_stride: bool = False
    ) -> "KeyedJaggedTensor":
        """One key per entry, in dict order; all weighted or none. If the batch sizes differ,
        or with ``force_variable_stride`` (TorchRec 1.9) even when they are equal, the result
        has a variable batch per key (``stride_per_key_per_rank = [[b] ...]``)."""
        return _kjt_from_jt_dict(jt_dict, force_variable_stride)

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: Optional[torch.device] = None,  # noqa: UP045 (TorchScript)
        values_dtype: Optional[torch.dtype] = None,  # noqa: UP045
        weights_dtype: Optional[torch.dtype] = None,  # noqa: UP045
        lengths_dtype: torch.dtype = torch.int32,
    ) -> "KeyedJaggedTensor":
        """No keys, stride 0."""
        weights = torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None
        return KeyedJaggedTensor(
            keys=torch.jit.annotate(list[str], []),
            values=torch.empty(0, dtype=values_dtype, device=device),
            weights=weights,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            stride=0,
            offsets=None,
            stride_per_key_per_rank=None,
            stride_per_key=None,
            length_per_key=None,
            lengths_offset_per_key=None,
            offset_per_key=None,
            index_per_key=None,
            jt_dict=None,
            inverse_indices=None,
        )

    @staticmethod
    def empty_like(kjt: "KeyedJaggedTensor") -> "KeyedJaggedTensor":
        """No keys, but ``kjt``'s stride (or per-key strides), device and dtypes."""
        return _kjt_empty_like(kjt)

    @staticmethod
    def concat(kjt_list: list["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
        """Keys of all inputs side by side (same stride, or all variable-batch; all weighted
        or none; inverse indices on all or none, concatenated)."""
        return _kjt_concat(kjt_list)

    # -- accessors --------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        weights = self._weights
        if weights is None:
            raise ValueError("This KeyedJaggedTensor has no weights; use weights_or_none().")
        return weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def lengths(self) -> torch.Tensor:
        lengths = self._lengths
        if lengths is None:
            lengths = _kjt_ops.lengths_from_offsets(self._offsets)
            self._lengths = lengths
        return lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        offsets = self._offsets
        if offsets is None:
            offsets = _kjt_ops.offsets_from_lengths(self._lengths)
            self._offsets = offsets
        return offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        return self._offsets

    def device(self) -> torch.device:
        return self._values.device

    def size_in_bytes(self) -> int:
        """Bytes of values, weights, lengths and offsets (those computed so far), plus the
        per-rank strides counted as int32 (TorchRec keeps them in an int32 tensor)."""
        size = self._values.element_size() * self._values.numel()
        for t in (self._weights, self._lengths, self._offsets):
            if t is not None:
                size += t.element_size() * t.numel()
        spkpr = self._stride_per_key_per_rank
        if spkpr is not None:
            for per_rank in spkpr:
                size += 4 * len(per_rank)
        return size

    def stride(self) -> int:
        """Batch size: given, or from the inverse indices / per-key strides / lengths."""
        stride = self._stride
        if stride is None:
            stride = _kjt_ops.compute_stride(
                self._keys,
                self._lengths,
                self._offsets,
                self._stride_per_key_per_rank,
                self._inverse_indices,
            )
            self._stride = stride
        return stride

    def stride_per_key(self) -> list[int]:
        """Bags per key: ``sum(stride_per_key_per_rank[k])`` for a variable batch, else
        ``[stride()] * len(keys)``."""
        stride_per_key = self._stride_per_key
        if stride_per_key is None:
            spkpr = self._stride_per_key_per_rank
            if spkpr is not None:
                stride_per_key = [sum(per_rank) for per_rank in spkpr]
            else:
                stride_per_key = [self.stride()] * len(self._keys)
            self._stride_per_key = stride_per_key
        return stride_per_key

    def stride_per_key_per_rank(self) -> list[list[int]]:
        """Per key, the bags each rank contributed; ``[]`` for a fixed batch (as TorchRec)."""
        spkpr = self._stride_per_key_per_rank
        return [] if spkpr is None else spkpr

    def variable_stride_per_key(self) -> bool:
        return self._stride_per_key_per_rank is not None

    def inverse_indices(self) -> tuple[list[str], torch.Tensor]:
        inverse = self._inverse_indices
        if inverse is None:
            raise ValueError(
                "This KeyedJaggedTensor has no inverse_indices; use inverse_indices_or_none()."
            )
        return inverse

    def inverse_indices_or_none(self) -> tuple[list[str], torch.Tensor] | None:
        return self._inverse_indices

    def length_per_key(self) -> list[int]:
        """Number of values per key (host ints; computing them syncs once, then cached)."""
        length_per_key = self._length_per_key
        if length_per_key is None and not torch.jit.is_scripting() and not self._checked:
            # The sync that computes the counts also proves the layout safe for kernels. A
            # malformed KJT still syncs (as in TorchRec); the ops that would use it raise.
            counts = self._counts_if_safe()
            if counts is not None:
                return counts
        if length_per_key is None:
            length_per_key = _kjt_ops.length_per_key(
                self._values,
                len(self._keys),
                self.stride_per_key(),
                self.variable_stride_per_key(),
                self._lengths,
                self._offsets,
            )
            self._length_per_key = length_per_key
        return length_per_key

    def length_per_key_or_none(self) -> list[int] | None:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        """Start of each key in ``values`` plus the end: ``len(keys) + 1`` host ints."""
        offset_per_key = self._offset_per_key
        if offset_per_key is None:
            length_per_key = self.length_per_key()
            # the safety check behind length_per_key may have cached the offsets too
            cached = self._offset_per_key
            offset_per_key = cached if cached is not None else _jit_ops.cumsum(length_per_key)
            self._offset_per_key = offset_per_key
        return offset_per_key

    def offset_per_key_or_none(self) -> list[int] | None:
        return self._offset_per_key

    def lengths_offset_per_key(self) -> list[int]:
        """Start of each key in ``lengths`` plus the end."""
        lengths_offset_per_key = self._lengths_offset_per_key
        if lengths_offset_per_key is None:
            lengths_offset_per_key = _jit_ops.cumsum(self.stride_per_key())
            self._lengths_offset_per_key = lengths_offset_per_key
        return lengths_offset_per_key

    def index_per_key(self) -> dict[str, int]:
        index_per_key = self._index_per_key
        if index_per_key is None:
            index_per_key = {key: i for i, key in enumerate(self._keys)}
            self._index_per_key = index_per_key
        return index_per_key

    def sync(self) -> "KeyedJaggedTensor":
        """Compute and cache ``length_per_key``/``offset_per_key`` now."""
        if self._offset_per_key is None:
            self.offset_per_key()
        return self

    def unsync(self) -> "KeyedJaggedTensor":
        """Drop the host-side caches (e.g. before tracing)."""
        self._length_per_key = None
        self._offset_per_key = None
        return self

    @torch.jit.unused
    def validate(self) -> "KeyedJaggedTensor":
        """Full check (one device sync; see ``validate_keyed_jagged_tensor``). Raises
        ``ValueError`` naming the key and the bad value; caches ``length_per_key``."""
        self._length_per_key = check_keyed_jagged_tensor(self)
        return self.sync()

    @torch.jit.unused
    def _ensure_safe(self) -> list[int]:
        """Prove the layout safe to hand to kernels (cached; see ``_safety``); length_per_key."""
        return ensure_safe_layout(self)

    @torch.jit.unused
    def _counts_if_safe(self) -> Optional[list[int]]:  # noqa: UP045 (TorchScript)
        """``length_per_key`` if the layout is safe, else None (the caller computes it anyway)."""
        counts = fixed_batch_fast_path(self)  # the common case: one C pass, no exceptions
        if counts is not None:
            return counts
        try:
            return ensure_safe_layout(self)
        except ValueError:
            return None

    # -- per-key views ----------------------------------------------------------------------

    def __getitem__(self, key: str) -> JaggedTensor:
        index_per_key = self.index_per_key()
        if key not in index_per_key:
            raise KeyError(f"KeyedJaggedTensor has no key '{key}'; its keys are {self._keys}.")
        jt_dict = self._jt_dict
        if jt_dict is not None:
            return jt_dict[key]
        if not torch.jit.is_scripting():
            self._ensure_safe()
        return _kjt_ops.key_view(
            self._values,
            self._weights,
            self.lengths(),
            self.offset_per_key(),
            self.lengths_offset_per_key(),
            index_per_key[key],
        )

    def to_dict(self, compute_offsets: bool = True) -> dict[str, JaggedTensor]:
        """``{key: JaggedTensor}`` of views (no copy per key), cached on this KJT."""
        jt_dict = self._jt_dict
        if len(self._keys) == 0:
            return {}
        if jt_dict is None:
            if not torch.jit.is_scripting():
                self._ensure_safe()
            jt_dict = _kjt_ops.to_dict(
                self._keys,
                self._values,
                self._weights,
                self.lengths(),
                self.stride_per_key(),
                self.variable_stride_per_key(),
                self.length_per_key(),
                compute_offsets,
            )
            self._jt_dict = jt_dict
        return jt_dict

    # -- key reordering -------------------------------------------------------------------

    def permute(
        self, indices: list[int], indices_tensor: torch.Tensor | None = None
    ) -> "KeyedJaggedTensor":
        """Keys in the order ``indices`` (repeats allowed); values move with their keys::

            keys [a, b], lengths [1, 2 | 0, 3], permute([1, 0, 1])
            -> keys [b, a, b], lengths [0, 3 | 1, 2 | 0, 3]

        ``indices_tensor`` is ``indices`` already on the device (int32). Variable-batch
        strides move with their keys; inverse indices are dropped (as in TorchRec).
        """
        indices = _kjt_ops.check_permute(indices, self._keys)
        if not torch.jit.is_scripting():
            self._ensure_safe()
        length_per_key = self.length_per_key()
        stride_per_key = self.stride_per_key()
        lengths, values, weights = _jit_ops.permute_keys(
            indices,
            indices_tensor,
            self.lengths(),
            self._values,
            self._weights,
            stride_per_key,
            length_per_key,
            not self.variable_stride_per_key(),
        )
        spkpr = self._stride_per_key_per_rank
        new_keys = [self._keys[i] for i in indices]
        new_stride = None if spkpr is not None else self.stride()
        new_spkpr = None if spkpr is None else [spkpr[i] for i in indices]
        new_stride_per_key = [stride_per_key[i] for i in indices]
        new_length_per_key = [length_per_key[i] for i in indices]
        if torch.jit.is_scripting():
            return KeyedJaggedTensor(
                keys=new_keys,
                values=values,
                weights=weights,
                lengths=lengths,
                offsets=None,
                stride=new_stride,
                stride_per_key_per_rank=new_spkpr,
                stride_per_key=new_stride_per_key,
                length_per_key=new_length_per_key,
                lengths_offset_per_key=None,
                offset_per_key=None,
                index_per_key=None,
                jt_dict=None,
                inverse_indices=None,
            )
        else:
            return _derived_kjt(
                new_keys,
                values,
                weights,
                lengths,
                new_stride,
                new_spkpr,
                new_stride_per_key,
                new_length_per_key,
            )

    def split(self, segments: list[int]) -> list["KeyedJaggedTensor"]:
        """Consecutive groups of ``segments[i]`` keys; every part is a view (no copy). A part
        with every key is this KJT; parts keep this KJT's ``stride()`` (as in TorchRec)."""
        _kjt_ops.check_split(segments, self._keys)
        if not torch.jit.is_scripting():
            return self._split_eager(segments)
        offset_per_key = self.offset_per_key()
        length_per_key = self.length_per_key()
        lengths_offset_per_key = self.lengths_offset_per_key()
        lengths = self.lengths().reshape(-1)
        spkpr = self._stride_per_key_per_rank
        weights = self._weights
        stride = self.stride()
        parts: list[KeyedJaggedTensor] = []
        start = 0
        for segment in segments:
            end = start + segment
            if segment == len(self._keys):
                parts.append(self)
            else:
                lo, hi = offset_per_key[start], offset_per_key[end]
                parts.append(
                    KeyedJaggedTensor(
                        keys=self._keys[start:end],
                        values=self._values[lo:hi],
                        weights=None if weights is None else weights[lo:hi],
                        lengths=lengths[lengths_offset_per_key[start] : lengths_offset_per_key[end]],
                        offsets=None,
                        stride=stride,
                        stride_per_key_per_rank=None if spkpr is None else spkpr[start:end],
                        stride_per_key=None,
                        length_per_key=length_per_key[start:end],
                        lengths_offset_per_key=None,
                        offset_per_key=None,
                        index_per_key=None,
                        jt_dict=None,
                        inverse_indices=None,
                    )
                )
            start = end
        return parts

    @torch.jit.unused
    def _split_eager(self, segments: list[int]) -> list["KeyedJaggedTensor"]:
        """``split`` in eager mode: the layout proven (once per KJT), then each tensor cut into
        all its parts by one ``split_with_sizes``: one dispatch per tensor instead of a slice
        per part and tensor (a slice costs about 1.2 us, as much as the rest of a part)."""
        length_per_key = self._ensure_safe()
        keys = self._keys
        if len(segments) <= 1:
            return [self] if segments else []
        offset_per_key = self.offset_per_key()
        spkpr = self._stride_per_key_per_rank
        stride = self.stride()
        lengths = self.lengths()
        if lengths.dim() != 1:
            lengths = lengths.reshape(-1)
        values = self._values
        weights = self._weights
        value_sizes: list[int] = []
        length_sizes: list[int] = []
        start = 0
        if spkpr is None:  # a fixed batch: `stride` lengths per key
            for segment in segments:
                end = start + segment
                value_sizes.append(offset_per_key[end] - offset_per_key[start])
                length_sizes.append(segment * stride)
                start = end
        else:
            lengths_offset_per_key = self.lengths_offset_per_key()
            for segment in segments:
                end = start + segment
                value_sizes.append(offset_per_key[end] - offset_per_key[start])
                length_sizes.append(lengths_offset_per_key[end] - lengths_offset_per_key[start])
                start = end
        rest = values.size(0) - offset_per_key[-1]  # values past the last key's bags
        if rest:
            value_sizes.append(rest)
        length_parts = lengths.split_with_sizes(length_sizes)
        if values.requires_grad or (weights is not None and weights.requires_grad):
            # autograd forbids in-place changes to views from a multi-view op; slices allow them
            value_parts = _slices(values, value_sizes)
            weight_parts = None if weights is None else _slices(weights, value_sizes)
        else:
            value_parts = values.split_with_sizes(value_sizes)
            weight_parts = None if weights is None else weights.split_with_sizes(value_sizes)
        parts: list[KeyedJaggedTensor] = []
        start = 0
        for i, segment in enumerate(segments):
            end = start + segment
            if segment == len(keys):
                parts.append(self)
            else:
                parts.append(
                    _derived_kjt(
                        keys[start:end],
                        value_parts[i],
                        None if weight_parts is None else weight_parts[i],
                        length_parts[i],
                        stride,
                        None if spkpr is None else spkpr[start:end],
                        None,
                        length_per_key[start:end],
                    )
                )
            start = end
        return parts

    @torch.jit.unused
    def index_select_batch(self, indices: torch.Tensor | list[int]) -> "KeyedJaggedTensor":
        """Keep batch rows ``indices`` (any order, repeats allowed) in every key.

        Not in TorchRec; our addition for sub-batching and re-ordering samples. ``stride()``
        becomes ``len(indices)``; fixed batch only. Indices are bounds-checked (one sync)::

            lengths [1, 2 | 0, 1], indices [1, 1, 0] -> lengths [2, 2, 1 | 1, 1, 0]
        """
        if self.variable_stride_per_key():
            raise ValueError(
                "KeyedJaggedTensor.index_select_batch: needs a fixed batch, but this KJT has a "
                "variable batch per key."
            )
        self._ensure_safe()
        values, weights, lengths, stride = index_select_batch(
            "KeyedJaggedTensor.index_select_batch",
            self._values,
            self._weights,
            self.lengths().reshape(-1),
            self.offsets(),
            self.stride(),
            indices,
        )
        return KeyedJaggedTensor(self._keys, values, weights, lengths, stride=stride)

    def flatten_lengths(self) -> "KeyedJaggedTensor":
        """Same data with 1-D lengths."""
        return KeyedJaggedTensor(
            keys=self._keys,
            values=self._values,
            weights=self._weights,
            lengths=self.lengths().reshape(-1),
            stride=self._stride,
            stride_per_key_per_rank=self._stride_per_key_per_rank,
            length_per_key=self._length_per_key,
            offsets=None,
            stride_per_key=None,
            lengths_offset_per_key=None,
            offset_per_key=None,
            index_per_key=None,
            jt_dict=None,
            inverse_indices=None,
        )

    # -- device movement ------------------------------------------------------------------

    def to(
        self,
        device: torch.device,
        non_blocking: bool = False,
        dtype: Optional[torch.dtype] = None,  # noqa: UP045 (TorchScript)
    ) -> "KeyedJaggedTensor":
        """Move every tensor (inverse indices too); ``dtype`` converts the weights only."""
        weights, lengths, offsets = self._weights, self._lengths, self._offsets
        inverse = self._inverse_indices
        return KeyedJaggedTensor(
            keys=self._keys,
            values=self._values.to(device, non_blocking=non_blocking),
            weights=None
            if weights is None
            else weights.to(device=device, dtype=dtype, non_blocking=non_blocking),
            lengths=None if lengths is None else lengths.to(device, non_blocking=non_blocking),
            offsets=None if offsets is None else offsets.to(device, non_blocking=non_blocking),
            stride=self._stride,
            stride_per_key_per_rank=self._stride_per_key_per_rank,
            stride_per_key=self._stride_per_key,
            length_per_key=self._length_per_key,
            lengths_offset_per_key=self._lengths_offset_per_key,
            offset_per_key=self._offset_per_key,
            index_per_key=self._index_per_key,
            inverse_indices=None
            if inverse is None
            else (inverse[0], inverse[1].to(device, non_blocking=non_blocking)),
            jt_dict=None,
        )

    def pin_memory(self) -> "KeyedJaggedTensor":
        weights, lengths, offsets = self._weights, self._lengths, self._offsets
        inverse = self._inverse_indices
        return KeyedJaggedTensor(
            keys=self._keys,
            values=self._values.pin_memory(),
            weights=None if weights is None else weights.pin_memory(),
            lengths=None if lengths is None else lengths.pin_memory(),
            offsets=None if offsets is None else offsets.pin_memory(),
            stride=self._stride,
            stride_per_key_per_rank=self._stride_per_key_per_rank,
            stride_per_key=self._stride_per_key,
            length_per_key=self._length_per_key,
            lengths_offset_per_key=self._lengths_offset_per_key,
            offset_per_key=self._offset_per_key,
            index_per_key=self._index_per_key,
            inverse_indices=None if inverse is None else (inverse[0], inverse[1].pin_memory()),
            jt_dict=None,
        )

    # -- what the input all-to-all sends (TorchRec's dist_* protocol) -------------------------

    def dist_labels(self) -> list[str]:
        """Names of :meth:`dist_tensors`, in order."""
        labels = ["lengths", "values"]
        if self.variable_stride_per_key():
            labels.append("strides")
        if self._weights is not None:
            labels.append("weights")
        return labels

    def dist_splits(self, key_splits: list[int]) -> list[list[int]]:
        """Per destination (``key_splits[i]`` consecutive keys each): how many lengths and
        values go there (+ keys, for a variable batch) (+ weights)."""
        if not torch.jit.is_scripting():
            self._ensure_safe()
        batch_per_split = _kjt_ops.sum_by_splits(self.stride_per_key(), key_splits)
        length_per_split = _kjt_ops.sum_by_splits(self.length_per_key(), key_splits)
        splits = [batch_per_split, length_per_split]
        if self.variable_stride_per_key():
            splits.append(key_splits)
        if self._weights is not None:
            splits.append(length_per_split)
        return splits

    def dist_tensors(self) -> list[torch.Tensor]:
        """The tensors an input all-to-all sends: lengths, values (+ per-key batch sizes for
        a variable batch) (+ weights)."""
        tensors = [self.lengths(), self._values]
        if self.variable_stride_per_key():
            tensors.append(torch.tensor(self.stride_per_key(), device=self.device()))
        weights = self._weights
        if weights is not None:
            tensors.append(weights)
        return tensors

    @staticmethod
    def dist_init(
        keys: list[str],
        tensors: list[torch.Tensor],
        variable_stride_per_key: bool,
        num_workers: int,
        recat: torch.Tensor | None,
        stride_per_rank: list[int] | None,
        stagger: int = 1,
    ) -> "KeyedJaggedTensor":
        """The KJT a rank holds after an input all-to-all received ``tensors`` (rank-major
        (rank, key) segments; ``recat`` puts them key-major). Synced."""
        lengths, values, weights, spkpr, stride = _kjt_ops.dist_init_parts(
            len(keys),
            tensors,
            variable_stride_per_key,
            num_workers,
            recat,
            stride_per_rank,
            stagger,
        )
        kjt = KeyedJaggedTensor(
            keys=keys,
            values=values,
            weights=weights,
            lengths=lengths,
            offsets=None,
            stride=stride,
            stride_per_key_per_rank=spkpr,
            stride_per_key=None,
            length_per_key=None,
            lengths_offset_per_key=None,
            offset_per_key=None,
            index_per_key=None,
            jt_dict=None,
            inverse_indices=None,
        )
        return kjt.sync()

    @torch.jit.unused
    def clear_storage(self) -> None:
        """Free the memory of every tensor in place (their storages shrink to 0 bytes); the
        KJT must not be read afterwards. For releasing a batch early, as in TorchRec."""
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.untyped_storage().resize_(0)

    @torch.jit.unused
    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.record_stream(stream)

    @torch.jit.unused
    def __str__(self) -> str:
        if not self._keys or (self._lengths is None and self._offsets is None):
            return "KeyedJaggedTensor()\n"
        return keyed_jagged_string(
            self._keys, self._values, self._weights, self.offsets().tolist(), self.stride_per_key()
        )


def _slices(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Consecutive slices of ``t`` along dim 0 (``sizes`` may leave a rest uncovered)."""
    out: list[torch.Tensor] = []
    start = 0
    for size in sizes:
        out.append(t[start : start + size])
        start += size
    return out


def _derived_kjt(
    keys: list[str],
    values: torch.Tensor,
    weights: torch.Tensor | None,
    lengths: torch.Tensor,
    stride: int | None,
    stride_per_key_per_rank: list[list[int]] | None,
    stride_per_key: list[int] | None,
    length_per_key: list[int] | None,
) -> KeyedJaggedTensor:
    """Eager only: a KJT made from parts of a checked one (split, permute) without the
    constructor's input checks and metaclass, the hot path's main cost."""
    kjt = object.__new__(KeyedJaggedTensor)
    kjt._keys, kjt._values, kjt._weights, kjt._lengths = keys, values, weights, lengths
    kjt._offsets, kjt._stride = None, stride
    kjt._stride_per_key_per_rank, kjt._stride_per_key = stride_per_key_per_rank, stride_per_key
    kjt._length_per_key, kjt._lengths_offset_per_key, kjt._offset_per_key = (
        length_per_key,
        None,
        None,
    )
    kjt._index_per_key, kjt._jt_dict, kjt._inverse_indices = None, None, None
    kjt._checked = True  # parts of a checked KJT
    return kjt


# Static constructors' bodies live in fx-wrapped functions: they read host metadata of their
# inputs, so an fx trace records each as one call instead of tracing into it.


@torch.fx.wrap
def _kjt_from_jt_dict(
    jt_dict: dict[str, JaggedTensor], force_variable_stride: bool = False
) -> KeyedJaggedTensor:
    keys = list(jt_dict.keys())
    jts = list(jt_dict.values())
    if len(jts) == 0:
        return KeyedJaggedTensor.empty()
    strides = [jt.lengths().numel() for jt in jts]
    _kjt_ops.check_jt_dict(keys, strides, [jt.weights_or_none() is not None for jt in jts])
    weights: torch.Tensor | None = None
    if jts[0].weights_or_none() is not None:
        weights = torch.cat([jt.weights() for jt in jts])
    variable = force_variable_stride or any([s != strides[0] for s in strides])
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([jt.values() for jt in jts]),
        weights=weights,
        lengths=torch.cat([jt.lengths().reshape(-1) for jt in jts]),
        stride=None if variable else strides[0],
        stride_per_key_per_rank=[[s] for s in strides] if variable else None,
        length_per_key=[jt.values().size(0) for jt in jts],
        offsets=None,
        stride_per_key=None,
        lengths_offset_per_key=None,
        offset_per_key=None,
        index_per_key=None,
        jt_dict=None,
        inverse_indices=None,
    )


@torch.fx.wrap
def _kjt_empty_like(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    weights = kjt.weights_or_none()
    variable = kjt.variable_stride_per_key()
    return KeyedJaggedTensor(
        keys=torch.jit.annotate(list[str], []),
        values=kjt.values().new_empty(0),
        weights=None if weights is None else weights.new_empty(0),
        lengths=kjt.lengths().new_empty(0),
        stride=None if variable else kjt.stride(),
        stride_per_key_per_rank=kjt._stride_per_key_per_rank if variable else None,
        offsets=None,
        stride_per_key=None,
        length_per_key=None,
        lengths_offset_per_key=None,
        offset_per_key=None,
        index_per_key=None,
        jt_dict=None,
        inverse_indices=None,
    )


@torch.fx.wrap
def _kjt_concat(kjt_list: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    _kjt_ops.concat_layout(
        [k.stride() if not k.variable_stride_per_key() else 0 for k in kjt_list],
        [k.variable_stride_per_key() for k in kjt_list],
        [k.keys() for k in kjt_list],
        [k.weights_or_none() is not None for k in kjt_list],
        [k.inverse_indices_or_none() is not None for k in kjt_list],
    )
    first = kjt_list[0]
    keys: list[str] = []
    # TorchRec's semantics: no sync here. The parts are concatenated whole (a part may be
    # inconsistent on its own, e.g. values split at another place than the lengths, as long
    # as the result is consistent); the result is checked, like any KJT, before a kernel reads
    # it. Per-key counts carry over only when every part has them cached.
    length_per_key: list[int] = []
    has_length_per_key = True
    spkpr: list[list[int]] = []
    weights: list[torch.Tensor] = []
    inverse_keys: list[str] = []
    inverse_tensors: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for kjt in kjt_list:
        keys.extend(kjt.keys())
        counts = kjt.length_per_key_or_none()
        if counts is None:
            has_length_per_key = False
        elif has_length_per_key:
            length_per_key = length_per_key + counts
        values.append(kjt.values())
        w = kjt.weights_or_none()
        if w is not None:
            weights.append(w)
        if kjt.variable_stride_per_key():
            spkpr.extend(kjt.stride_per_key_per_rank())
        inverse = kjt.inverse_indices_or_none()
        if inverse is not None:
            inverse_keys.extend(inverse[0])
            inverse_tensors.append(inverse[1])
    variable = first.variable_stride_per_key()
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values),
        weights=torch.cat(weights) if len(weights) > 0 else None,
        lengths=torch.cat([k.lengths().reshape(-1) for k in kjt_list]),
        stride=None if variable else first.stride(),
        stride_per_key_per_rank=spkpr if variable else None,
        length_per_key=length_per_key if has_length_per_key else None,
        inverse_indices=(inverse_keys, torch.cat(inverse_tensors))
        if len(inverse_tensors) > 0
        else None,
        offsets=None,
        stride_per_key=None,
        lengths_offset_per_key=None,
        offset_per_key=None,
        index_per_key=None,
        jt_dict=None,
    )


def _flatten(kjt: KeyedJaggedTensor) -> tuple[list[torch.Tensor | None], Any]:
    children = [kjt._values, kjt._weights, kjt._lengths, kjt._offsets]
    inverse = kjt._inverse_indices
    if inverse is not None:
        children.append(inverse[1])
    return children, (
        kjt._keys,
        kjt._stride_per_key_per_rank,
        None if inverse is None else inverse[0],
    )


def _flatten_with_keys(kjt: KeyedJaggedTensor) -> tuple[list[tuple[KeyEntry, Any]], Any]:
    children, context = _flatten(kjt)
    names = ("_values", "_weights", "_lengths", "_offsets", "_inverse_indices")
    return [(GetAttrKey(name), t) for name, t in zip(names, children, strict=False)], context


def _unflatten(children: Any, context: Any) -> "KeyedJaggedTensor":
    keys, spkpr, inverse_keys = context
    values, weights, lengths, offsets = children[:4]
    return KeyedJaggedTensor(
        keys=list(keys),
        values=values,
        weights=weights,
        lengths=lengths,
        offsets=offsets,
        stride_per_key_per_rank=spkpr,
        inverse_indices=None if inverse_keys is None else (list(inverse_keys), children[4]),
        stride=None,
        stride_per_key=None,
        length_per_key=None,
        lengths_offset_per_key=None,
        offset_per_key=None,
        index_per_key=None,
        jt_dict=None,
    )


register_pytree_node(
    KeyedJaggedTensor,
    _flatten,
    _unflatten,
    serialized_type_name="recsys_core.sparse.KeyedJaggedTensor",
    flatten_with_keys_fn=_flatten_with_keys,
)


def _flatten_spec(kjt: KeyedJaggedTensor, spec: TreeSpec) -> list[torch.Tensor | None]:
    return _flatten(kjt)[0]


register_pytree_flatten_spec(KeyedJaggedTensor, _flatten_spec)
