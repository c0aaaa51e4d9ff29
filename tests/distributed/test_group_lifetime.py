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

import pytest
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
pytestmark = pytest.mark.slow  # two ranks training: about 4 s


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

