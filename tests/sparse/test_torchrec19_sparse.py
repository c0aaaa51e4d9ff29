"""TorchRec 1.9's changes to the sparse types, with its values (torchrec/sparse/jagged_tensor.py
of 1.9.2): ``from_jt_dict(force_variable_stride=...)`` and the per-key offsets ``[0]`` of a KJT
with keys and no bags."""

from __future__ import annotations

import pytest
import torch

from recsys_core import JaggedTensor, KeyedJaggedTensor


def _jt_dict(second_lengths: list[int]) -> dict[str, JaggedTensor]:
    return {
        "a": JaggedTensor(values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1])),
        "b": JaggedTensor(
            values=torch.arange(sum(second_lengths)) + 10, lengths=torch.tensor(second_lengths)
        ),
    }


def test_from_jt_dict_force_variable_stride_keeps_per_key_strides() -> None:
    kjt = KeyedJaggedTensor.from_jt_dict(_jt_dict([0, 1]), force_variable_stride=True)
    assert kjt.variable_stride_per_key()
    assert kjt.stride_per_key_per_rank() == [[2], [2]]
    assert kjt.stride_per_key() == [2, 2]
    assert kjt.lengths().tolist() == [2, 1, 0, 1]
    assert kjt.values().tolist() == [1, 2, 3, 10]
    assert kjt.to_dict()["b"].lengths().tolist() == [0, 1]


def test_from_jt_dict_default_collapses_equal_strides() -> None:
    kjt = KeyedJaggedTensor.from_jt_dict(_jt_dict([0, 1]))
    assert not kjt.variable_stride_per_key()
    assert kjt.stride() == 2
    assert kjt.stride_per_key_per_rank() == []


@pytest.mark.parametrize("force", [False, True])
def test_from_jt_dict_unequal_strides_are_variable_either_way(force: bool) -> None:
    kjt = KeyedJaggedTensor.from_jt_dict(_jt_dict([0, 1, 2]), force_variable_stride=force)
    assert kjt.variable_stride_per_key()
    assert kjt.stride_per_key_per_rank() == [[2], [3]]


@pytest.mark.parametrize("compute_offsets", [True, False])
def test_keys_without_bags_give_offsets_zero_per_key(compute_offsets: bool) -> None:
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([], dtype=torch.int64),
        lengths=torch.tensor([], dtype=torch.int32),
    )
    jts = kjt.to_dict(compute_offsets=compute_offsets)
    for key in ("a", "b"):
        assert jts[key].lengths().tolist() == []
        assert jts[key].offsets().tolist() == [0]
        assert jts[key].offsets().dtype == torch.int32
        assert kjt[key].offsets().tolist() == [0]
