"""TorchRec's dist_* protocol of KeyedJaggedTensor (what an input all-to-all sends and
rebuilds), with hand-computed layouts."""

import torch

from recsys_core.sparse import KeyedJaggedTensor


def test_dist_labels_splits_tensors_fixed_batch() -> None:
    # a: [1], [2, 3]   b: [], [4]   c: [5], []   (batch 2), weighted
    kjt = KeyedJaggedTensor(
        keys=["a", "b", "c"],
        values=torch.tensor([1, 2, 3, 4, 5]),
        lengths=torch.tensor([1, 2, 0, 1, 1, 0]),
        weights=torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]),
    )
    assert kjt.dist_labels() == ["lengths", "values", "weights"]
    # keys [a] to one rank, [b, c] to the other: bags 2 | 4, values 3 | 2
    assert kjt.dist_splits([1, 2]) == [[2, 4], [3, 2], [3, 2]]
    lengths, values, weights = kjt.dist_tensors()
    assert lengths.tolist() == [1, 2, 0, 1, 1, 0]
    assert values.tolist() == [1, 2, 3, 4, 5]
    assert torch.equal(weights, kjt.weights())


def test_dist_labels_splits_tensors_variable_batch() -> None:
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 0, 2]),
        stride_per_key_per_rank=[[1], [2]],
    )
    assert kjt.dist_labels() == ["lengths", "values", "strides"]
    assert kjt.dist_splits([1, 1]) == [[1, 2], [1, 2], [1, 1]]
    assert kjt.dist_tensors()[2].tolist() == [1, 2]


def test_dist_init_fixed_batch_recat() -> None:
    # Received from 2 ranks (batch 1 each), rank-major: a_r0 [10], b_r0 [20, 21], a_r1 [],
    # b_r1 [30]. recat [0, 2, 1, 3] makes it key-major: a_r0 a_r1 b_r0 b_r1.
    kjt = KeyedJaggedTensor.dist_init(
        keys=["a", "b"],
        tensors=[torch.tensor([1, 2, 0, 1]), torch.tensor([10, 20, 21, 30])],
        variable_stride_per_key=False,
        num_workers=2,
        recat=torch.tensor([0, 2, 1, 3], dtype=torch.int32),
        stride_per_rank=[1, 1],
    )
    assert kjt.stride() == 2
    assert kjt.lengths().tolist() == [1, 0, 2, 1]
    assert kjt.values().tolist() == [10, 20, 21, 30]
    assert kjt.length_per_key_or_none() == [1, 3]


def test_dist_init_variable_batch() -> None:
    # Strides rank-major: rank 0 sent a:1 b:2 bags, rank 1 sent a:2 b:1.
    # Segments: a_r0 [1] | b_r0 [2, 0] | a_r1 [1, 1] | b_r1 [3]
    kjt = KeyedJaggedTensor.dist_init(
        keys=["a", "b"],
        tensors=[
            torch.tensor([1, 2, 0, 1, 1, 3]),
            torch.tensor([10, 20, 21, 30, 31, 40, 41, 42]),
            torch.tensor([1, 2, 2, 1]),
            torch.tensor([1.0, 2.0, 2.5, 3.0, 3.5, 4.0, 4.25, 4.5]),
        ],
        variable_stride_per_key=True,
        num_workers=2,
        recat=torch.tensor([0, 2, 1, 3], dtype=torch.int32),
        stride_per_rank=None,
    )
    assert kjt.stride_per_key_per_rank() == [[1, 2], [2, 1]]
    assert kjt.stride_per_key() == [3, 3]
    assert kjt["a"].lengths().tolist() == [1, 1, 1]
    assert kjt["a"].values().tolist() == [10, 30, 31]
    assert kjt["b"].lengths().tolist() == [2, 0, 3]
    assert kjt["b"].values().tolist() == [20, 21, 40, 41, 42]
    assert kjt["b"].weights().tolist() == [2.0, 2.5, 4.0, 4.25, 4.5]


class DistProtocol(torch.nn.Module):
    def forward(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        kjt.dist_labels()
        kjt.dist_splits([1, 1])
        return KeyedJaggedTensor.dist_init(
            keys=kjt.keys(),
            tensors=kjt.dist_tensors(),
            variable_stride_per_key=False,
            num_workers=1,
            recat=None,
            stride_per_rank=[kjt.stride()],
        )


def test_dist_protocol_is_scriptable() -> None:
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=[1, 0, 2, 0])
    out = torch.jit.script(DistProtocol())(kjt)
    assert out.keys() == ["a", "b"]
    assert out.lengths().tolist() == [1, 0, 2, 0]
    assert out.values().tolist() == [1, 2, 3]
    assert out.stride() == 2
