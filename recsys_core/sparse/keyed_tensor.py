"""KeyedTensor: dense per-key tensors (e.g. pooled embeddings) side by side in one tensor."""

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch
from torch.fx._pytree import register_pytree_flatten_spec
from torch.utils._pytree import GetAttrKey, KeyEntry, TreeSpec, register_pytree_node

from recsys_core.kernels import sparse_ops
from recsys_core.sparse import _jit_ops
from recsys_core.sparse._fx import SparseTypeMeta

_OWNER = "KeyedTensor"


class KeyedTensor(metaclass=SparseTypeMeta):
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
        keys: list[str],
        length_per_key: list[int],
        values: torch.Tensor,
        key_dim: int = 1,
        offset_per_key: list[int] | None = None,
        index_per_key: dict[str, int] | None = None,
    ) -> None:
        if not torch.jit.is_scripting():
            keys, length_per_key = _check_inputs(
                keys, length_per_key, values, key_dim, offset_per_key
            )
        self._keys: list[str] = keys
        self._length_per_key: list[int] = length_per_key
        self._values: torch.Tensor = values
        self._key_dim: int = key_dim
        self._offset_per_key: list[int] | None = offset_per_key
        self._index_per_key: dict[str, int] | None = index_per_key

    @staticmethod
    def from_tensor_list(
        keys: list[str],
        tensors: list[torch.Tensor],
        key_dim: int = 1,
        cat_dim: int = 1,
    ) -> "KeyedTensor":
        """Concatenate ``tensors`` (one per key) along ``cat_dim``."""
        if len(keys) != len(tensors):
            raise ValueError(
                f"KeyedTensor.from_tensor_list: {len(keys)} keys but {len(tensors)} tensors."
            )
        return KeyedTensor(
            keys=keys,
            length_per_key=[t.size(key_dim) for t in tensors],
            values=torch.cat(tensors, dim=cat_dim),
            key_dim=key_dim,
            offset_per_key=None,
            index_per_key=None,
        )

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def size_in_bytes(self) -> int:
        return self._values.element_size() * self._values.numel()

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        offset_per_key = self._offset_per_key
        if offset_per_key is None:
            offset_per_key = _jit_ops.cumsum(self._length_per_key)
            self._offset_per_key = offset_per_key
        return offset_per_key

    def index_per_key(self) -> dict[str, int]:
        index_per_key = self._index_per_key
        if index_per_key is None:
            index_per_key = {key: i for i, key in enumerate(self._keys)}
            self._index_per_key = index_per_key
        return index_per_key

    def __getitem__(self, key: str) -> torch.Tensor:
        index_per_key = self.index_per_key()
        if key not in index_per_key:
            raise KeyError(f"KeyedTensor has no key '{key}'; its keys are {self._keys}.")
        index = index_per_key[key]
        return self._values.narrow(
            self._key_dim, self.offset_per_key()[index], self._length_per_key[index]
        )

    def to_dict(self) -> dict[str, torch.Tensor]:
        """``{key: view}`` from one split of ``values``."""
        out: dict[str, torch.Tensor] = {}
        if len(self._keys) == 0:
            return out
        parts = torch.split(self._values, self._length_per_key, dim=self._key_dim)
        for i, key in enumerate(self._keys):
            out[key] = parts[i]
        return out

    @staticmethod
    def regroup(keyed_tensors: list["KeyedTensor"], groups: list[list[str]]) -> list[torch.Tensor]:
        """One tensor per group: the group's keys concatenated along the key dim, in order.

        Differentiable; a key may appear in several groups. Keys must be unique across
        ``keyed_tensors``; every KeyedTensor needs the same key_dim and batch size.
        """
        return _regroup_keyed_tensors(keyed_tensors, groups)

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: list["KeyedTensor"], groups: list[list[str]], keys: list[str]
    ) -> dict[str, torch.Tensor]:
        """:meth:`regroup`, with group ``i`` named ``keys[i]``."""
        if len(groups) != len(keys):
            raise ValueError(
                f"KeyedTensor.regroup_as_dict: {len(groups)} groups but {len(keys)} names; pass "
                "one name per group."
            )
        grouped = _regroup_keyed_tensors(keyed_tensors, groups)
        out: dict[str, torch.Tensor] = {}
        for i, key in enumerate(keys):
            out[key] = grouped[i]
        return out

    def to(self, device: torch.device, non_blocking: bool = False) -> "KeyedTensor":
        return KeyedTensor(
            keys=self._keys,
            length_per_key=self._length_per_key,
            values=self._values.to(device, non_blocking=non_blocking),
            key_dim=self._key_dim,
            offset_per_key=self._offset_per_key,
            index_per_key=self._index_per_key,
        )

    @torch.jit.unused
    def record_stream(self, stream: torch.Stream) -> None:
        self._values.record_stream(stream)

    @torch.jit.unused
    def __str__(self) -> str:
        if not self._keys:
            return "KeyedTensor()\n"
        lines = [f'    "{key}": {self[key].tolist()}' for key in self._keys]
        return "KeyedTensor({\n" + ",\n".join(lines) + "\n})\n"


