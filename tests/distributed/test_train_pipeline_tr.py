"""TorchRec's TrainPipelineSparseDist / TrainPipelineBase: progress(iterator) steps equal the
plain training loop."""

import copy

import pytest
import torch

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig
from recsys_core.datasets.random import RandomRecDataset
from recsys_core.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist
from recsys_core.models.dlrm import DLRM, DLRMTrain


def _model() -> DLRMTrain:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=50, feature_names=[f"f{i}"])
        for i in range(2)
    ]
    return DLRMTrain(DLRM(EmbeddingBagCollection(tables=tables), 3, [4], [4, 1]))


def _data() -> RandomRecDataset:
    return RandomRecDataset(
        keys=["f0", "f1"], batch_size=4, hash_size=50, ids_per_feature=3, min_ids_per_feature=0,
        num_dense=3, manual_seed=1, num_batches=5,
    )


@pytest.mark.parametrize("pipeline_cls", [TrainPipelineBase, TrainPipelineSparseDist])
def test_progress_equals_plain_loop(pipeline_cls: type) -> None:
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_losses = []
    for batch in _data():
        ref_opt.zero_grad()
        loss, _ = reference(batch)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    model = _model()
    pipeline = pipeline_cls(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))
    it = iter(_data())
    losses = []
    while True:
        try:
            loss, _, _ = pipeline.progress(it)
        except StopIteration:
            break
        losses.append(loss.item())
    assert losses == pytest.approx(ref_losses)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_eval_mode_does_not_step() -> None:
    model = _model().eval()
    before = copy.deepcopy(model.state_dict())
    pipeline = TrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=1.0), torch.device("cpu"))
    pipeline.progress(iter(_data()))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])
    with pytest.raises(ValueError, match="execute_all_batches"):
        TrainPipelineBase(model, torch.optim.SGD(model.parameters(), lr=1.0), torch.device("cpu"), execute_all_batches=False)


class _Ids:
    """A batch that keeps its KJT under a name of its own (not TorchRec's)."""

    def __init__(self, ids: object) -> None:
        self.ids = ids

    def to(self, device: torch.device, non_blocking: bool = False) -> "_Ids":
        return self


class _Summed(torch.nn.Module):
    def __init__(self, sharded: torch.nn.Module) -> None:
        super().__init__()
        self.sharded = sharded

    def forward(self, batch: _Ids) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.sharded(batch.ids).wait().values()
        return pooled.sum(), pooled


def test_sparse_dist_says_which_batch_has_no_features_to_prefetch() -> None:
    """The sparse-dist pipeline starts each next batch's input all-to-all from its
    ``sparse_features``; a batch without one is refused with what to do (it reached the
    sharded collection's prefetch as None before)."""
    from recsys_core.distributed import EmbeddingBagCollectionSharder, ShardingEnv
    from recsys_core.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from recsys_core.sparse import KeyedJaggedTensor

    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])])
    plan = construct_module_sharding_plan(ebc, {"t0": table_wise(rank=0)}, world_size=1)
    model = _Summed(EmbeddingBagCollectionSharder().shard(ebc, plan, ShardingEnv.from_local(1, 0)))
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([3, 4]), torch.tensor([1, 1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"_Ids\).*'sparse_features'.*TrainPipelineBase"):
        TrainPipelineSparseDist(model, optimizer, torch.device("cpu")).progress(iter([_Ids(kjt)]))
    before = model.sharded.state_dict()["embedding_bags.t0.weight"].clone()
    pooled = TrainPipelineBase(model, optimizer, torch.device("cpu")).progress(iter([_Ids(kjt)]))
    torch.testing.assert_close(pooled, before[[3, 4]])  # one id per bag: the rows themselves
    after = model.sharded.state_dict()["embedding_bags.t0.weight"]
    torch.testing.assert_close(after[[3, 4]], before[[3, 4]] - 0.1)  # d(sum)/d(row) = 1, lr 0.1
