"""TorchRec's ``torchrec.distributed.sharding_plan`` path: plan generators, shard geometry, the
checked module plan builder (from :mod:`recsys_core.plan`) and the default sharders.

Example (2 ranks on one host)::

    plan = construct_module_sharding_plan(
        ebc,
        {"product_table": row_wise(), "user_table": table_wise(rank=1)},
        world_size=2,
    )
"""

from __future__ import annotations

from torch import nn

from recsys_core.distributed.embedding import EmbeddingCollectionSharder
from recsys_core.distributed.embeddingbag import EmbeddingBagCollectionSharder
from recsys_core.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from recsys_core.distributed.fused_embeddingbag import FusedEmbeddingBagCollectionSharder
from recsys_core.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from recsys_core.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from recsys_core.distributed.quant_embedding import (
    QuantEmbeddingCollectionSharder,
    QuantManagedCollisionEmbeddingCollectionSharder,
)
from recsys_core.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from recsys_core.distributed.types import ModuleSharder
from recsys_core.plan.generators import (
    ParameterShardingGenerator,
    apply_to_all,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    get_sharding_constructor_from_type,
    grid_shard,
    row_blocks,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recsys_core.plan.shard_sizes import (
    MIN_CW_DIM,
    _calculate_cw_shard_sizes_and_offsets,
    _calculate_grid_shard_sizes_and_offsets,
    _calculate_rw_shard_sizes_and_offsets,
    _calculate_uneven_rw_shard_sizes_and_offsets,
    _find_base_dim,
    _get_block_size_for_cw_shard,
    calculate_shard_sizes_and_offsets,
    placement,
    placement_helper,
)
from recsys_core.plan.sharder import register_default_sharders
from recsys_core.plan.validation import (
    TRAINING_KERNELS,
    EmbeddingModule,
    validate_module_sharding_plan,
)


def get_default_sharders() -> list[ModuleSharder[nn.Module]]:
    """TorchRec's default sharders, in its order: EmbeddingBagCollection,
    FeatureProcessedEmbeddingBagCollection, EmbeddingCollection, FusedEmbeddingBagCollection
    (training), the quantized EmbeddingBagCollection and EmbeddingCollection (inference), the
    managed-collision EmbeddingBagCollection and EmbeddingCollection (row-wise, the fused
    kernel) and the quantized managed-collision EmbeddingCollection. All of them execute here:
    this is also ``DistributedModelParallel``'s default."""
    return [
        EmbeddingBagCollectionSharder(),
        FeatureProcessedEmbeddingBagCollectionSharder(),
        EmbeddingCollectionSharder(),
        FusedEmbeddingBagCollectionSharder(),
        QuantEmbeddingBagCollectionSharder(),
        QuantEmbeddingCollectionSharder(),
        ManagedCollisionEmbeddingBagCollectionSharder(),
        ManagedCollisionEmbeddingCollectionSharder(),
        QuantManagedCollisionEmbeddingCollectionSharder(QuantEmbeddingCollectionSharder()),
    ]


def get_executable_default_sharders() -> list[ModuleSharder[nn.Module]]:
    """DistributedModelParallel's default sharders: every default one executes here (the same
    list as :func:`get_default_sharders`)."""
    return get_default_sharders()


register_default_sharders(get_default_sharders)  # the planner's default (collective_plan)


def get_module_to_default_sharders() -> dict[type[nn.Module], ModuleSharder[nn.Module]]:
    """``{module type: its default sharder}`` (TorchRec's helper of the same name)."""
    return {sharder.module_type: sharder for sharder in get_default_sharders()}


__all__ = [
    "MIN_CW_DIM",
    "TRAINING_KERNELS",
    "EmbeddingBagCollectionSharder",
    "EmbeddingCollectionSharder",
    "EmbeddingModule",
    "FeatureProcessedEmbeddingBagCollectionSharder",
    "FusedEmbeddingBagCollectionSharder",
    "ManagedCollisionEmbeddingBagCollectionSharder",
    "ManagedCollisionEmbeddingCollectionSharder",
    "ParameterShardingGenerator",
    "QuantEmbeddingBagCollectionSharder",
    "QuantEmbeddingCollectionSharder",
    "QuantManagedCollisionEmbeddingCollectionSharder",
    "_calculate_cw_shard_sizes_and_offsets",
    "_calculate_grid_shard_sizes_and_offsets",
    "_calculate_rw_shard_sizes_and_offsets",
    "_calculate_uneven_rw_shard_sizes_and_offsets",
    "_find_base_dim",
    "_get_block_size_for_cw_shard",
    "apply_to_all",
    "calculate_shard_sizes_and_offsets",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "get_default_sharders",
    "get_executable_default_sharders",
    "get_module_to_default_sharders",
    "get_sharding_constructor_from_type",
    "grid_shard",
    "placement",
    "placement_helper",
    "row_blocks",
    "row_wise",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
    "validate_module_sharding_plan",
]
