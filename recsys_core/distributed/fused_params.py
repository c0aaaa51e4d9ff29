"""TorchRec's ``torchrec.distributed.fused_params``: the private keys TorchRec's quantized
(inference) sharders read from ``fused_params``, and the helpers that read or strip them.

They are switches of TorchRec's inference kernels; this library's quantized sharder does not
read them, and ``tbe_fused_params`` removes them from a dict before kernel settings are read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from recsys_core.plan.params import BoundsCheckMode

FUSED_PARAM_REGISTER_TBE_BOOL: str = "__register_tbes_in_named_modules"
FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: str = "__register_quant_state_dict_split_scale_bias"
FUSED_PARAM_TBE_ROW_ALIGNMENT: str = "__register_tbe_row_alignment"
FUSED_PARAM_BOUNDS_CHECK_MODE: str = "__register_tbe_bounds_check_mode"
FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP: str = "__register_lengths_to_offsets_lookup"
FUSED_PARAM_IS_DEVICE_RO: str = "__register_is_device_ro"  # TorchRec 1.9
FUSED_PARAM_SSD_TABLE_LIST: str = "__register_ssd_table_list"
FUSED_PARAM_IS_SSD_TABLE: str = "__register_is_ssd_table"
FUSED_PARAM_EMBEDDING_TABLE_INDEX_TYPE: str = "embedding_table_index_type"
FUSED_PARAM_EMBEDDING_TABLE_OFFSET_TYPE: str = "embedding_table_offset_type"

_PRIVATE = (
    FUSED_PARAM_REGISTER_TBE_BOOL,
    FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS,
    FUSED_PARAM_TBE_ROW_ALIGNMENT,
    FUSED_PARAM_BOUNDS_CHECK_MODE,
    FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP,
    FUSED_PARAM_IS_DEVICE_RO,
    FUSED_PARAM_SSD_TABLE_LIST,
)

FusedParams = Mapping[str, Any] | None


def is_fused_param_register_tbe(fused_params: FusedParams) -> bool:
    return bool(fused_params and fused_params.get(FUSED_PARAM_REGISTER_TBE_BOOL))


def get_fused_param_tbe_row_alignment(fused_params: FusedParams) -> int | None:
    return None if not fused_params else fused_params.get(FUSED_PARAM_TBE_ROW_ALIGNMENT)


def fused_param_bounds_check_mode(fused_params: FusedParams) -> BoundsCheckMode | None:
    return None if not fused_params else fused_params.get(FUSED_PARAM_BOUNDS_CHECK_MODE)


def fused_param_lengths_to_offsets_lookup(fused_params: FusedParams) -> bool:
    return bool(fused_params and fused_params.get(FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP))


def is_fused_param_device_ro(fused_params: FusedParams) -> bool:
    """TorchRec 1.9: the quantized kernel's weights are read-only on the device."""
    return bool(fused_params and fused_params.get(FUSED_PARAM_IS_DEVICE_RO))


def is_fused_param_quant_state_dict_split_scale_bias(fused_params: FusedParams) -> bool:
    return bool(fused_params and fused_params.get(FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS))


def tbe_fused_params(fused_params: FusedParams) -> dict[str, Any] | None:
    """``fused_params`` without the private keys above (None for an empty dict)."""
    if not fused_params:
        return None
    return {k: v for k, v in fused_params.items() if k not in _PRIVATE}


def get_embedding_table_index_type(fused_params: FusedParams) -> torch.dtype:
    """The ids' dtype named in ``fused_params`` (default int64)."""
    return (fused_params or {}).get(FUSED_PARAM_EMBEDDING_TABLE_INDEX_TYPE, torch.int64)


def get_embedding_table_offset_type(fused_params: FusedParams) -> torch.dtype:
    """The offsets' dtype named in ``fused_params`` (default int64)."""
    return (fused_params or {}).get(FUSED_PARAM_EMBEDDING_TABLE_OFFSET_TYPE, torch.int64)
