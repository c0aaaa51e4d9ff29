"""TorchRec's inference helpers (``inference.modules``, ``dlrm_predict``, ``quant``)."""

from argparse import Namespace

import pytest
import torch

from recsys_core import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recsys_core.datasets.criteo import DEFAULT_CAT_NAMES
from recsys_core.distributed.fused_params import FUSED_PARAM_REGISTER_TBE_BOOL
from recsys_core.inference.dlrm_predict import (
    DLRMModelConfig,
    DLRMPredictFactory,
    create_training_batch,
)
from recsys_core.inference.modules import (
    DEFAULT_FUSED_PARAMS,
    DEFAULT_SHARDERS,
    assign_weights_to_tbe,
    get_table_to_weights_from_tbe,
    quantize_inference_model,
    set_pruning_data,
    shard_quant_model,
)
from recsys_core.models.dlrm import DLRM
from recsys_core.quant import EmbeddingBagCollection as QuantEBC


def _model() -> DLRM:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=20, feature_names=[f"f{i}"])
        for i in range(3)
    ]
    return DLRM(EmbeddingBagCollection(tables=tables), 4, [8], [6, 1]).eval()


def _inputs() -> tuple[torch.Tensor, KeyedJaggedTensor]:
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"],
        values=torch.tensor([1, 19, 3, 4, 5, 6, 7]),
        lengths=torch.tensor([2, 1, 1, 0, 2, 1]),
    )
    return torch.randn(2, 4), kjt


def test_quantize_shard_and_weights_round_trip() -> None:
    model = _model()
    dense, kjt = _inputs()
    expected = model(dense, kjt)
    quantized = quantize_inference_model(model, per_table_weight_dtype={"t0": torch.quint4x2})
    ebc = quantized.sparse_arch.embedding_bag_collection
    assert isinstance(ebc, QuantEBC)
    assert {c.name: c.data_type.value for c in ebc.embedding_bag_configs()} == {
        "t0": "INT4", "t1": "INT8", "t2": "INT8"
    }
    torch.testing.assert_close(quantized(dense, kjt), expected, atol=0.05, rtol=0)
    saved = get_table_to_weights_from_tbe(quantized)
    sharded, plan = shard_quant_model(quantized, world_size=2, compute_device="cpu", sharding_device="cpu")
    assert set(plan.plan) == {"sparse_arch.embedding_bag_collection"}
    out = sharded(dense, kjt)
    with torch.no_grad():
        for bag in sharded.sparse_arch.embedding_bag_collection.embedding_bags.values():
            bag.weight.zero_()
    assert not torch.equal(sharded(dense, kjt), out)
    assign_weights_to_tbe(sharded, saved)
    torch.testing.assert_close(sharded(dense, kjt), out)
    with pytest.raises(ValueError, match="constraints"):
        shard_quant_model(_model(), compute_device="cpu", constraints={"t0": object()})


def test_pruning_keeps_first_rows() -> None:
    model = set_pruning_data(_model(), {"t1": 5})
    quantized = quantize_inference_model(model)
    ebc = quantized.sparse_arch.embedding_bag_collection
    config = {c.name: c for c in ebc.embedding_bag_configs()}["t1"]
    assert config.num_embeddings_post_pruning == 5
    assert ebc.embedding_bags["t1"].weight.shape[0] == 5
    assert ebc.embedding_bags["t0"].weight.shape[0] == 20


def test_default_sharders_own_their_fused_params() -> None:
    sharder = DEFAULT_SHARDERS[0]
    sharder.fused_params[FUSED_PARAM_REGISTER_TBE_BOOL] = -1
    try:
        assert DEFAULT_FUSED_PARAMS[FUSED_PARAM_REGISTER_TBE_BOOL] is True
    finally:
        sharder.fused_params[FUSED_PARAM_REGISTER_TBE_BOOL] = True


def test_dlrm_predict_factory_serves_probabilities() -> None:
    batch = create_training_batch(Namespace(batch_size=3, num_embedding_features=26))
    config = DLRMModelConfig(
        dense_arch_layer_sizes=[8, 4], dense_in_features=13, embedding_dim=4,
        id_list_features_keys=DEFAULT_CAT_NAMES, num_embeddings_per_feature=[30] * 26,
        num_embeddings=None, over_arch_layer_sizes=[4, 1], sample_input=batch,
    )
    module = DLRMPredictFactory(config).create_predict_module(world_size=1, device="cpu")

    def serve(dense: torch.Tensor) -> torch.Tensor:
        return module({
            "float_features": dense,
            "id_list_features.lengths": batch.sparse_features.lengths(),
            "id_list_features.values": batch.sparse_features.values(),
        })["default"]

    out = serve(batch.dense_features)
    # the probabilities of the served DLRM's logits on this batch's dense and sparse features
    kjt = KeyedJaggedTensor(keys=DEFAULT_CAT_NAMES, lengths=batch.sparse_features.lengths(),
                            values=batch.sparse_features.values())
    logits = module.predict_module(batch.dense_features, kjt).detach()
    assert out.dtype == torch.float32 and out.shape == (3,)
    torch.testing.assert_close(out, torch.sigmoid(logits).reshape(3))
    # the dense features reach the model (the tables, built on meta, are zero)
    assert not torch.allclose(serve(batch.dense_features + 1.0), out)


def test_feature_processed_collection_keeps_processors_and_quantizes_tables() -> None:
    from recsys_core.modules.feature_processor_ import PositionWeightedModuleCollection
    from recsys_core.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="w", embedding_dim=8, num_embeddings=20, feature_names=["f0"])]
    processors = PositionWeightedModuleCollection({"f0": 3})
    with torch.no_grad():
        processors.position_weights["f0"].copy_(torch.tensor([1.0, 0.5, 0.25]))
    fp = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(tables=tables, is_weighted=True), processors
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([1, 2, 3, 4]), torch.tensor([3, 1]))
    expected = fp(kjt).values()

    class Wrap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fp = fp

    quantized = quantize_inference_model(Wrap())
    assert isinstance(quantized.fp._embedding_bag_collection, QuantEBC)
    assert len(quantized.fp._embedding_bag_collection.tbes) == 1
    torch.testing.assert_close(quantized.fp(kjt).values(), expected, atol=0.05, rtol=0)
