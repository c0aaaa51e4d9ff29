"""The library lets go of a process group once the program does.

A gloo group's worker threads live as long as the group object. If anything still holds the
group when the interpreter shuts down, a worker thread that frees a finished collective's
tensors at that moment needs the GIL of a dying interpreter and the process aborts
("terminate called without an active exception"), after the program's work is done: a
TorchRec-style program (DMP + TrainPipelineSparseDist, then ``destroy_process_group``) died
that way now and then. So: once the program has dropped its own objects and destroyed the
group, nothing of the library may keep the group alive (the shared-memory transport's
registry used to), and the group's threads are gone before the interpreter exits.
"""

from __future__ import annotations

import gc
import itertools
import os
import weakref

import torch
import torch.distributed as dist

from recsys_core.datasets.random import RandomRecDataset
from recsys_core.distributed import TrainPipelineSparseDist, shm_comm
from recsys_core.distributed.model_parallel import DistributedModelParallel
from recsys_core.models.dlrm import DLRM, DLRMTrain
from recsys_core.modules.embedding_configs import EmbeddingBagConfig
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.testing import run_gloo

KEYS = ["f0", "f1", "f2"]


def _threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def _train_then_let_go(rank: int, world: int) -> tuple[bool, int, int]:
    group = weakref.ref(dist.group.WORLD)
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{k}", embedding_dim=8, num_embeddings=50, feature_names=[k])
        for k in KEYS], device=torch.device("meta"))
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=4,
                           dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1]))
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"))
    optimizer = torch.optim.SGD(dmp.parameters(), lr=0.1)
    pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
    data = RandomRecDataset(keys=KEYS, batch_size=8, hash_size=50, ids_per_feature=2,
                            num_dense=4, manual_seed=rank)
    batches = itertools.cycle(list(itertools.islice(iter(data), 4)))
    for _ in range(3):  # the pipeline ends with the next batch's input dist started
        pipeline.progress(batches)
    used_shm = shm_comm.for_group(dist.group.WORLD, torch.device("cpu")) is not None
    with_group = _threads()
    del pipeline, optimizer, dmp, model, ebc, data, batches
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    freed = group() is None
    return freed and used_shm, with_group, _threads()


def test_the_group_and_its_threads_go_with_destroy_process_group() -> None:
    for freed, with_group, after in run_gloo(2, _train_then_let_go):
        assert freed, "something of the library still holds the destroyed process group"
        # gloo's worker and transport threads went with the group
        assert after < with_group, (with_group, after)


def _app_train_then_shutdown(rank: int, world: int, data: str, out: str) -> tuple[bool, int]:
    from dlrm_app.config import ModelConfig
    from dlrm_app.training.config import TrainConfig
    from dlrm_app.training.runtime import shutdown_distributed
    from dlrm_app.training.trainer import train

    group = weakref.ref(dist.group.WORLD)
    config = TrainConfig.from_flags(data=data, out=out, batch_size=32, max_steps=6,
                                    model=ModelConfig(embedding_dim=8,
                                                      dense_arch_layer_sizes=(16, 8),
                                                      over_arch_layer_sizes=(16, 1)))
    summary = train(config, progress=False)
    shutdown_distributed()  # what `dlrm-app train` does after its summary
    return group() is None, int(summary["steps"])


def test_the_apps_training_command_lets_go_of_its_group(tmp_path) -> None:
    from dlrm_app.data.synthetic import generate

    generate(tmp_path / "data", rows=2000, num_dense=3, cardinalities=[300, 50, 2000],
             pooling_factors=[1.0, 2.0, 1.0], zipf_alpha=1.05, seed=0)
    for freed, steps in run_gloo(2, _app_train_then_shutdown, str(tmp_path / "data"),
                                 str(tmp_path / "run")):
        assert steps == 6
        assert freed, "the training command's objects still hold the destroyed process group"
