"""Compute kernels: FBGEMM-backed where available, with pure-torch fallbacks of equal numerics."""

from recsys_core.kernels._fbgemm import (
    fbgemm_available,
    fbgemm_status,
    fbgemm_supports,
    fbgemm_version,
)

__all__ = ["fbgemm_available", "fbgemm_status", "fbgemm_supports", "fbgemm_version"]
