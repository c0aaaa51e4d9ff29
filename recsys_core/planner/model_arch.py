"""The model's sparse surface as the planner sees it (TorchRec 1.9's ``planner.model_arch``):
every table a sharder claims, with its owning sharder type, and each sharder's optimizer
settings. Enough to rebuild the tables on meta and plan again; ``model_arch_hash`` is its
content hash (JSON with sorted keys, SHA-256, 16 hex digits).

Tables are found as the enumerator finds them: walk the module tree, and in a module a sharder
claims take ``sharder.shardable_parameters(module)`` (shape from the parameter; features,
pooling and data type from the module's config accessor) without descending further.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from torch import nn

from recsys_core.plan.sharder import fused_params_of
from recsys_core.planner.results import ModelArch, SharderArch, TableArch
from recsys_core.planner.utils import sharder_name

__all__ = ["extract_model_arch", "model_arch_hash", "total_sparse_param_bytes"]

_CONFIG_ACCESSORS = ("embedding_bag_configs", "embedding_configs", "tables")
_BYTES_PER_ELEMENT = {"FP32": 4.0, "FP16": 2.0, "BF16": 2.0, "INT8": 1.0, "UINT8": 1.0,
                      "INT4": 0.5, "INT2": 0.25}


def _value(item: object) -> str | None:
    """An enum's value, anything else as a string, None as None."""
    if item is None:
        return None
    value = getattr(item, "value", None)
    return value if value is not None else str(item)


def _config_of(module: nn.Module, table: str) -> Any | None:
    for accessor in _CONFIG_ACCESSORS:
        configs = getattr(module, accessor, None)
        if not callable(configs):
            continue
        try:
            for config in configs():
                if getattr(config, "name", None) == table:
                    return config
        except Exception:  # noqa: BLE001 - observability only: a table without config info
            continue
    return None


def _sharder_arch(sharder: Any) -> SharderArch:
    params = fused_params_of(sharder)
    return SharderArch(
        sharder_type=type(sharder).__name__,
        optimizer=_value(params.get("optimizer")),
        learning_rate=params.get("learning_rate"),
        eps=params.get("eps"),
        weight_decay=params.get("weight_decay"),
        weight_decay_mode=_value(params.get("weight_decay_mode")),
        beta1=params.get("beta1"),
        beta2=params.get("beta2"),
    )


def _table_arch(name: str, param: Any, config: Any | None, sharder_type: str) -> TableArch:
    shape = tuple(getattr(param, "shape", ()) or ())
    rows = int(shape[0]) if len(shape) >= 1 else int(getattr(config, "num_embeddings", 0) or 0)
    dim = int(shape[1]) if len(shape) >= 2 else int(getattr(config, "embedding_dim", 0) or 0)
    return TableArch(
        name=name, num_embeddings=rows, embedding_dim=dim,
        feature_names=tuple(getattr(config, "feature_names", ()) or ()) if config else (),
        pooling=_value(getattr(config, "pooling", None)) if config else None,
        data_type=_value(getattr(config, "data_type", None)) if config else None,
        sharder_type=sharder_type,
    )


def extract_model_arch(module: nn.Module, sharders: Sequence[Any]) -> ModelArch:
    """The tables of ``module`` that ``sharders`` claim, one per (name, sharder type), sorted;
    the sharder types and their optimizer settings, sorted."""
    by_type = {sharder_name(s.module_type): s for s in sharders}
    tables: dict[tuple[str, str], TableArch] = {}
    pending: list[nn.Module] = [module]
    while pending:
        child = pending.pop()
        sharder = by_type.get(sharder_name(type(child)))
        if sharder is None:
            pending.extend(child.children())
            continue
        sharder_type = type(sharder).__name__
        try:
            params = dict(sharder.shardable_parameters(child))
        except Exception:  # noqa: BLE001 - observability only
            continue
        for name, param in params.items():
            if name and (name, sharder_type) not in tables:
                tables[(name, sharder_type)] = _table_arch(
                    name, param, _config_of(child, name), sharder_type)
    archs = sorted({_sharder_arch(s) for s in sharders},
                   key=lambda a: (a.sharder_type, a.optimizer or ""))
    return ModelArch(
        tables=tuple(tables[key] for key in sorted(tables)),
        sharder_types=tuple(sorted({type(s).__name__ for s in sharders})),
        sharders=tuple(archs),
    )


def model_arch_hash(arch: ModelArch) -> str:
    """16 hex digits of SHA-256 over the architecture as JSON with sorted keys."""
    payload = {
        "tables": [
            {"name": t.name, "num_embeddings": t.num_embeddings,
             "embedding_dim": t.embedding_dim, "feature_names": list(t.feature_names),
             "pooling": t.pooling, "data_type": t.data_type, "sharder_type": t.sharder_type}
            for t in arch.tables
        ],
        "sharder_types": list(arch.sharder_types),
        "sharders": [
            {"sharder_type": s.sharder_type, "optimizer": s.optimizer,
             "learning_rate": s.learning_rate, "eps": s.eps, "weight_decay": s.weight_decay,
             "weight_decay_mode": s.weight_decay_mode, "beta1": s.beta1, "beta2": s.beta2}
            for s in arch.sharders
        ],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def total_sparse_param_bytes(arch: ModelArch) -> int:
    """Bytes of every table's weights (rows x dim x element size; FP32 when unknown)."""
    return sum(
        int(t.num_embeddings * t.embedding_dim
            * _BYTES_PER_ELEMENT.get((t.data_type or "").upper(), 4.0))
        for t in arch.tables
    )
