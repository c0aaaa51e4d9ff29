"""A LazyAwaitable built from traced values traces with plain ``torch.fx.symbolic_trace``: its
construction is a node of the graph (TorchRec's ProxyableClassMeta behaviour), so arithmetic
that mixes it with tensors traces and the graph gives the eager values."""

from __future__ import annotations

import torch

from recsys_core.distributed.awaitable import LazyAwaitable


class _Doubled(LazyAwaitable[torch.Tensor]):
    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self._x = x

    def _wait_impl(self) -> torch.Tensor:
        return self._x * 2


class _Async(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> LazyAwaitable[torch.Tensor]:
        return _Doubled(x)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Async(), _Async()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.a(x) + (x * 3 + 5) - self.b(x)  # x=1: 4 + 8 - 2 = 10


def test_lazy_awaitable_traces_as_a_graph_node() -> None:
    model = _Model()
    x = torch.ones(3, 4)
    torch.testing.assert_close(model(x), torch.full((3, 4), 10.0), rtol=0, atol=0)
    graph = torch.fx.symbolic_trace(model)
    assert any(node.target is _Doubled for node in graph.graph.nodes)
    torch.testing.assert_close(graph(x), torch.full((3, 4), 10.0), rtol=0, atol=0)
    torch.testing.assert_close(graph(2 * x), torch.full((3, 4), 15.0), rtol=0, atol=0)
