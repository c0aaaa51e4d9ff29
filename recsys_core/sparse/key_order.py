"""From the key order a KeyedJaggedTensor arrives in to the order a module wants its features.

A module that owns features in a fixed order (its kernel's tables, a strategy's output) looks
each input up in that order. The permutation depends only on the input's keys, so it is computed
once per key order seen and cached::

    wanted = ["b", "a"];  input keys ("a", "b", "c")  ->  permute([1, 0])
    input keys ("b", "a")                             ->  None (already in order)
"""

from __future__ import annotations

from collections.abc import Sequence

from recsys_core.sparse.keyed_jagged_tensor import KeyedJaggedTensor


class KeyOrder:
    """The cached permutation from an input's keys to ``wanted`` (``owner`` names the module
    in errors)."""

    def __init__(self, wanted: Sequence[str], owner: str) -> None:
        self.wanted = list(wanted)
        self._owner = owner
        self._cache: dict[tuple[str, ...], list[int] | None] = {}

    def permutation(self, keys: Sequence[str]) -> list[int] | None:
        """Indices into ``keys`` of the wanted features, in wanted order; None when ``keys``
        already are the wanted order. Unique keys and every wanted feature are required."""
        key = tuple(keys)
        if key not in self._cache:
            if len(set(key)) != len(key):
                repeated = sorted({k for k in key if key.count(k) > 1})
                raise ValueError(
                    f"{self._owner}: keys must be unique, but {repeated} appear more than once "
                    "in the input KeyedJaggedTensor; give each feature once"
                )
            index = {k: i for i, k in enumerate(key)}
            missing = [f for f in self.wanted if f not in index]
            if missing:
                raise ValueError(
                    f"{self._owner}: features {missing} are missing from the input (keys "
                    f"{list(key)}); every table's features must be present"
                )
            order = [index[f] for f in self.wanted]
            self._cache[key] = None if order == list(range(len(key))) else order
        return self._cache[key]

    def apply(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` with exactly the wanted keys, in wanted order."""
        order = self.permutation(features.keys())
        return features if order is None else features.permute(order)
