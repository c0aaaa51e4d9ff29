"""fx support for the sparse types: their construction from traced values is recorded."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.fx._symbolic_trace import ProxyableClassMeta, is_fx_symbolic_tracing

# Set while ``recsys_core.fx.Tracer`` traces. Kept here, below the modules that ask
# (``modules.regroup``, ``modules.feature_processor``), because the tracer itself sits above
# the distributed runtime (it resolves sharded modules' awaitables).
_tracing = False


def is_fx_tracing() -> bool:
    """True while :class:`recsys_core.fx.Tracer` traces (TorchRec: ``torchrec.fx.tracer.
    is_fx_tracing``)."""
    return _tracing


@contextmanager
def fx_tracing() -> Iterator[None]:
    """Mark the span of one ``Tracer.trace`` (nested traces restore the outer state)."""
    global _tracing
    previous, _tracing = _tracing, True
    try:
        yield
    finally:
        _tracing = previous


class SparseTypeMeta(ProxyableClassMeta):
    """``torch.fx``'s ProxyableClassMeta (as TorchRec's sparse types use): while symbolic
    tracing, building an instance from a traced value records the constructor as a graph node.
    Outside tracing it is a plain constructor call (no proxy search, no tracing warning)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if is_fx_symbolic_tracing():
            return super().__call__(*args, **kwargs)
        return type.__call__(cls, *args, **kwargs)
