"""fx tracing for recsys_core models (TorchRec: ``torchrec.fx``)."""

from recsys_core.fx.tracer import Tracer, is_fx_tracing, symbolic_trace

__all__ = ["Tracer", "is_fx_tracing", "symbolic_trace"]
