"""fx support for the sparse types: their construction from traced values is recorded."""

from __future__ import annotations

from typing import Any

from torch.fx._symbolic_trace import ProxyableClassMeta, is_fx_symbolic_tracing


class SparseTypeMeta(ProxyableClassMeta):
    """``torch.fx``'s ProxyableClassMeta (as TorchRec's sparse types use): while symbolic
    tracing, building an instance from a traced value records the constructor as a graph node.
    Outside tracing it is a plain constructor call (no proxy search, no tracing warning)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if is_fx_symbolic_tracing():
            return super().__call__(*args, **kwargs)
        return type.__call__(cls, *args, **kwargs)
