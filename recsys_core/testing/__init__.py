"""Test helpers that users can import too: real multi-process gloo runs."""

from recsys_core.testing.multiprocess import find_free_port, run_gloo

__all__ = ["find_free_port", "run_gloo"]
