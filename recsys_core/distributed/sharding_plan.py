"""TorchRec's ``torchrec.distributed.sharding_plan`` path: plan generators and the checked module
plan builder (re-exported from :mod:`recsys_core.plan`).

Example (2 ranks on one host)::

    plan = construct_module_sharding_plan(
        ebc,
        {"product_table": row_wise(), "user_table": table_wise(rank=1)},
        world_size=2,
    )
"""

from recsys_core.distributed.model_parallel import (
    get_default_sharders,
    get_module_to_default_sharders,
)
from recsys_core.plan.generators import (
    ParameterShardingGenerator,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_blocks,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from recsys_core.plan.validation import (
    TRAINING_KERNELS,
    EmbeddingModule,
    validate_module_sharding_plan,
)

__all__ = [
    "TRAINING_KERNELS",
    "EmbeddingModule",
    "ParameterShardingGenerator",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "get_default_sharders",
    "get_module_to_default_sharders",
    "row_blocks",
    "row_wise",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
    "validate_module_sharding_plan",
]
