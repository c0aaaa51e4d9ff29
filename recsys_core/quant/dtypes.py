"""The quantized dtypes users name: a ``DataType`` or one of the torch dtypes TorchRec users pass
(``quantize_embeddings(model, dtype=torch.qint8)``), resolved to the ``DataType`` of the rows."""

from __future__ import annotations

import torch

from recsys_core.types import DataType

TORCH_DTYPE_ALIASES: dict[torch.dtype, DataType] = {
    torch.float32: DataType.FP32,
    torch.float16: DataType.FP16,
    torch.qint8: DataType.INT8,
    torch.quint8: DataType.INT8,
    torch.int8: DataType.INT8,
    torch.uint8: DataType.INT8,
    torch.quint4x2: DataType.INT4,
    torch.quint2x4: DataType.INT2,
}

QuantDType = DataType | torch.dtype

# The attribute TorchRec's ``set_pruning_data`` puts on a collection: {table: rows kept}.
MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT: str = (
    "__emb_name_to_num_rows_post_pruning"
)


def resolve_quant_dtype(dtype: QuantDType) -> DataType:
    """A DataType from a DataType or one of the torch dtypes in :data:`TORCH_DTYPE_ALIASES`."""
    if isinstance(dtype, DataType):
        return dtype
    if isinstance(dtype, torch.dtype) and dtype in TORCH_DTYPE_ALIASES:
        return TORCH_DTYPE_ALIASES[dtype]
    aliases = ", ".join(str(d) for d in TORCH_DTYPE_ALIASES)
    raise ValueError(
        f"unsupported quantization dtype {dtype!r}; use a DataType (FP32, FP16, INT8, INT4, "
        f"INT2) or one of {aliases}"
    )
