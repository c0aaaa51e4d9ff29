"""Awaitables: results that are ready later (a collective in flight).

``LazyAwaitable`` is what a sharded module's forward returns. ``.wait()`` gives the result; using
the awaitable as if it were the result (an attribute, an operator, a torch function) waits first,
so ``sharded_ebc(kjt).values()`` works like the unsharded module.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

import torch.fx
from torch.fx import _symbolic_trace
from torch.utils._pytree import tree_leaves, tree_map

W = TypeVar("W")
R = TypeVar("R")


class Awaitable(abc.ABC, Generic[W]):
    """Something to wait for; the result is computed once and cached."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[W], W]] = []
        self._done = False
        self._result: W | None = None

    @abc.abstractmethod
    def _wait_impl(self) -> W: ...

    @property
    def callbacks(self) -> list[Callable[[W], W]]:
        """Functions applied, in order, to the result when it is first waited for."""
        return self._callbacks

    def wait(self) -> W:
        if not self._done:
            result = self._wait_impl()
            for callback in self._callbacks:
                result = callback(result)
            self._result, self._done = result, True
        # _done is set together with _result, a W (None only where W admits None)
        return cast(W, self._result)


class FunctionAwaitable(Awaitable[W]):
    """Wraps a zero-argument function: ``wait()`` calls it."""

    def __init__(self, fn: Callable[[], W]) -> None:
        super().__init__()
        self._fn = fn

    def _wait_impl(self) -> W:
        return self._fn()


class _LazyAwaitableMeta(abc.ABCMeta):
    """Under ``torch.fx.symbolic_trace``, a LazyAwaitable built from traced values becomes a node
    of the graph (what fx's ProxyableClassMeta does for TorchRec's), so operators that mix it with
    proxies trace, and the graph builds and waits for it when run. Outside tracing: a plain
    construction (no check beyond one flag, and none of fx's is_fx_tracing warning)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if _symbolic_trace.is_fx_symbolic_tracing():
            proxies = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.fx.Proxy)]
            if proxies:
                return proxies[0].tracer.create_proxy("call_function", cls, args, kwargs)
        return super().__call__(*args, **kwargs)


class LazyAwaitable(Awaitable[W], metaclass=_LazyAwaitableMeta):
    """An awaitable that waits by itself when used as its result."""

    def __getattr__(self, name: str) -> Any:
        if name in ("_callbacks", "_done", "_result"):  # set by Awaitable.__init__
            raise RuntimeError(
                f"LazyAwaitable type {type(self)} has not been initialized properly, did you "
                "forget to call 'super().__init__()' in its __init__?"
            )
        if name.startswith("_"):  # internal attributes and copy/pickle probes
            raise AttributeError(name)
        return getattr(self.wait(), name)

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        def resolve(x: Any) -> Any:
            return x.wait() if isinstance(x, LazyAwaitable) else x

        return func(*tree_map(resolve, args), **tree_map(resolve, kwargs or {}))


def _forward(name: str) -> Callable[..., Any]:
    def method(self: LazyAwaitable[Any], *args: Any) -> Any:
        resolved = [a.wait() if isinstance(a, LazyAwaitable) else a for a in args]
        return getattr(self.wait(), name)(*resolved)

    method.__name__ = name
    return method


for _name in (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__matmul__", "__neg__", "__getitem__", "__len__", "__iter__",
    "__eq__", "__lt__", "__le__", "__gt__", "__ge__", "__contains__",
):
    setattr(LazyAwaitable, _name, _forward(_name))
LazyAwaitable.__hash__ = object.__hash__  # type: ignore[method-assign]


class _ReadyValue(Generic[W]):
    """The waiting part of an awaitable over a value that is already there (listed before the
    awaitable base, whose ``__init__`` it calls)."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj


class NoWait(_ReadyValue[W], Awaitable[W]):
    """An Awaitable over a value that is already there (TorchRec's ``NoWait``)."""


KT = TypeVar("KT")
VT_co = TypeVar("VT_co")
ParentW = TypeVar("ParentW")


class LazyGetItemMixin(Generic[KT, VT_co]):
    """Makes ``awaitable[key]`` another awaitable instead of waiting (TorchRec's mixin for
    awaitables of keyed results: a KeyedTensor, a dict). List it BEFORE LazyAwaitable among the
    bases so that its ``__getitem__`` wins::

        class DictAwaitable(LazyGetItemMixin[str, Tensor], LazyAwaitable[dict[str, Tensor]]): ...
        a = DictAwaitable(...)
        a["f1"]          # a GetItemLazyAwaitable: nothing waited yet
        a["f1"] + 1      # waits for a, takes ["f1"], adds 1
    """

    def __getitem__(self, key: KT) -> LazyAwaitable[VT_co]:
        return GetItemLazyAwaitable(self, key)  # type: ignore[arg-type]


class GetItemLazyAwaitable(LazyAwaitable[W], Generic[W, ParentW, KT]):
    """``parent[key]`` once ``parent`` is waited for."""

    def __init__(self, parent: LazyAwaitable[ParentW], key: KT) -> None:
        super().__init__()
        self._parent = parent
        self._key = key

    def _wait_impl(self) -> W:
        return self._parent.wait()[self._key]  # type: ignore[index]


class LazyNoWait(_ReadyValue[W], LazyAwaitable[W]):
    """A LazyAwaitable over a value that is already there."""
