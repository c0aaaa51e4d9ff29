"""Running a test through each build of the C helper (``recsys_core/sparse/_native.c``) and
through the torch path it falls back to."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from recsys_core.sparse import _native_lib


@contextlib.contextmanager
def native_path(level: int | None) -> Iterator[None]:
    """``None``: the torch path only. Else the helper with its vector build ``level`` (2:
    AVX-512, 1: AVX2, 0: 16-byte vectors and memcpy); skipped where the helper was not built or
    the CPU lacks that build."""
    if level is None:
        with _native_lib.torch_path_only():
            yield
        return
    if not _native_lib.available():
        pytest.skip("recsys_core/sparse/_native.c was not built")
    with _native_lib.vector_level(level) as in_use:
        if in_use != level:
            pytest.skip(f"this CPU has no vector build {level}")
        yield