def _check_inputs(
    keys: Sequence[str],
    length_per_key: Sequence[int],
    values: torch.Tensor,
    key_dim: int,
    offset_per_key: Sequence[int] | None,
) -> tuple[list[str], list[int]]:
    """The constructor's eager checks (shapes and counts only, no device sync)."""
    if isinstance(keys, str):
        raise ValueError(f"{_OWNER}: keys must be a list of strings, got the string {keys!r}.")
    keys, length_per_key = list(keys), list(length_per_key)
    if len(keys) != len(length_per_key):
        raise ValueError(
            f"{_OWNER}: {len(keys)} keys but {len(length_per_key)} entries in "
            "length_per_key; pass one width per key."
        )
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{_OWNER}: values must be a torch.Tensor, got {type(values).__name__}.")
    if not keys and values.numel() == 0:
        return keys, length_per_key  # TorchRec's empty KeyedTensor, e.g. KeyedTensor([], [], t)
    if not -values.dim() <= key_dim < values.dim():
        raise ValueError(
            f"{_OWNER}: key_dim {key_dim} is out of range for values of shape "
            f"{tuple(values.shape)}."
        )
    negative = [(k, n) for k, n in zip(keys, length_per_key, strict=True) if n < 0]
    if negative:
        raise ValueError(
            f"{_OWNER}: key '{negative[0][0]}' has width {negative[0][1]} in length_per_key; "
            "widths must be >= 0."
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
    if offset_per_key is not None:
        expected = list(accumulate(length_per_key, initial=0))
        if list(offset_per_key) != expected:
            raise ValueError(
                f"{_OWNER}: offset_per_key {list(offset_per_key)} does not match length_per_key "
                f"(expected {expected}); drop it or fix it."
            )
    return keys, length_per_key


@torch.fx.wrap
def _regroup_keyed_tensors(
    keyed_tensors: list[KeyedTensor], groups: list[list[str]]
) -> list[torch.Tensor]:
    """KeyedTensor.regroup's body; one node in an fx graph (it reads host metadata)."""
    if len(keyed_tensors) == 0:
        raise ValueError("KeyedTensor.regroup: got no keyed tensors.")
    key_dim = keyed_tensors[0].key_dim()
    for i, kt in enumerate(keyed_tensors):
        if kt.key_dim() != key_dim:
            raise ValueError(
                f"KeyedTensor.regroup: keyed tensor {i} (keys {kt.keys()}) has key_dim "
                f"{kt.key_dim()} but keyed tensor 0 has {key_dim}."
            )
    return _regroup(
        [kt.values() for kt in keyed_tensors],
        [kt.keys() for kt in keyed_tensors],
        [kt.length_per_key() for kt in keyed_tensors],
        groups,
        key_dim,
    )


@torch.fx.wrap
def regroup_kts(keyed_tensors: list[KeyedTensor], groups: list[list[str]]) -> list[torch.Tensor]:
    """TorchRec's free-function spelling of :meth:`KeyedTensor.regroup` (same result)."""
    return _regroup_keyed_tensors(keyed_tensors, groups)


@torch.fx.wrap
def permute_multi_embedding(
    keyed_tensors: list[KeyedTensor], groups: list[list[str]]
) -> list[torch.Tensor]:
    """TorchRec's name for the same regrouping (there: FBGEMM's permute_multi_embedding)."""
    return _regroup_keyed_tensors(keyed_tensors, groups)


@torch.fx.wrap
def _desugar_keyed_tensors(
    kts: list[KeyedTensor],
) -> tuple[list[list[str]], list[list[int]], list[torch.Tensor]]:
    """Keys, widths and values of each keyed tensor (TorchRec's helper)."""
    return (
        [kt.keys() for kt in kts],
        [kt.length_per_key() for kt in kts],
        [kt.values() for kt in kts],
    )


@torch.fx.wrap
def _all_keys_used_once(keyed_tensors: list[KeyedTensor], groups: list[list[str]]) -> bool:
    """True if the groups use every key of the keyed tensors exactly once (TorchRec's test for
    a plain permutation)."""
    keys = [k for kt in keyed_tensors for k in kt.keys()]
    grouped = [k for group in groups for k in group]
    return len(set(keys)) == len(set(grouped)) == len(keys) == len(grouped)


@torch.fx.wrap
def _fbgemm_permute_pooled_embs(
    keyed_tensors: list[KeyedTensor], groups: list[list[str]]
) -> list[torch.Tensor]:
    """TorchRec's name for the regrouping it runs with FBGEMM's ``permute_pooled_embs``
    (pooled embeddings, ``key_dim`` 1); here the same checked regroup as the others."""
    return _regroup_keyed_tensors(keyed_tensors, groups)


def _kt_regroup_arguments(
    value: torch.Tensor,
    keys: list[list[str]],
    key_lengths: list[list[int]],
    groups: list[list[str]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The plan FBGEMM's ``permute_multi_embedding`` executes: ``(permutes, in_shapes,
    out_shapes, out_lengths)``, tensors on ``value``'s device (int32).

    One ``permutes`` row per group entry: ``[in_tensor, out_tensor, in_start, out_start,
    length, jump]``. ``jump`` chains the rows of a key used more than once (the backward adds
    their gradients): the key's first row holds the next row's index, a middle row minus the
    next index, the last row ``-len(permutes)``; a key used once has 0. Two inputs, groups
    ``[[a, c], [a]]`` with ``a`` (width 2) in tensor 0 and ``c`` (width 3) in tensor 1::

        [[0, 0, 0, 0, 2, 2],     a -> group 0 at 0, next use in row 2
         [1, 0, 0, 2, 3, 0],     c -> group 0 at 2
         [0, 1, 0, 0, 2, -3]]    a -> group 1 at 0, last use
        in_shapes [2, 3]   out_shapes = out_lengths = [5, 2]
    """
    where: dict[str, tuple[int, int, int]] = {}
    for t, (names, widths) in enumerate(zip(keys, key_lengths, strict=True)):
        for name, start, width in zip(names, accumulate(widths, initial=0), widths, strict=False):
            where[name] = (t, start, width)
    rows: list[list[int]] = []
    uses: dict[str, list[int]] = {}
    out_lengths: list[int] = []
    for g, group in enumerate(groups):
        out_start = 0
        for name in group:
            if name not in where:
                raise ValueError(
                    f"_kt_regroup_arguments: group {g} asks for key '{name}', which none of "
                    f"the keyed tensors has (known keys: {sorted(where)})."
                )
            t, in_start, width = where[name]
            uses.setdefault(name, []).append(len(rows))
            rows.append([t, g, in_start, out_start, width, 0])
            out_start += width
        out_lengths.append(out_start)
    for chain in uses.values():
        if len(chain) > 1:
            for i, (row, nxt) in enumerate(zip(chain, chain[1:], strict=False)):
                rows[row][5] = nxt if i == 0 else -nxt
            rows[chain[-1]][5] = -len(rows)
    device = value.device
    permutes = torch.tensor(rows, dtype=torch.int32).view(len(rows), 6)
    in_shapes = torch.tensor([sum(widths) for widths in key_lengths], dtype=torch.int32)
    out_shapes = torch.tensor(out_lengths, dtype=torch.int32)
    return (
        permutes.to(device),
        in_shapes.to(device),
        out_shapes.to(device),
        out_lengths,
    )


def _regroup(
    values: list[torch.Tensor],
    keys: list[list[str]],
    lengths: list[list[int]],
    groups: list[list[str]],
    dim: int,
) -> list[torch.Tensor]:
    """Eager: ``sparse_ops`` (checked, FBGEMM where it pays); scripted: the same torch ops."""
    if not torch.jit.is_scripting():
        return sparse_ops.regroup_keyed_tensor(values, keys, lengths, groups, dim=dim)
    else:
        slices: dict[str, torch.Tensor] = {}
        for i in range(len(values)):
            parts = torch.split(values[i], lengths[i], dim=dim)
            for j, name in enumerate(keys[i]):
                slices[name] = parts[j]
        return [torch.cat([slices[name] for name in group], dim=dim) for group in groups]


def _flatten(kt: "KeyedTensor") -> tuple[list[torch.Tensor], tuple[list[str], list[int], int]]:
    return [kt._values], (kt._keys, kt._length_per_key, kt._key_dim)


def _flatten_with_keys(
    kt: "KeyedTensor",
) -> tuple[list[tuple[KeyEntry, Any]], tuple[list[str], list[int], int]]:
    children, context = _flatten(kt)
    return [(GetAttrKey("_values"), children[0])], context


def _unflatten(children: Any, context: Any) -> "KeyedTensor":
    keys, length_per_key, key_dim = context
    return KeyedTensor(list(keys), list(length_per_key), children[0], key_dim)


def _flatten_spec(kt: KeyedTensor, spec: TreeSpec) -> list[torch.Tensor]:
    """Flatten to ``spec``'s key order (an exported program may see the keys reordered)."""
    keys = list(spec.context[0])
    if kt.keys() == keys:
        return [kt.values()]
    return [_regroup_keyed_tensors([kt], [keys])[0]]


register_pytree_node(
    KeyedTensor,
    _flatten,
    _unflatten,
    serialized_type_name="recsys_core.sparse.KeyedTensor",
    flatten_with_keys_fn=_flatten_with_keys,
)
register_pytree_flatten_spec(KeyedTensor, _flatten_spec)
