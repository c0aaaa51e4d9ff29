"""The planner reads sharders through recsys_core.plan.sharder (PlanningSharder), never importing
recsys_core.distributed: what it reads must equal what the runtime's sharders say."""

from __future__ import annotations

import itertools
from unittest.mock import MagicMock

import pytest
import torch

from recsys_core.distributed.embedding_types import (
    BaseEmbeddingSharder,
    BaseQuantEmbeddingSharder,
)
from recsys_core.distributed.types import ModuleSharder, StorageUsageType, compute_storage_usage
from recsys_core.plan.sharder import storage_usage, storage_usage_type_of
from recsys_core.planner.utils import build_sharder_data

KERNELS = ["dense", "fused", "fused_uvm", "fused_uvm_caching", "quant", "quant_uvm",
           "quant_uvm_caching", "key_value"]


@pytest.mark.parametrize("kind", list(StorageUsageType))
def test_storage_usage_is_the_runtimes_rule(kind: StorageUsageType) -> None:
    tensor = torch.empty(10, 4, dtype=torch.float16)  # 80 bytes, 10 rows
    for device, kernel in itertools.product(["cpu", "cuda", "mtia"], KERNELS):
        assert storage_usage(tensor, device, kernel, kind) == compute_storage_usage(
            tensor, device, kernel, kind), (kind, device, kernel)


def test_storage_usage_by_hand() -> None:
    tensor = torch.empty(10, 4)  # 160 bytes
    assert storage_usage(tensor, "cuda", "fused_uvm", StorageUsageType.BASE) == {"ddr": 160}
    assert storage_usage(tensor, "cuda", "fused_uvm", StorageUsageType.DEFAULT) == {"hbm": 160}
    assert storage_usage(tensor, "cuda", "quant", StorageUsageType.BASE_QUANT) == {"hbm": 200}
    assert storage_usage(tensor, "cpu", "fused", None) == {"ddr": 160}  # no kind: the default


@pytest.mark.parametrize(("cls", "kind"), [
    (BaseEmbeddingSharder, StorageUsageType.BASE),
    (BaseQuantEmbeddingSharder, StorageUsageType.BASE_QUANT),
    (ModuleSharder, StorageUsageType.DEFAULT),
])
def test_storage_usage_type_follows_the_sharders_class(cls: type, kind: StorageUsageType) -> None:
    # TorchRec decides by the class; its tests pass mocks made with spec=the sharder class.
    mock = MagicMock(spec=cls)
    mock.fused_params, mock.qcomm_codecs_registry = {"cache_load_factor": 0.5}, None
    assert storage_usage_type_of(mock) is kind
    data = build_sharder_data(mock)
    assert data.storage_usage_type is kind
    assert data.fused_params == {"cache_load_factor": 0.5}


def test_a_sharder_without_the_protocol_counts_as_the_default() -> None:
    class Plain:
        module_type = torch.nn.Module

    assert storage_usage_type_of(Plain()) is None
    assert build_sharder_data(Plain()).fused_params == {}
