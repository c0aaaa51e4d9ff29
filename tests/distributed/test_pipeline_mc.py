"""The sparse-dist pipeline with a sharded managed-collision collection in the model: only the
collections fed by the model's input start their input dist early; the managed-collision
collection's own embedding collection (which looks up remapped ids) is left to its parent."""

from __future__ import annotations

import torch
from torch import nn

from recsys_core.distributed import DistributedModelParallel, EmbeddingBagCollectionSharder
from recsys_core.distributed.embeddingbag import ShardedEmbeddingBagCollection
from recsys_core.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from recsys_core.distributed.train_pipeline import pipelined_batches, prefetching_modules
from recsys_core.kernels.config import EmbOptimType
from recsys_core.modules.embedding_configs import EmbeddingBagConfig
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from recsys_core.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from recsys_core.sparse import KeyedJaggedTensor
from recsys_core.testing import run_gloo


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        plain = [EmbeddingBagConfig(name="t_a", embedding_dim=4, num_embeddings=10,
                                    feature_names=["a"])]
        raw = [EmbeddingBagConfig(name="t_b", embedding_dim=4, num_embeddings=16,
                                  feature_names=["b"])]
        self.ebc = EmbeddingBagCollection(plain, device=torch.device("meta"))
        mcc = ManagedCollisionCollection(
            {"t_b": MCHManagedCollisionModule(
                zch_size=16, device=torch.device("meta"), eviction_interval=1,
                eviction_policy=DistanceLFU_EvictionPolicy(), name="t_b")},
            raw,
        )
        self.mc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(raw, device=torch.device("meta")), mcc)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return torch.cat([self.ebc(kjt).values(), self.mc(kjt)[0].values()], dim=1)


def _batches() -> list[KeyedJaggedTensor]:
    """Raw ids of b far outside its 16 rows (the remapping brings them in)."""
    return [
        KeyedJaggedTensor.from_lengths_sync(
            ["a", "b"], torch.tensor([1, 2, 3, 10**12 + s, 7 * 10**9, 10**12 + s]),
            torch.tensor([1, 2, 1, 2]))
        for s in range(4)
    ]


def _worker(rank: int, world: int) -> tuple[int, bool, list[list[float]], list[list[float]]]:
    torch.manual_seed(0)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
    dmp = DistributedModelParallel(
        _Model(), device=torch.device("cpu"),
        sharders=[sharder, ManagedCollisionEmbeddingBagCollectionSharder(sharder)])
    found = prefetching_modules(dmp)
    only_outer = len(found) == 1 and found[0] is dmp.module.ebc
    dmp.eval()
    plain = [dmp(kjt).tolist() for kjt in _batches()]
    piped = [dmp(kjt).tolist() for kjt in pipelined_batches(
        _batches(), dmp, to_device=lambda k: k, features=lambda k: k)]
    return len(found), only_outer and isinstance(found[0], ShardedEmbeddingBagCollection), \
        plain, piped


def test_pipeline_prefetches_only_collections_fed_by_the_input() -> None:
    for count, outer, plain, piped in run_gloo(2, _worker):
        assert count == 1 and outer
        assert piped == plain
