"""torch.fx tracing for models built on recsys_core (TorchRec: ``torchrec.fx.tracer``).

The sparse types record their construction in the graph by themselves (see
``recsys_core.sparse._fx``), so a plain ``torch.fx`` trace already handles modules that take,
build or return KeyedJaggedTensor / JaggedTensor / KeyedTensor. This tracer adds what TorchRec's
adds on top: leaf modules named by class, and awaitables (a sharded module's output) resolved to
their result so the graph holds the value, not the awaitable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx.node import Argument

from recsys_core.distributed.awaitable import Awaitable
from recsys_core.sparse._fx import fx_tracing, is_fx_tracing

__all__ = ["Tracer", "is_fx_tracing", "symbolic_trace"]


class Tracer(torch.fx.Tracer):
    """``torch.fx.Tracer`` that also treats modules whose class name is in ``leaf_modules`` as
    leaves (called, not traced through) and waits on awaitables passed as arguments."""

    def __init__(self, leaf_modules: list[str] | None = None) -> None:
        super().__init__()
        self._leaf_modules: list[str] = list(leaf_modules) if leaf_modules is not None else []

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if type(m).__name__ in self._leaf_modules:
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def trace(
        self,
        root: torch.nn.Module | Callable[..., Any],
        concrete_args: dict[str, Any] | None = None,
    ) -> torch.fx.Graph:
        with fx_tracing():
            return super().trace(root, concrete_args)

    def create_arg(self, a: Any) -> Argument:
        if isinstance(a, Awaitable):
            # As TorchRec does for LazyAwaitable: the graph records the result.
            return super().create_arg(a.wait())
        return super().create_arg(a)


def symbolic_trace(
    root: torch.nn.Module | Callable[..., Any],
    concrete_args: dict[str, Any] | None = None,
    leaf_modules: list[str] | None = None,
) -> torch.fx.GraphModule:
    """Trace ``root`` with :class:`Tracer` into a ``GraphModule`` (TorchRec's signature).

    ``concrete_args`` fixes some inputs (e.g. to remove control flow); ``leaf_modules`` lists
    class names of submodules to keep as calls instead of tracing through them.
    """
    tracer = Tracer(leaf_modules)
    graph = tracer.trace(root, concrete_args)
    name = root.__class__.__name__ if isinstance(root, torch.nn.Module) else root.__name__
    return torch.fx.GraphModule(tracer.root, graph, name)
