"""KeyOrder: an input KJT's keys to the order a module wants (hand-computed permutations)."""

import pytest
import torch

from recsys_core.sparse import KeyedJaggedTensor
from recsys_core.sparse.key_order import KeyOrder


def test_permutation_by_hand() -> None:
    order = KeyOrder(["b", "a"], "M")
    assert order.permutation(("a", "b", "c")) == [1, 0]
    assert order.permutation(("b", "a")) is None  # already in order
    assert KeyOrder(["c", "c", "a"], "M").permutation(("a", "b", "c")) == [2, 2, 0]


def test_apply_selects_and_orders_values() -> None:
    # keys a, b, c; batch 2: a=[1],[2,3]  b=[],[4]  c=[5],[]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b", "c"], values=torch.tensor([1, 2, 3, 4, 5]),
        lengths=torch.tensor([1, 2, 0, 1, 1, 0]),
    )
    out = KeyOrder(["c", "a"], "M").apply(kjt)
    assert out.keys() == ["c", "a"]
    assert out.values().tolist() == [5, 1, 2, 3]
    assert out.lengths().tolist() == [1, 0, 1, 2]
    assert KeyOrder(["a", "b", "c"], "M").apply(kjt) is kjt


def test_errors_name_the_module_and_features() -> None:
    with pytest.raises(ValueError, match=r"M: features \['z'\] are missing from the input"):
        KeyOrder(["a", "z"], "M").permutation(("a", "b"))
    with pytest.raises(ValueError, match=r"M: keys must be unique, but \['a'\] appear more"):
        KeyOrder(["a"], "M").permutation(("a", "b", "a"))
