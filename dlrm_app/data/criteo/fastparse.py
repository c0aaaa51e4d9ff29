"""ctypes binding of the optional C row parser ``dlrm_app/data/criteo/_fastparse.c``.

The package's build compiles it where a C compiler exists (``optional = true`` in
pyproject.toml). It parses only rows in the strict format and declines a block with anything
else; :func:`dlrm_app.data.criteo.parse.parse_block` then (and without the helper) takes the
pyarrow path, so the rows are the same either way. ctypes releases the GIL during the call.
"""

from __future__ import annotations

import ctypes
import importlib.util

import numpy as np

from dlrm_app.data.criteo.format import NUM_DENSE, NUM_SPARSE


def _load() -> ctypes.CDLL | None:
    try:
        spec = importlib.util.find_spec("dlrm_app.data.criteo._fastparse")
        if spec is None or not spec.origin or not spec.origin.endswith((".so", ".pyd", ".dylib")):
            return None
        return ctypes.CDLL(spec.origin)
    except (ImportError, OSError):
        return None


def _parse_fn(lib: ctypes.CDLL | None) -> object | None:
    fn = None if lib is None else getattr(lib, "criteo_parse_rows", None)
    if fn is not None:
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p]
    return fn


_PARSE = _parse_fn(_load())
enabled = True
"""Tests switch the helper off to compare both paths."""


def available() -> bool:
    """Whether the helper was built with the package (CI builds it; a user may lack a compiler)."""
    return _PARSE is not None


def parse_rows(buf: bytes, n_lines: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Labels (float32), dense ints ``[n, 13]`` and categorical ids ``[26, n]`` of the
    ``n_lines`` lines of ``buf`` (each ending in a newline), or None: no helper, or some line
    is not in the strict row format (the caller parses the block the general way)."""
    if _PARSE is None or not enabled or n_lines == 0 or not isinstance(buf, bytes):
        return None
    label = np.empty(n_lines, np.float32)
    dense = np.empty((n_lines, NUM_DENSE), np.int64)
    cats = np.empty((NUM_SPARSE, n_lines), np.int64)
    parse = _PARSE
    got = parse(buf, len(buf), n_lines, label.ctypes.data,  # type: ignore[operator]
                dense.ctypes.data, cats.ctypes.data)
    return (label, dense, cats) if got == n_lines else None
