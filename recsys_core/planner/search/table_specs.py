"""Each table of a model as the planner sees it (:class:`TableSpec`): its config, its collection,
its optimizer (for state bytes), its checked constraints and the traffic one rank's batch sends
it (ids and bags per step, from the per-feature pooling factors, poolings and batch sizes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from recsys_core.modules.embedding_configs import DATA_TYPE_BITS, BaseEmbeddingConfig, DataType
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.plan.sharder import optimizer_of
from recsys_core.planner.constraints import ParameterConstraints
from recsys_core.planner.errors import PlannerError, PlannerErrorType
from recsys_core.planner.search.cost import DEFAULT_OPTIMIZER
from recsys_core.planner.search.plan_builder import Collections
from recsys_core.planner.search.types import TableSpec
from recsys_core.planner.topology import Topology


def table_specs(
    collections: Collections,
    constraints_by_table: Mapping[str, ParameterConstraints],
    batch_size: int,
    topology: Topology,
) -> list[TableSpec]:
    """Each table of the planned collections as the planner sees it (its constraints checked)."""
    names = sorted({c.name for _, _, configs in collections.values() for c in configs})
    unknown = sorted(set(constraints_by_table) - set(names))
    if unknown:
        raise PlannerError(
            f"constraints name tables {unknown} that no planned collection has (its tables: "
            f"{names}); key constraints by table name",
            PlannerErrorType.INPUT_VALIDATION,
        )
    specs = []
    for path, (sub, sharder, configs) in collections.items():
        optimizer = optimizer_of(sharder, sub) or DEFAULT_OPTIMIZER
        weighted = bool(getattr(sub, "is_weighted", lambda: False)())
        for config in configs:
            given = constraints_by_table.get(config.name)
            constraints = ParameterConstraints() if given is None else given.checked()
            _check_supported(config, constraints, topology)
            ids, bags = _traffic(config, constraints, batch_size)
            output = constraints.output_dtype or DataType.FP32
            specs.append(TableSpec(
                path=path, config=config, pooled=isinstance(sub, EmbeddingBagCollection),
                optimizer=optimizer.canonical, constraints=constraints, ids_per_batch=ids,
                bags_per_batch=bags, is_weighted=weighted or constraints.is_weighted,
                output_bytes=DATA_TYPE_BITS[output] / 8,
            ))
    return specs

def _traffic(
    config: BaseEmbeddingConfig, c: ParameterConstraints, batch_size: int
) -> tuple[float, float]:
    """(ids, bags) one rank's batch sends to ``config``'s table per step."""
    features = c.feature_names or list(config.feature_names)

    def per_feature(values: Sequence[float] | None, default: float, what: str) -> list[float]:
        if values is None:
            return [default] * len(features)
        if len(values) == 1:
            return [float(values[0])] * len(features)
        if len(values) != len(features):
            raise PlannerError(
                f"table {config.name!r}: constraints give {len(values)} {what} but there are "
                f"{len(features)} features {features}; give one value per feature or one "
                "for all",
                PlannerErrorType.INPUT_VALIDATION,
            )
        return [float(v) for v in values]

    pooling = per_feature(c.pooling_factors, 1.0, "pooling_factors")
    poolings = per_feature(c.num_poolings, 1.0, "num_poolings")
    batches = per_feature(c.batch_sizes, float(batch_size), "batch_sizes")
    bags = [b * n for b, n in zip(batches, poolings, strict=True)]
    return sum(b * p for b, p in zip(bags, pooling, strict=True)), sum(bags)


def _check_supported(
    config: BaseEmbeddingConfig, c: ParameterConstraints, topology: Topology
) -> None:
    """Constraints this planner cannot honour are errors, not silently dropped."""
    where = f"table {config.name!r}"
    if c.feature_names is not None and sorted(c.feature_names) != sorted(config.feature_names):
        raise PlannerError(
            f"{where}: constraints give feature_names {c.feature_names} but the table's features "
            f"are {list(config.feature_names)}; list each of them once (in the order of the "
            "per-feature pooling_factors / num_poolings / batch_sizes)",
            PlannerErrorType.INPUT_VALIDATION,
        )
    if c.device_group is not None and c.device_group != topology.compute_device:
        raise PlannerError(
            f"{where}: constraints put it on device_group {c.device_group!r} but the topology "
            f"is {topology.compute_device!r}; this planner places every table on the topology's "
            "compute device: drop device_group or plan for that device",
            PlannerErrorType.STRICT_CONSTRAINTS,
        )
    if c.key_value_params is not None or c.use_virtual_table:
        raise PlannerError(
            f"{where}: constraints ask for a key-value (SSD / parameter-server) table, which no "
            "kernel of this library provides; drop key_value_params / use_virtual_table (large "
            "tables on CUDA can use EmbeddingComputeKernel.FUSED_UVM_CACHING)",
            PlannerErrorType.STRICT_CONSTRAINTS,
        )
