"""bucketize_kjt_before_all2all (TorchRec's row-wise bucketization): the docstring's worked
example by hand, and FBGEMM's block_bucketize_sparse_features as an independent reference."""

from __future__ import annotations

import pytest
import torch

import recsys_core.kernels  # noqa: F401  (loads FBGEMM's operators where installed)
from recsys_core import KeyedJaggedTensor
from recsys_core.distributed.embedding_sharding import bucketize_kjt_before_all2all


def test_worked_example() -> None:
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 6, 3, 5]), lengths=torch.tensor([3, 1]),
                            weights=torch.tensor([0.1, 0.2, 0.3, 0.4]))
    out, permute = bucketize_kjt_before_all2all(kjt, 2, torch.tensor([4]), output_permute=True)
    assert out.keys() == ["f", "f"]
    assert out.lengths().tolist() == [2, 0, 1, 1]
    assert out.values().tolist() == [1, 3, 2, 1]
    torch.testing.assert_close(out.weights(), torch.tensor([0.1, 0.3, 0.2, 0.4]))
    assert permute.tolist() == [0, 2, 1, 3]
    kept, _ = bucketize_kjt_before_all2all(kjt, 2, torch.tensor([4]), keep_original_indices=True)
    assert kept.values().tolist() == [1, 3, 6, 5]
    pos, _ = bucketize_kjt_before_all2all(kjt, 2, torch.tensor([4]), bucketize_pos=True)
    assert pos.weights().tolist() == [0.0, 2.0, 1.0, 0.0]  # each id's place in its bag


def test_ids_past_the_blocks_go_round_robin() -> None:
    # 3 buckets of 2 rows cover ids 0..5; id 7 -> bucket 7 % 3 = 1, local id 7 // 3 = 2
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([7, 0]), lengths=torch.tensor([2]))
    out, _ = bucketize_kjt_before_all2all(kjt, 3, torch.tensor([2]))
    assert out.lengths().tolist() == [1, 1, 0]
    assert out.values().tolist() == [0, 2]


def test_bad_arguments_are_clear_errors() -> None:
    kjt = KeyedJaggedTensor(keys=["f", "g"], values=torch.tensor([1]), lengths=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="block sizes for 2 features"):
        bucketize_kjt_before_all2all(kjt, 2, torch.tensor([4]))
    with pytest.raises(ValueError, match="uneven"):
        bucketize_kjt_before_all2all(kjt, 2, torch.tensor([4, 4]), total_num_blocks=torch.tensor([4, 4]))


@pytest.mark.skipif(not hasattr(torch.ops.fbgemm, "block_bucketize_sparse_features"),
                    reason="FBGEMM's operator is not installed")
def test_matches_fbgemm_block_bucketize() -> None:
    gen = torch.Generator().manual_seed(0)
    keys, batch, buckets = ["a", "b", "c"], 5, 3
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=gen)
    blocks = torch.tensor([5, 9, 13])
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
    out, permute = bucketize_kjt_before_all2all(kjt, buckets, blocks, output_permute=True)
    ref = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths, values, False, True, blocks, buckets, None)
    assert out.lengths().tolist() == ref[0].tolist()
    assert out.values().tolist() == ref[1].tolist()
    assert permute.tolist() == ref[4].tolist()
