"""TorchRec 1.9's new parameters in the distributed modules, each with its default keeping 1.8's
behaviour: ``TrainPipelineSparseDist(..., async_inplace_copy=False)``,
``ManagedCollisionCollectionSharder(..., restore_dedup_feature_boundary=True)``, and the
memory stasher's table selection (``set_stashed_tables`` / ``resolve_stash_weights``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig
from recsys_core.datasets.random import RandomRecDataset
from recsys_core.distributed import mc_modules
from recsys_core.distributed.memory_stashing import MemoryStashingManager
from recsys_core.distributed.train_pipeline import TrainPipelineSparseDist
from recsys_core.models.dlrm import DLRM, DLRMTrain


def _model() -> DLRMTrain:
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=20,
                                 feature_names=["f"])]
    return DLRMTrain(DLRM(EmbeddingBagCollection(tables=tables), 3, [4], [4, 1]))


def _losses(**kwargs: Any) -> list[float]:
    model = _model()
    pipeline = TrainPipelineSparseDist(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), **kwargs)
    data = iter(RandomRecDataset(keys=["f"], batch_size=4, hash_size=20, ids_per_feature=2,
                                 num_dense=3, manual_seed=1, num_batches=3))
    losses = []
    while True:
        try:
            loss, _, _ = pipeline.progress(data)
        except StopIteration:
            return losses
        losses.append(loss.item())


def test_async_inplace_copy_on_cpu_is_turned_off_with_torchrecs_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        model = _model()
        pipeline = TrainPipelineSparseDist(
            model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"),
            async_inplace_copy=True)
    assert pipeline._async_inplace_copy is False
    assert "async_inplace_copy requested on non-accelerator device cpu; disabling." in caplog.text
    assert _losses(async_inplace_copy=True) == _losses()


def test_async_inplace_copy_default_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        model = _model()
        pipeline = TrainPipelineSparseDist(
            model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))
    assert pipeline._async_inplace_copy is False and "async_inplace_copy" not in caplog.text


@pytest.mark.parametrize("restore", [True, False])
def test_mc_sharder_hands_restore_dedup_feature_boundary_to_the_sharded_module(
    monkeypatch: pytest.MonkeyPatch, restore: bool,
) -> None:
    built: dict[str, Any] = {}

    def record(*args: Any, **kwargs: Any) -> str:
        built.update(kwargs)
        return "sharded"

    monkeypatch.setattr(mc_modules, "ShardedManagedCollisionCollection", record)
    sharder = mc_modules.ManagedCollisionCollectionSharder(restore_dedup_feature_boundary=restore)
    assert sharder.shard(None, {}, None, use_index_dedup=True) == "sharded"  # type: ignore[arg-type]
    assert built["restore_dedup_feature_boundary"] is restore
    assert built["use_index_dedup"] is True


def test_mc_sharder_default_is_torchrec_19s() -> None:
    assert mc_modules.ManagedCollisionCollectionSharder()._restore_dedup_feature_boundary is True


def test_stasher_table_selection_wins_over_the_config() -> None:
    stash = EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=4, feature_names=["f"],
                               stash_weights=True)
    keep = EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=4, feature_names=["g"])
    try:
        assert MemoryStashingManager.get_stashed_tables() is None
        assert MemoryStashingManager.resolve_stash_weights("a", stash) is True
        assert MemoryStashingManager.resolve_stash_weights("b", keep) is False
        MemoryStashingManager.set_stashed_tables({"b"})
        assert MemoryStashingManager.get_stashed_tables() == {"b"}
        assert MemoryStashingManager.resolve_stash_weights("a", stash) is False
        assert MemoryStashingManager.resolve_stash_weights("b", keep) is True
        MemoryStashingManager.reset()
        assert MemoryStashingManager.get_stashed_tables() is None
        assert not MemoryStashingManager.is_enabled()
    finally:
        MemoryStashingManager.reset()


def test_fused_param_device_ro_is_read_and_stripped() -> None:
    from recsys_core.distributed.fused_params import (
        FUSED_PARAM_IS_DEVICE_RO,
        is_fused_param_device_ro,
        tbe_fused_params,
    )

    assert FUSED_PARAM_IS_DEVICE_RO == "__register_is_device_ro"
    params = {FUSED_PARAM_IS_DEVICE_RO: True, "learning_rate": 0.1}
    assert is_fused_param_device_ro(params) is True
    assert is_fused_param_device_ro({"learning_rate": 0.1}) is False
    assert is_fused_param_device_ro(None) is False
    assert tbe_fused_params(params) == {"learning_rate": 0.1}
