"""KeyedTensor: dense per-key tensors (e.g. pooled embeddings) side by side in one tensor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import GetAttrKey, KeyEntry, register_pytree_node

from recsys_core.kernels import sparse_ops

_OWNER = "KeyedTensor"


class KeyedTensor:
    """Dense tensors of one batch, one per key, concatenated along ``key_dim``.

    Pooled embeddings for a batch of 2, key ``a`` of dim 2 and key ``b`` of dim 3::

        keys            ["a", "b"]
        length_per_key  [2, 3]           offset_per_key [0, 2, 5]
        values          [[a0 a0 | b0 b0 b0],      shape [B, sum(length_per_key)] = [2, 5]
                         [a1 a1 | b1 b1 b1]]
        kt["b"]         [[b0 b0 b0], [b1 b1 b1]]  (a view, like every per-key access)

    :meth:`regroup` builds new groupings of keys across several KeyedTensors, differentiably.
    """

    __slots__ = (
        "_keys",
        "_length_per_key",
        "_values",
        "_key_dim",
        "_offset_per_key",
        "_index_per_key",
    )

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values: torch.Tensor,
        key_dim: int = 1,
        offset_per_key: Sequence[int] | None = None,
        index_per_key: dict[str, int] | None = None,
    ) -> None:
        if isinstance(keys, str):
            raise ValueError(f"{_OWNER}: keys must be a list of strings, got the string {keys!r}.")
        keys, length_per_key = list(keys), list(length_per_key)
        if len(keys) != len(length_per_key):
            raise ValueError(
                f"{_OWNER}: {len(keys)} keys but {len(length_per_key)} entries in "
                "length_per_key; pass one width per key."
            )
        if not isinstance(values, torch.Tensor):
            raise ValueError(
                f"{_OWNER}: values must be a torch.Tensor, got {type(values).__name__}."
            )
        if not -values.dim() <= key_dim < values.dim():
            raise ValueError(
                f"{_OWNER}: key_dim {key_dim} is out of range for values of shape "
                f"{tuple(values.shape)}."
            )
        if values.size(key_dim) != sum(length_per_key):
            raise ValueError(
                f"{_OWNER}: values has size {values.size(key_dim)} along key_dim {key_dim} but "
                f"length_per_key {length_per_key} sums to {sum(length_per_key)}."
            )
        if offset_per_key is not None and len(offset_per_key) != len(keys) + 1:
            raise ValueError(
                f"{_OWNER}: offset_per_key needs len(keys) + 1 = {len(keys) + 1} entries, got "
                f"{len(offset_per_key)}."
            )
        self._keys = keys
        self._length_per_key = length_per_key
        self._values = values
        self._key_dim = key_dim
        self._offset_per_key = None if offset_per_key is None else list(offset_per_key)
        self._index_per_key = index_per_key

    @staticmethod
    def from_tensor_list(
        keys: Sequence[str],
        tensors: Sequence[torch.Tensor],
        key_dim: int = 1,
        cat_dim: int = 1,
    ) -> KeyedTensor:
        """Concatenate ``tensors`` (one per key) along ``cat_dim``."""
        if len(keys) != len(tensors):
            raise ValueError(
                f"{_OWNER}.from_tensor_list: {len(keys)} keys but {len(tensors)} tensors."
            )
        return KeyedTensor(
            keys=keys,
            length_per_key=[t.size(key_dim) for t in tensors],
            values=torch.cat(list(tensors), dim=cat_dim),
            key_dim=key_dim,
        )

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        if self._offset_per_key is None:
            running, out = 0, [0]
            for n in self._length_per_key:
                running += n
                out.append(running)
            self._offset_per_key = out
        return self._offset_per_key

    def index_per_key(self) -> dict[str, int]:
        if self._index_per_key is None:
            self._index_per_key = {key: i for i, key in enumerate(self._keys)}
        return self._index_per_key

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            index = self.index_per_key()[key]
        except KeyError:
            raise KeyError(f"{_OWNER} has no key {key!r}; its keys are {self._keys}.") from None
        return self._values.narrow(
            self._key_dim, self.offset_per_key()[index], self._length_per_key[index]
        )

    def to_dict(self) -> dict[str, torch.Tensor]:
        """``{key: view}`` from one split of ``values``."""
        return dict(
            zip(
                self._keys, self._values.split(self._length_per_key, dim=self._key_dim), strict=True
            )
        )

    @staticmethod
    def regroup(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]
    ) -> list[torch.Tensor]:
        """One tensor per group: the group's keys concatenated along the key dim, in order.

        Differentiable; a key may appear in several groups. Keys must be unique across
        ``keyed_tensors``; every KeyedTensor needs the same key_dim and batch size.
        """
        if not keyed_tensors:
            raise ValueError(f"{_OWNER}.regroup: got no keyed tensors.")
        key_dim = keyed_tensors[0].key_dim()
        for i, kt in enumerate(keyed_tensors):
            if kt.key_dim() != key_dim:
                raise ValueError(
                    f"{_OWNER}.regroup: keyed tensor {i} (keys {kt.keys()}) has key_dim "
                    f"{kt.key_dim()} but keyed tensor 0 has {key_dim}."
                )
        return sparse_ops.regroup_keyed_tensor(
            [kt.values() for kt in keyed_tensors],
            [kt.keys() for kt in keyed_tensors],
            [kt.length_per_key() for kt in keyed_tensors],
            groups,
            dim=key_dim,
        )

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: Sequence[KeyedTensor],
        groups: Sequence[Sequence[str]],
        keys: Sequence[str],
    ) -> dict[str, torch.Tensor]:
        """:meth:`regroup`, with group ``i`` named ``keys[i]``."""
        if len(groups) != len(keys):
            raise ValueError(
                f"{_OWNER}.regroup_as_dict: {len(groups)} groups but {len(keys)} names; pass "
                "one name per group."
            )
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups), strict=True))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        return KeyedTensor(
            self._keys,
            self._length_per_key,
            self._values.to(device, non_blocking=non_blocking),
            self._key_dim,
            self._offset_per_key,
            self._index_per_key,
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self._values.record_stream(stream)

    def __str__(self) -> str:
        if not self._keys:
            return "KeyedTensor()\n"
        lines = [f'    "{key}": {self[key].tolist()}' for key in self._keys]
        return "KeyedTensor({\n" + ",\n".join(lines) + "\n})\n"


def _flatten(kt: KeyedTensor) -> tuple[list[torch.Tensor], tuple[list[str], list[int], int]]:
    return [kt._values], (kt._keys, kt._length_per_key, kt._key_dim)


def _flatten_with_keys(
    kt: KeyedTensor,
) -> tuple[list[tuple[KeyEntry, Any]], tuple[list[str], list[int], int]]:
    children, context = _flatten(kt)
    return [(GetAttrKey("_values"), children[0])], context


def _unflatten(children: Any, context: Any) -> KeyedTensor:
    keys, length_per_key, key_dim = context
    return KeyedTensor(list(keys), list(length_per_key), children[0], key_dim)


register_pytree_node(
    KeyedTensor,
    _flatten,
    _unflatten,
    serialized_type_name="recsys_core.sparse.KeyedTensor",
    flatten_with_keys_fn=_flatten_with_keys,
)
