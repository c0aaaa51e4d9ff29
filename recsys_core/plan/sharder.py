"""What the planner asks of a sharder: a structural interface the runtime's sharders implement.

Declared here, below both the planner and the distributed runtime, so the planner can name it
without importing the runtime (``EmbeddingBagCollectionSharder`` matches it structurally).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import nn


class Sharder(Protocol):
    """What the planner asks a sharder (EmbeddingBagCollectionSharder matches this)."""

    @property
    def module_type(self) -> type[nn.Module]: ...

    def sharding_types(self, compute_device_type: str) -> list[str]: ...

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]: ...


_default_sharders: Callable[[], list[Sharder]] | None = None


def register_default_sharders(factory: Callable[[], list[Sharder]]) -> None:
    """Set what :func:`default_sharders` returns (the runtime registers TorchRec's default list
    when ``recsys_core.distributed`` is imported, so the planner never imports the runtime)."""
    global _default_sharders
    _default_sharders = factory


def default_sharders() -> list[Sharder]:
    """TorchRec's default sharders, for planner calls given ``sharders=None``."""
    if _default_sharders is None:
        raise ValueError(
            "no sharders given and none registered: pass sharders=[...] (e.g. "
            "EmbeddingBagCollectionSharder()), or import recsys_core.distributed first"
        )
    return _default_sharders()
