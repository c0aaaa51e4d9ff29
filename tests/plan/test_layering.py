"""The plan-data layer sits below the planner and the distributed runtime."""

import subprocess
import sys

import pytest


def _loaded_after_import(module: str) -> list[str]:
    code = (
        f"import sys, {module}; "
        "print('\\n'.join(m for m in sys.modules if m.startswith('recsys_core.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return out.stdout.split()


@pytest.mark.parametrize(
    "module", ["recsys_core.plan", "recsys_core.planner", "recsys_core.quant.sharding"])
@pytest.mark.slow
def test_plan_and_planner_do_not_load_the_distributed_runtime(module: str) -> None:
    loaded = _loaded_after_import(module)
    assert module in loaded
    assert [m for m in loaded if m.startswith("recsys_core.distributed")] == []


def test_plan_does_not_load_the_planner() -> None:
    loaded = _loaded_after_import("recsys_core.plan")
    assert [m for m in loaded if m.startswith("recsys_core.planner")] == []


def test_distributed_paths_re_export_the_plan_layer_objects() -> None:
    from recsys_core import plan
    from recsys_core.distributed import sharding_plan, types

    for name in ("ShardingType", "EmbeddingComputeKernel", "ParameterSharding", "ShardingPlan",
                 "EmbeddingModuleShardingPlan", "ShardMetadata", "ShardingEnv"):
        assert getattr(types, name) is getattr(plan, name)
    for name in ("table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise",
                 "table_column_wise", "construct_module_sharding_plan",
                 "validate_module_sharding_plan"):
        assert getattr(sharding_plan, name) is getattr(plan, name)


def test_default_sharders_at_torchrec_path() -> None:
    """TorchRec's ``sharding_plan.get_default_sharders()``: one sharder per module type, in
    TorchRec's order; DistributedModelParallel's default is the same list (managed-collision
    collections shard row-wise)."""
    from recsys_core import EmbeddingBagCollection, EmbeddingCollection, FusedEmbeddingBagCollection
    from recsys_core.distributed import (
        EmbeddingBagCollectionSharder,
        EmbeddingCollectionSharder,
        FusedEmbeddingBagCollectionSharder,
    )
    from recsys_core.distributed.fp_embeddingbag import (
        FeatureProcessedEmbeddingBagCollectionSharder,
    )
    from recsys_core.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from recsys_core.distributed.mc_embeddingbag import (
        ManagedCollisionEmbeddingBagCollectionSharder,
    )
    from recsys_core.distributed.quant_embedding import (
        QuantEmbeddingCollectionSharder,
        QuantManagedCollisionEmbeddingCollectionSharder,
    )
    from recsys_core.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
    from recsys_core.distributed.sharding_plan import (
        get_default_sharders,
        get_executable_default_sharders,
        get_module_to_default_sharders,
    )
    from recsys_core.inference import QuantEmbeddingBagCollection
    from recsys_core.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from recsys_core.modules.mc_embedding_modules import (
        ManagedCollisionEmbeddingBagCollection,
        ManagedCollisionEmbeddingCollection,
    )
    from recsys_core.quant.quant_sequence import (
        QuantEmbeddingCollection,
        QuantManagedCollisionEmbeddingCollection,
    )

    executable = [
        EmbeddingBagCollectionSharder, FeatureProcessedEmbeddingBagCollectionSharder,
        EmbeddingCollectionSharder, FusedEmbeddingBagCollectionSharder,
        QuantEmbeddingBagCollectionSharder, QuantEmbeddingCollectionSharder,
        ManagedCollisionEmbeddingBagCollectionSharder, ManagedCollisionEmbeddingCollectionSharder,
        QuantManagedCollisionEmbeddingCollectionSharder]
    assert [type(s) for s in get_executable_default_sharders()] == executable
    assert [type(s) for s in get_default_sharders()] == executable
    by_type = get_module_to_default_sharders()
    assert {t: type(s) for t, s in by_type.items()} == {
        EmbeddingBagCollection: EmbeddingBagCollectionSharder,
        FeatureProcessedEmbeddingBagCollection: FeatureProcessedEmbeddingBagCollectionSharder,
        EmbeddingCollection: EmbeddingCollectionSharder,
        FusedEmbeddingBagCollection: FusedEmbeddingBagCollectionSharder,
        QuantEmbeddingBagCollection: QuantEmbeddingBagCollectionSharder,
        ManagedCollisionEmbeddingBagCollection: ManagedCollisionEmbeddingBagCollectionSharder,
        ManagedCollisionEmbeddingCollection: ManagedCollisionEmbeddingCollectionSharder,
        QuantEmbeddingCollection: QuantEmbeddingCollectionSharder,
        QuantManagedCollisionEmbeddingCollection: QuantManagedCollisionEmbeddingCollectionSharder,
    }
