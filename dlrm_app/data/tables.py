"""What a dataset's embedding tables will need: the summary every preprocessor records.

``parameters["tables"]`` of ``dataset.json`` (and what ``dlrm-app preprocess`` prints)::

    {"num_embeddings": {"cat_0": 1461, "cat_1": 584, ...},    # rows per table
     "total_rows": 1234567,
     "optimizer": "rowwise_adagrad",
     "train_memory_bytes": {"16": ..., "64": ..., "128": ...},  # per embedding dim
     "raw_id_features": ["user_id", ...]}   # only with --id-mapping zch: sized at training

The memory is :func:`dlrm_app.training.resources.table_memory_bytes`: fp32 weights plus the fused
optimizer's state (row-wise Adagrad: one float per row), summed over the tables; buffers and
the dense model come on top.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dlrm_app.data.schema import SparseFeature

SUMMARY_EMBEDDING_DIMS = (16, 64, 128)
"""Embedding dims the summary gives the training memory for."""
SUMMARY_OPTIMIZER = "rowwise_adagrad"
"""The embedding optimizer the summary assumes (the app's default)."""

_GIB = 1 << 30


def _size(n: int) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / (1 << 20):.1f} MiB"


def table_summary(features: Sequence[SparseFeature]) -> dict[str, Any]:
    """The ``tables`` summary (see the module doc) of a dataset's sparse features."""
    # resources imports torch and the planner: only the parent of a preprocessing run needs
    # them, not its worker processes (which import the preprocessors).
    from dlrm_app.training.resources import table_memory_bytes

    sized = [f for f in features if not f.raw_ids]
    sizes = [f.num_embeddings for f in sized]
    summary: dict[str, Any] = {
        "num_embeddings": {f.name: f.num_embeddings for f in sized},
        "total_rows": sum(sizes),
        "optimizer": SUMMARY_OPTIMIZER,
        "train_memory_bytes": {str(d): table_memory_bytes(sizes, d, SUMMARY_OPTIMIZER)
                               if sizes else 0 for d in SUMMARY_EMBEDDING_DIMS},
    }
    raw = [f.name for f in features if f.raw_ids]
    if raw:
        summary["raw_id_features"] = raw
    return summary


def format_table_summary(summary: Mapping[str, Any]) -> str:
    """The summary as lines for a person: each table's rows, then the memory per dim."""
    sizes = summary["num_embeddings"]
    width = max((len(n) for n in sizes), default=0)
    lines = [f"{name:<{width}}  {rows:>13,} rows" for name, rows in sizes.items()]
    if sizes:
        lines.append(f"{'total':<{width}}  {summary['total_rows']:>13,} rows")
    memory = ", ".join(f"dim {d}: {_size(b)}" for d, b in summary["train_memory_bytes"].items())
    if sizes:
        lines.append(f"tables in training (fp32 weights + {summary['optimizer']} state): "
                     f"{memory}")
    raw = summary.get("raw_id_features")
    if raw:
        lines.append(f"raw ids kept for zero-collision hashing (tables sized at training by "
                     f"--zch-rows, not counted above): {', '.join(raw)}")
    return "\n".join(lines)
