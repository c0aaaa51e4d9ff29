"""TorchRec's ``torchrec.inference.dlrm_predict``: a DLRM packaged for serving.

``DLRMPredictFactory(config).create_predict_module(world_size, device)`` builds the DLRM with
its tables on the meta device, quantizes them (int8, zero rows to be loaded), places them on
``world_size`` devices, runs the sample batch, and returns the module scripted (TorchScript,
as TorchRec does) when its parts are scriptable, else the eager module. It serves
``{"float_features", "id_list_features.lengths", "id_list_features.values"}`` ->
``{"default": sigmoid(logits) [B]}``.
"""

import logging
from argparse import Namespace
from dataclasses import dataclass

import torch

from recsys_core.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from recsys_core.datasets.random import RandomRecDataset
from recsys_core.datasets.utils import Batch
from recsys_core.inference.modules import (
    BatchingMetadata,
    PredictFactory,
    PredictModule,
    quantize_inference_model,
    shard_quant_model,
)
from recsys_core.models.dlrm import DLRM
from recsys_core.modules.embedding_configs import EmbeddingBagConfig
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.sparse import KeyedJaggedTensor

logger: logging.Logger = logging.getLogger(__name__)


def create_training_batch(args: Namespace) -> Batch:
    """One random Criteo-shaped batch (26 sparse features, one id each, 13 dense) of
    ``args.batch_size`` rows with ids below ``args.num_embedding_features`` (TorchRec's
    choice of bound)."""
    return RandomRecDataset(
        keys=DEFAULT_CAT_NAMES,
        batch_size=args.batch_size,
        hash_size=args.num_embedding_features,
        ids_per_feature=1,
        num_dense=len(DEFAULT_INT_NAMES),
    ).batch_generator._generate_batch()


@dataclass
class DLRMModelConfig:
    """The DLRM's shape and a sample input (run once when the module is created)."""

    dense_arch_layer_sizes: list[int]
    dense_in_features: int
    embedding_dim: int
    id_list_features_keys: list[str]
    num_embeddings_per_feature: list[int]
    num_embeddings: int | None
    over_arch_layer_sizes: list[int]
    sample_input: Batch


class DLRMPredictModule(PredictModule):
    """DLRM behind the serving batch dict; returns ``{"default": probabilities [B]}`` on CPU."""

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        id_list_features_keys: list[str],
        dense_device: torch.device | None = None,
    ) -> None:
        module = DLRM(
            embedding_bag_collection=embedding_bag_collection,
            dense_in_features=dense_in_features,
            dense_arch_layer_sizes=dense_arch_layer_sizes,
            over_arch_layer_sizes=over_arch_layer_sizes,
            dense_device=dense_device,
        )
        super().__init__(module, str(dense_device) if dense_device is not None else None)
        self.id_list_features_keys: list[str] = id_list_features_keys

    def predict_forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = self.predict_module(
            batch["float_features"],
            KeyedJaggedTensor(
                keys=self.id_list_features_keys,
                lengths=batch["id_list_features.lengths"],
                values=batch["id_list_features.values"],
            ),
        )
        predictions = logits.sigmoid().reshape([logits.size()[0]])
        return {"default": predictions.to(torch.device("cpu"), non_blocking=True).float()}


class DLRMPredictFactory(PredictFactory):
    def __init__(self, model_config: DLRMModelConfig) -> None:
        self.model_config = model_config

    def create_predict_module(self, world_size: int, device: str) -> torch.nn.Module:
        cfg = self.model_config
        tables = [
            EmbeddingBagConfig(
                name=f"t_{name}",
                embedding_dim=cfg.embedding_dim,
                num_embeddings=(
                    cfg.num_embeddings_per_feature[i]
                    if cfg.num_embeddings is None
                    else cfg.num_embeddings
                ),
                feature_names=[name],
            )
            for i, name in enumerate(cfg.id_list_features_keys)
        ]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        module = DLRMPredictModule(
            embedding_bag_collection=ebc,
            dense_in_features=cfg.dense_in_features,
            dense_arch_layer_sizes=cfg.dense_arch_layer_sizes,
            over_arch_layer_sizes=cfg.over_arch_layer_sizes,
            id_list_features_keys=cfg.id_list_features_keys,
            dense_device=torch.device(device),
        )
        quantized = quantize_inference_model(module)
        sharded, _ = shard_quant_model(
            quantized, world_size=world_size, compute_device=device, sharding_device=device
        )
        batch = {
            "float_features": cfg.sample_input.dense_features.to(device),
            "id_list_features.lengths": cfg.sample_input.sparse_features.lengths().to(device),
            "id_list_features.values": cfg.sample_input.sparse_features.values().to(device),
        }
        sharded(batch)
        return sharded

    def batching_metadata(self) -> dict[str, BatchingMetadata]:
        device = "cpu"
        return {
            "float_features": BatchingMetadata(type="dense", device=device, pinned=[]),
            "id_list_features": BatchingMetadata(type="sparse", device=device, pinned=[]),
        }

    def result_metadata(self) -> str:
        return "dict_of_tensor"

    def run_weights_independent_tranformations(
        self, predict_module: torch.nn.Module
    ) -> torch.nn.Module:
        return predict_module

    def run_weights_dependent_transformations(
        self, predict_module: torch.nn.Module
    ) -> torch.nn.Module:
        return predict_module


__all__ = [
    "DLRMModelConfig",
    "DLRMPredictFactory",
    "DLRMPredictModule",
    "create_training_batch",
]
