"""This library's cost model at its earlier import path: re-exports only (the model is
``search/cost.py``; TorchRec's estimators are ``shard_estimators.py``)."""

from recsys_core.planner.search.cost import (
    DEFAULT_CACHE_LOAD_FACTOR,
    DEFAULT_OPTIMIZER,
    estimate_option,
    state_bytes_per_row,
    weights_and_state_bytes,
)

__all__ = ["DEFAULT_CACHE_LOAD_FACTOR", "DEFAULT_OPTIMIZER", "estimate_option",
           "state_bytes_per_row", "weights_and_state_bytes"]
