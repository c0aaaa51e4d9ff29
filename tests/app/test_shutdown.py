"""`dlrm-app train` under 2 ranks lets go of its process group when it ends: after
``shutdown_distributed`` the group is gone (a gloo group alive at interpreter exit can abort the
process as a worker thread frees a finished collective; see
tests/distributed/test_group_lifetime.py for the library's side)."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch.distributed as dist

from dlrm_app.config import ModelConfig
from dlrm_app.data.synthetic import generate
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.runtime import shutdown_distributed
from dlrm_app.training.trainer import train
from recsys_core.testing import run_gloo

pytestmark = pytest.mark.slow  # two ranks training: about 4 s


def _app_train_then_shutdown(rank: int, world: int, data: str, out: str) -> tuple[bool, int]:
    group = weakref.ref(dist.group.WORLD)
    config = TrainConfig.from_flags(data=data, out=out, batch_size=32, max_steps=6,
                                    model=ModelConfig(embedding_dim=8,
                                                      dense_arch_layer_sizes=(16, 8),
                                                      over_arch_layer_sizes=(16, 1)))
    summary = train(config, progress=False)
    shutdown_distributed()  # what `dlrm-app train` does after its summary
    return group() is None, int(summary["steps"])


def test_the_training_command_lets_go_of_its_group(tmp_path: Path) -> None:
    generate(tmp_path / "data", rows=2000, num_dense=3, cardinalities=[300, 50, 2000],
             pooling_factors=[1.0, 2.0, 1.0], zipf_alpha=1.05, seed=0)
    for freed, steps in run_gloo(2, _app_train_then_shutdown, str(tmp_path / "data"),
                                 str(tmp_path / "run")):
        assert steps == 6
        assert freed, "the training command's objects still hold the destroyed process group"
