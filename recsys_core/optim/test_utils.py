"""Test helpers at TorchRec's import path ``torchrec.optim.test_utils``."""

from __future__ import annotations

from typing import Any

from recsys_core.optim.keyed import KeyedOptimizer


class DummyKeyedOptimizer(KeyedOptimizer):
    """A KeyedOptimizer whose ``step`` does nothing (the base class's raises)."""

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None
