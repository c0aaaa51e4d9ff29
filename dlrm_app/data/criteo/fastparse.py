"""ctypes binding of the optional C row parser ``dlrm_app/data/criteo/_fastparse.c`` (and of its
id counter and vocabulary lookup, for the default vocabulary).

The package's build compiles it where a C compiler exists (``optional = true`` in
pyproject.toml). It parses only rows in the strict format and declines a block with anything
else; :func:`dlrm_app.data.criteo.parse.parse_block` then (and without the helper) takes the
pyarrow path, so the rows are the same either way. ctypes releases the GIL during the call.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Callable
from typing import Any

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


CFunction = Callable[..., Any]
"""A ctypes function of the helper (its argtypes and restype set where it is looked up)."""


def _function(lib: ctypes.CDLL | None, name: str, restype: Any, argtypes: list[Any],
              ) -> CFunction | None:
    """The helper's function ``name`` with its types set, or None (no helper, or built
    without it)."""
    fn = None if lib is None else getattr(lib, name, None)
    if fn is not None:
        fn.restype, fn.argtypes = restype, argtypes
    return fn


_LIB = _load()
_PARSE = _function(_LIB, "criteo_parse_rows", ctypes.c_int64, [
    ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_void_p])
_LOOKUP = _function(_LIB, "criteo_vocab_lookup", None, [
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
    ctypes.c_int64, ctypes.c_void_p])
_COUNT = _function(_LIB, "criteo_count_ids", ctypes.c_int64,
                   [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p])
_NEWLINES = _function(_LIB, "criteo_count_newlines", ctypes.c_int64,
                      [ctypes.c_char_p, ctypes.c_int64])
enabled = True
"""Tests switch the helper off to compare both paths."""


def available() -> bool:
    """Whether the helper was built with the package (CI builds it; a user may lack a compiler)."""
    return _PARSE is not None


def count_newlines(buf: bytes) -> int:
    """``buf.count(b"\\n")``, 10x faster where the helper is built (a vectorized loop)."""
    if _NEWLINES is None or not isinstance(buf, bytes):
        return buf.count(b"\n")
    return _NEWLINES(buf, len(buf))


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
    got = parse(buf, len(buf), n_lines, label.ctypes.data,
                dense.ctypes.data, cats.ctypes.data)
    return (label, dense, cats) if got == n_lines else None


def lookup_available() -> bool:
    """Whether the helper's vocabulary lookup can be used (built, and not switched off)."""
    return _LOOKUP is not None and enabled


def vocab_lookup(vocab: np.ndarray, first: np.ndarray, shift: int,
                 raw: np.ndarray) -> np.ndarray:
    """Table rows (int64) of the ``raw`` ids in the sorted int64 ``vocab``: ``p + 1`` where
    ``vocab[p] == raw[i]``, else 0; ``first`` is the bucket index of ``vocab`` on its ids'
    bits from ``shift`` up (``first[b]``: the first position whose id's bucket is ``b`` or
    more; ``len(first) - 1`` buckets). Needs :func:`lookup_available`."""
    for a, dtype in ((vocab, np.int64), (first, np.int64), (raw, np.int64)):
        if a.dtype != dtype or not a.flags.c_contiguous:
            raise TypeError("vocab_lookup takes C-contiguous int64 arrays")
    if _LOOKUP is None:
        raise RuntimeError("vocab_lookup: the compiled Criteo helper is not built here; "
                           "call it only where lookup_available() is True")
    out = np.empty(len(raw), np.int64)
    if len(raw):
        _LOOKUP(vocab.ctypes.data, first.ctypes.data, len(first) - 1,
                shift, raw.ctypes.data, len(raw), out.ctypes.data)
    return out


def count_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``np.unique(ids, return_counts=True)`` as uint32 ids and counts (a hash count, then a
    sort of the distinct ids only), or None: no helper, or an id outside ``[0, 2^32)``."""
    if _COUNT is None or not enabled:
        return None
    ids = np.ascontiguousarray(ids, np.int64)
    packed = np.empty(len(ids), np.uint64)  # (id << 32 | count) per distinct id
    d = _COUNT(ids.ctypes.data, len(ids), packed.ctypes.data)
    if d == -2:
        raise MemoryError("counting the ids of a block (criteo_count_ids)")
    if d < 0:
        return None
    packed = np.sort(packed[:d])
    return (packed >> np.uint64(32)).astype(np.uint32), packed.astype(np.uint32)
