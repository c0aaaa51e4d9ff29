"""The one place in the project that imports ``fbgemm_gpu``.

Everything else asks :func:`fbgemm_available` and uses ``torch.ops.fbgemm`` (registered by the
import) or the names re-exported here. Set ``RECSYS_CORE_DISABLE_FBGEMM=1`` to force the pure-torch
kernels everywhere (the fallback has the same numerics; tests use it as a second implementation).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from types import ModuleType

import torch

_DISABLE_ENV = "RECSYS_CORE_DISABLE_FBGEMM"


MATCHING_FBGEMM = {"2.13": "1.8.0", "2.14": "1.9.0"}
"""The FBGEMM release built for each torch release (an FBGEMM loads with its own torch only)."""

CPU_EXTRA = {"2.13": "cpu-torch213", "2.14": "cpu"}
"""The project's extra that installs that FBGEMM's CPU build (pyproject.toml)."""


def _torch_release() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _how_to_get(release: str) -> str:
    """The install line for the FBGEMM built for torch ``release``, or why there is none."""
    match = MATCHING_FBGEMM.get(release)
    if match is None:
        return (f"no FBGEMM release here is built for torch {release}: "
                f"{', '.join(f'torch {t} <-> {f}' for t, f in MATCHING_FBGEMM.items())}")
    return (f"install the FBGEMM built for torch {release}: "
            f"pip install -e \".[{CPU_EXTRA[release]}]\" in the project's folder "
            f"(fbgemm-gpu-cpu=={match}; fbgemm-gpu=={match} with CUDA)")


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get(_DISABLE_ENV, "") not in ("", "0"):
        return None, f"disabled by {_DISABLE_ENV}"
    if importlib.util.find_spec("fbgemm_gpu") is None:
        return None, ("fbgemm_gpu is not installed; for FBGEMM's kernels "
                      f"{_how_to_get(_torch_release())}")
    try:
        # fbgemm prints deprecation chatter at import; it is not ours to act on.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import fbgemm_gpu  # noqa: F401
            import fbgemm_gpu.split_table_batched_embeddings_ops_training as tbe_training
    except Exception as exc:  # noqa: BLE001  an ABI mismatch: ImportError, OSError, RuntimeError
        return None, _broken(exc)
    return tbe_training, "ok"


def _broken(exc: Exception) -> str:
    """One line: why an installed FBGEMM did not load, and how to get its kernels."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"fbgemm_gpu is installed but failed to import ({first}); every path runs on the "
            f"pure-torch kernels (same numerics, slower); for FBGEMM's kernels "
            f"{_how_to_get(_torch_release())}")


_TBE_TRAINING, _STATUS = _load()
if _TBE_TRAINING is None and _STATUS.startswith("fbgemm_gpu is installed"):
    warnings.warn(_STATUS, RuntimeWarning, stacklevel=2)


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
