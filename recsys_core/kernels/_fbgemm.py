"""The one place in the project that imports ``fbgemm_gpu``.

Everything else asks :func:`fbgemm_available` and uses ``torch.ops.fbgemm`` (registered by the
import) or the names re-exported here. Set ``RECSYS_CORE_DISABLE_FBGEMM=1`` to force the pure-torch
kernels everywhere (the fallback has the same numerics; tests use it as a second implementation).
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import torch

_DISABLE_ENV = "RECSYS_CORE_DISABLE_FBGEMM"


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get(_DISABLE_ENV, "") not in ("", "0"):
        return None, f"disabled by {_DISABLE_ENV}"
    try:
        # fbgemm prints deprecation chatter at import; it is not ours to act on.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import fbgemm_gpu  # noqa: F401
            import fbgemm_gpu.split_table_batched_embeddings_ops_training as tbe_training
    except (ImportError, OSError) as exc:  # OSError: an ABI mismatch surfaces as undefined symbol
        return None, f"fbgemm_gpu failed to import: {exc}"
    return tbe_training, "ok"


_TBE_TRAINING, _STATUS = _load()


def fbgemm_available() -> bool:
    """True when fbgemm_gpu imported and its ops are registered in ``torch.ops.fbgemm``."""
    return _TBE_TRAINING is not None


def fbgemm_optim_type(value: str) -> object:
    """FBGEMM's ``EmbOptimType`` member with this string value."""
    tbe_training_module()
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return EmbOptimType(value)


def fbgemm_sparse_type(dtype: torch.dtype) -> object:
    """FBGEMM's ``SparseType`` of float32 or float16 weights."""
    tbe_training_module()
    from fbgemm_gpu.split_embedding_configs import SparseType

    return {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16}[dtype]


def fbgemm_supports(device: torch.device) -> bool:
    """True when FBGEMM has kernels for tensors on ``device`` (the CPU build has no CUDA ops)."""
    if _TBE_TRAINING is None:
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        import fbgemm_gpu

        return getattr(fbgemm_gpu, "__variant__", "cpu") != "cpu"
    return False


def fbgemm_status() -> str:
    """``"ok"`` or why FBGEMM is not used (shown by ``dlrm-app info``)."""
    return _STATUS


def fbgemm_version() -> str | None:
    if not fbgemm_available():
        return None
    import fbgemm_gpu

    return getattr(fbgemm_gpu, "__version__", "unknown")


def tbe_training_module() -> ModuleType:
    """``fbgemm_gpu.split_table_batched_embeddings_ops_training`` (raises if unavailable)."""
    if _TBE_TRAINING is None:
        raise RuntimeError(f"FBGEMM kernels requested but unavailable: {_STATUS}")
    return _TBE_TRAINING
