"""TorchRec's dataset helpers: random batches, splits, Criteo rows."""

import pytest
import torch
from torch.utils.data import IterDataPipe

from recsys_core.datasets.criteo import (
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    criteo_kaggle,
)
from recsys_core.datasets.random import RandomRecDataset
from recsys_core.datasets.utils import Batch, idx_split_train_val, rand_split_train_val


class _Rows(IterDataPipe):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # noqa: ANN204
        yield from range(self.n)


def test_random_batches_respect_bounds_and_seed() -> None:
    ds = RandomRecDataset(
        keys=["a", "b"], batch_size=4, hash_sizes=[5, 7], ids_per_features=[3, 1],
        min_ids_per_features=[1, 1], num_dense=2, manual_seed=3, num_batches=3,
    )
    batches = list(ds)
    assert len(batches) == len(ds) == 3
    b = batches[0]
    assert b.dense_features.shape == (4, 2) and b.labels.shape == (4,)
    lengths = b.sparse_features.lengths().view(2, 4)
    assert ((lengths[0] >= 1) & (lengths[0] <= 3)).all() and (lengths[1] == 1).all()
    per_key = b.sparse_features.to_dict()
    assert int(per_key["a"].values().max()) < 5 and int(per_key["b"].values().max()) < 7
    again = next(iter(RandomRecDataset(
        keys=["a", "b"], batch_size=4, hash_sizes=[5, 7], ids_per_features=[3, 1],
        min_ids_per_features=[1, 1], num_dense=2, manual_seed=3, num_batches=3,
    )))
    assert torch.equal(again.sparse_features.values(), b.sparse_features.values())
    # ids_per_feature alone fixes every bag's length (TorchRec's default minimum)
    fixed = next(iter(RandomRecDataset(keys=["a"], batch_size=3, ids_per_feature=2, num_batches=1)))
    assert fixed.sparse_features.lengths().tolist() == [2, 2, 2]
    with pytest.raises(TypeError, match="endless"):
        len(RandomRecDataset(keys=["a"], batch_size=3))


def test_splits() -> None:
    train, val = idx_split_train_val(_Rows(200), 0.25)
    assert list(train) == [i for i in range(200) if i % 100 < 25]
    assert sorted(list(train) + list(val)) == list(range(200))
    rtrain, rval = rand_split_train_val(_Rows(100), 0.5, random_seed=1)
    assert sorted(list(rtrain) + list(rval)) == list(range(100))
    assert list(rtrain) == list(rtrain)  # repeatable passes
    with pytest.raises(ValueError, match="train_perc"):
        idx_split_train_val(_Rows(3), 1.0)


def test_criteo_rows(tmp_path) -> None:  # noqa: ANN001
    row = ["1"] + [str(i) for i in range(13)] + [f"{i:08x}" for i in range(26)]
    row[3] = ""  # an empty int column is 0
    path = tmp_path / "train.txt"
    path.write_text("\t".join(row) + "\n" + "\t".join(row[1:]) + "\n")
    first, second = list(criteo_kaggle(str(path)))
    assert first["label"] == 1 and first["int_0"] == 0 and first["int_2"] == 0
    assert first["cat_25"] == f"{25:08x}"
    assert "label" not in second and second["int_12"] == 12
    assert len(DEFAULT_INT_NAMES) == 13 and len(DEFAULT_CAT_NAMES) == 26


def test_batch_to_moves_every_field() -> None:
    ds = RandomRecDataset(keys=["a"], batch_size=2, num_batches=1, num_dense=3)
    batch = next(iter(ds))
    moved = batch.to(torch.device("meta"))  # another device that exists everywhere
    assert isinstance(moved, Batch)
    tensors = [moved.dense_features, moved.labels, moved.sparse_features.values(),
               moved.sparse_features.lengths()]
    assert all(t.device.type == "meta" for t in tensors)
    assert moved.dense_features.shape == batch.dense_features.shape
    assert moved.sparse_features.keys() == ["a"]
    assert batch.dense_features.device.type == "cpu"  # the original stays


@pytest.mark.gpu  # pinned memory needs CUDA: conftest skips the test without it
def test_batch_pin_memory_pins_every_field() -> None:
    # at least one id per bag: an empty tensor has no memory to pin (is_pinned() is False)
    batch = next(iter(RandomRecDataset(keys=["a"], batch_size=2, num_batches=1, num_dense=3,
                                       min_ids_per_feature=1)))
    assert batch.sparse_features.values().numel() >= 2
    pinned = batch.pin_memory()
    assert pinned.dense_features.is_pinned() and pinned.labels.is_pinned()
    assert pinned.sparse_features.values().is_pinned()
    assert pinned.sparse_features.lengths().is_pinned()
    assert torch.equal(pinned.dense_features, batch.dense_features)
