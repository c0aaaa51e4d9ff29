"""A LazyAwaitable subclass that skips ``super().__init__()`` fails with TorchRec's message."""

from __future__ import annotations

import pytest
import torch

from recsys_core.distributed import LazyAwaitable


class _NoInit(LazyAwaitable[torch.Tensor]):
    def __init__(self, value: torch.Tensor) -> None:  # forgets super().__init__()
        self.value = value

    def _wait_impl(self) -> torch.Tensor:
        return self.value


class _WithInit(_NoInit):
    def __init__(self, value: torch.Tensor) -> None:
        LazyAwaitable.__init__(self)
        self.value = value


def test_missing_super_init_is_named() -> None:
    with pytest.raises(RuntimeError, match="has not been initialized properly"):
        torch.ones(2) + _NoInit(torch.ones(2))
    with pytest.raises(RuntimeError, match="super\\(\\).__init__"):
        _NoInit(torch.ones(2)).wait()
    assert (torch.ones(2) + _WithInit(torch.ones(2))).tolist() == [2.0, 2.0]
