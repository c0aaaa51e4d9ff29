"""The one id range check (IdRangeCheck) and the packed-kernel spec."""

from __future__ import annotations

import pytest
import torch

from recsys_core import KeyedJaggedTensor
from recsys_core.kernels.config import FusedOptimizerConfig, KernelBackend
from recsys_core.kernels.id_check import IdOutOfRangeError, IdRangeCheck
from recsys_core.kernels.packed import PackedKernelSpec, PackedTable
from recsys_core.kernels.tbe import IdOutOfRangeError as TbeIdOutOfRangeError


def _kjt(values: list[int]) -> KeyedJaggedTensor:
    # keys a, b; batch 2; lengths a: [2, 1], b: [1, 0]
    return KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor(values), lengths=torch.tensor([2, 1, 1, 0]))


def test_good_ids_pass_and_the_verdict_is_ready() -> None:
    check = IdRangeCheck({"a": 5, "b": 3}, "here")
    pending = check.start(_kjt([4, 0, 1, 2]))
    pending.result()  # nothing to raise


@pytest.mark.parametrize(
    ("values", "feature", "bad", "rows"),
    [([4, 0, 1, 3], "b", 3, 3), ([4, -1, 1, 2], "a", -1, 5), ([5, 0, 1, 9], "a", 5, 5)],
)
def test_first_bad_id_is_named_with_its_feature(values: list[int], feature: str, bad: int, rows: int) -> None:
    check = IdRangeCheck({"a": 5, "b": 3}, "ShardedX, rank 0")
    with pytest.raises(IdOutOfRangeError) as info:
        check.start(_kjt(values))
    assert str(info.value) == (
        f"feature {feature!r}: id {bad} is outside [0, {rows}) of its table (ShardedX, rank 0); "
        "hash or clip ids to the table size before lookup"
    )
    assert IdOutOfRangeError is TbeIdOutOfRangeError  # one class, importable from both places


def test_key_order_and_unchecked_features() -> None:
    check = IdRangeCheck({"a": 5}, "here")
    kjt = KeyedJaggedTensor(keys=["b", "a"], values=torch.tensor([100, 4, 4]), lengths=torch.tensor([1, 0, 1, 1]))
    check.start(kjt).result()  # "b" has no table here: any id passes; "a" ids are in range
    bad = KeyedJaggedTensor(keys=["b", "a"], values=torch.tensor([100, 4, 5]), lengths=torch.tensor([1, 0, 1, 1]))
    with pytest.raises(IdOutOfRangeError, match=r"feature 'a': id 5 is outside \[0, 5\)"):
        check.start(bad)


def test_packed_spec_builds_a_kernel_per_table_with_spare_row_for_empty_shards() -> None:
    spec = PackedKernelSpec(
        tables=(PackedTable(name="x", rows=4, dim=4), PackedTable(name="y", rows=0, dim=8)),
        feature_table_map=(0, 0, 1), pooling_mean=False, weighted=False,
        optimizer=FusedOptimizerConfig(), backend=KernelBackend.TORCH,
    )
    kernel = spec.build(torch.device("cpu"))
    assert [tuple(w.shape) for w in kernel.split_embedding_weights()] == [(4, 4), (1, 8)]
    with pytest.raises(ValueError, match=r"names table index\(es\) \[2\]"):
        PackedKernelSpec(tables=spec.tables, feature_table_map=(0, 2), pooling_mean=False,
                         weighted=False, optimizer=FusedOptimizerConfig())
