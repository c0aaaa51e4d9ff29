"""The planner at its earlier import path (``recsys_core.distributed`` imports
``plan_for_env`` from here): re-exports only; the planner is ``planners.py``."""

from recsys_core.planner.planners import EmbeddingShardingPlanner, plan_for_env

__all__ = ["EmbeddingShardingPlanner", "plan_for_env"]
