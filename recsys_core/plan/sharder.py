"""What the planner asks of a sharder: a structural interface the runtime's sharders implement.

Declared here, below both the planner and the distributed runtime, so the planner can name it
without importing the runtime (``EmbeddingBagCollectionSharder`` matches it structurally).
"""

from __future__ import annotations

from typing import Protocol

from torch import nn


class Sharder(Protocol):
    """What the planner asks a sharder (EmbeddingBagCollectionSharder matches this)."""

    @property
    def module_type(self) -> type[nn.Module]: ...

    def sharding_types(self, compute_device_type: str) -> list[str]: ...

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]: ...
