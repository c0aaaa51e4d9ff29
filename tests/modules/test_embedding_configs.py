"""TorchRec's embedding_configs helpers: dtype conversions, FBGEMM enums, extra config fields."""

from __future__ import annotations

import pytest
import torch

from recsys_core.kernels import fbgemm_available
from recsys_core.modules.embedding_configs import (
    DATA_TYPE_NUM_BITS,
    CountBasedEvictionPolicy,
    DataType,
    EmbeddingBagConfig,
    EmbeddingTableConfig,
    FeatureScoreBasedEvictionPolicy,
    NoEvictionPolicy,
    PoolingType,
    QuantConfig,
    ShardingType,
    data_type_to_dtype,
    data_type_to_sparse_type,
    dtype_to_data_type,
    pooling_type_to_pooling_mode,
    pooling_type_to_str,
)


@pytest.mark.parametrize(
    "data_type, dtype, bits",
    [
        (DataType.FP32, torch.float32, 32),
        (DataType.FP16, torch.float16, 16),
        (DataType.BF16, torch.bfloat16, 16),
        (DataType.INT64, torch.int64, 64),
        (DataType.INT32, torch.int32, 32),
        (DataType.INT8, torch.int8, 8),
        (DataType.UINT8, torch.uint8, 8),
        (DataType.INT4, torch.quint4x2, 4),
        (DataType.INT2, torch.quint2x4, 2),
        (DataType.NFP8, torch.float8_e4m3fn, 8),
    ],
)
def test_data_type_dtype_round_trip(data_type: DataType, dtype: torch.dtype, bits: int) -> None:
    assert data_type_to_dtype(data_type) == dtype
    assert dtype_to_data_type(dtype) is data_type
    assert DATA_TYPE_NUM_BITS[data_type] == bits


def test_conversion_edges() -> None:
    assert dtype_to_data_type(torch.qint8) is DataType.INT8
    assert dtype_to_data_type(torch.quint8) is DataType.INT8
    with pytest.raises(ValueError, match="Invalid data type torch.float64"):
        dtype_to_data_type(torch.float64)
    assert pooling_type_to_str(PoolingType.SUM) == "sum"
    assert pooling_type_to_str(PoolingType.MEAN) == "mean"
    with pytest.raises(ValueError, match="Unsupported pooling type"):
        pooling_type_to_str(PoolingType.NONE)


@pytest.mark.skipif(not fbgemm_available(), reason="fbgemm_gpu is not importable")
def test_fbgemm_enums() -> None:
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    assert data_type_to_sparse_type(DataType.UINT8) == SparseType.INT8
    assert data_type_to_sparse_type(DataType.BF16) == SparseType.BF16
    with pytest.raises(ValueError, match="INT64"):
        data_type_to_sparse_type(DataType.INT64)
    assert pooling_type_to_pooling_mode(PoolingType.MEAN) == PoolingMode.MEAN
    assert pooling_type_to_pooling_mode(PoolingType.NONE) == PoolingMode.NONE
    # a row-wise shard sees part of each bag: it sums, the mean is taken after the reduction
    assert pooling_type_to_pooling_mode(PoolingType.MEAN, ShardingType.ROW_WISE) == PoolingMode.SUM
    mean_cw = pooling_type_to_pooling_mode(PoolingType.MEAN, ShardingType.COLUMN_WISE)
    assert mean_cw == PoolingMode.MEAN


def test_torchrec_config_fields_and_positional_order() -> None:
    # TorchRec's field order: ..., need_pos, input_dim, total_num_buckets, use_virtual_table,
    # virtual_table_eviction_policy, enable_embedding_update, stash_weights, pooling.
    config = EmbeddingBagConfig(
        10, 4, "t", DataType.FP32, ["f"], None, None, None, None, False,
        None, 5, True, NoEvictionPolicy(), False, False, PoolingType.MEAN,
    )
    assert config.total_num_buckets == 5 and config.use_virtual_table
    assert config.pooling is PoolingType.MEAN
    with pytest.raises(ValueError, match="total_num_buckets must be a positive int"):
        EmbeddingBagConfig(10, 4, "t", total_num_buckets=0)
    table = EmbeddingTableConfig(10, 4, "seq", pooling=PoolingType.NONE, is_weighted=True)
    assert table.feature_names == ["seq"] and table.embedding_names == []
    quant = QuantConfig(activation=None, weight=None)
    assert quant.per_table_weight_dtype is None


def test_eviction_policy_defaults_follow_training_values() -> None:
    count = CountBasedEvictionPolicy(eviction_threshold=3)
    assert count.inference_eviction_threshold == 3
    count.init_metaheader_config(DataType.FP16, 8)  # 16 header bytes = 8 fp16 elements
    assert (count.get_meta_header_len(), count.get_embedding_dim()) == (8, 8)
    count.init_metaheader_config(DataType.FP32, 2)  # only the first call counts
    assert count.get_meta_header_len() == 8
    score = FeatureScoreBasedEvictionPolicy(
        training_id_keep_count=7, eviction_ttl_mins=9, enable_auto_feature_score_collection=True
    )
    assert score.max_inference_id_num_per_rank == 7
    assert score.inference_eviction_ttl_mins == 9
    assert score.feature_score_mapping == {}


def test_configs_are_mutable_dataclasses_as_torchrecs() -> None:
    """TorchRec's configs are plain dataclasses: recipes set a field before building the
    collection (``tables[0].pooling = PoolingType.MEAN``); the module built after sees it."""
    from recsys_core import EmbeddingBagCollection, KeyedJaggedTensor, PoolingType

    config = EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=4, feature_names=["f"])
    config.pooling = PoolingType.MEAN
    ebc = EmbeddingBagCollection([config])
    weight = ebc.embedding_bags["t"].weight.detach()
    out = ebc(KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 3]), lengths=torch.tensor([2])))
    torch.testing.assert_close(out.values(), ((weight[1] + weight[3]) / 2).unsqueeze(0))
    copy = EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=4, feature_names=["f"],
                              pooling=PoolingType.MEAN)
    assert config == copy
