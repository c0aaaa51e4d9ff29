"""The DLRM runs its bottom MLP while the pooled embeddings travel between ranks: the same
values as the plain order (sharded over 2 gloo ranks, forward, backward, fused and dense
updates), and the overlap really happens (the exchange is in flight while the bottom MLP runs).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dlrm_app.data.synthetic import generate
from recsys_core.testing import run_gloo

SMALL = dict(embedding_dim=8, dense_arch_layer_sizes=(16, 8), over_arch_layer_sizes=(16, 1))


def _train(rank: int, world_size: int, data: str, out: str, overlap: bool) -> list[float]:
    import torch.nn.functional as F

    import dlrm_app.model as model_module
    from dlrm_app.config import ModelConfig
    from dlrm_app.data.loader import ParquetLoader
    from dlrm_app.data.schema import DatasetSpec
    from dlrm_app.training.build import build_model, build_optimizer
    from dlrm_app.training.config import TrainConfig

    model_module.DLRM.overlap_exchange = overlap
    config = TrainConfig.from_flags(data=data, out=out, batch_size=32, amp=False,
                                    model=ModelConfig(**SMALL))
    torch.manual_seed(0)
    dmp = build_model(config, DatasetSpec.load(data), torch.device("cpu"))
    optimizer = build_optimizer(config.optimizer, dmp)
    loader = ParquetLoader(data, "train", batch_size=32, rank=rank, world_size=world_size,
                           shuffle=False, drop_last=True)
    losses = []
    for i, batch in enumerate(loader):
        loss = F.binary_cross_entropy_with_logits(dmp(batch.dense, batch.sparse).squeeze(1),
                                                  batch.labels, reduction="sum")
        optimizer.zero_grad()
        (loss / (32 * world_size)).backward()
        optimizer.step()
        losses.append(float(loss))
        if i == 4:
            break
    weights = {k: v for k, v in dmp.state_dict().items() if isinstance(v, torch.Tensor)
               and not hasattr(v, "local_shards")}
    return losses + [float(w.double().sum()) for _, w in sorted(weights.items())]


def test_overlap_gives_the_same_values_as_the_plain_order(tmp_path: Path) -> None:
    generate(tmp_path / "data", rows=2000, num_dense=3, cardinalities=[300, 50, 2000],
             pooling_factors=[1.0, 2.0, 1.0], zipf_alpha=1.05, seed=0)
    plain = run_gloo(2, _train, str(tmp_path / "data"), str(tmp_path / "a"), False)
    overlapped = run_gloo(2, _train, str(tmp_path / "data"), str(tmp_path / "b"), True)
    assert len(plain[0]) > 5
    assert overlapped == plain  # exactly: the same operations, in another order


def test_bottom_mlp_runs_while_the_exchange_is_in_flight(tmp_path: Path) -> None:
    from dlrm_app.config import ModelConfig
    from dlrm_app.data.loader import ParquetLoader
    from dlrm_app.data.schema import DatasetSpec
    from dlrm_app.model import build_dlrm

    generate(tmp_path, rows=200, num_dense=3, cardinalities=[30, 5], pooling_factors=[1.0, 1.0],
             zipf_alpha=1.05, seed=0)
    model = build_dlrm(DatasetSpec.load(tmp_path), ModelConfig(**SMALL), device="cpu")
    batch = next(iter(ParquetLoader(tmp_path, "train", batch_size=8, shuffle=False)))
    events: list[str] = []
    collection = model.sparse_arch.embedding_bag_collection
    real_forward = collection.forward

    class InFlight:
        """What a sharded collection returns: values() waits for the exchange."""

        def __init__(self, result: object) -> None:
            self.result = result

        def values(self) -> torch.Tensor:
            events.append("wait")
            return self.result.values()  # type: ignore[attr-defined]

    def launching_forward(features: object) -> InFlight:
        events.append("start")
        return InFlight(real_forward(features))

    collection.forward = launching_forward  # type: ignore[method-assign]
    model.dense_arch.register_forward_hook(lambda *_: events.append("bottom_mlp"))
    overlapped = model(batch.dense, batch.sparse)
    assert events == ["start", "bottom_mlp", "wait"]
    model.overlap_exchange = False
    events.clear()
    plain = model(batch.dense, batch.sparse)
    assert events == ["bottom_mlp", "start", "wait"]
    assert torch.equal(overlapped, plain)
