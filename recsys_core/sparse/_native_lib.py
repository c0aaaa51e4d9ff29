"""ctypes bindings of the optional C helper ``recsys_core/sparse/_native.c``.

The package's build compiles it where a C compiler exists (``optional = true`` in
pyproject.toml); without it every caller runs the same work as torch ops, with identical
results. ctypes releases the GIL for the duration of each call.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch


def load_c_helper(module: str) -> ctypes.CDLL | None:
    """A compiled C helper of the package (``module``: its dotted name) opened with ctypes, or
    None where the package was built without it (no C compiler at install time) or it does not
    load. This one and ``kernels._rowio`` open theirs here (the app's Criteo parser keeps its
    own loader: it imports no torch, and importing this package would)."""
    try:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not spec.origin.endswith((".so", ".pyd", ".dylib")):
            return None
        return ctypes.CDLL(spec.origin)
    except (ImportError, OSError):
        return None


_LIB = load_c_helper("recsys_core.sparse._native")


def _load_module() -> object | None:
    try:
        return importlib.import_module("recsys_core.sparse._native")
    except ImportError:
        return None


# The same library imported as a module: its ``key_sums`` returns Python lists directly, and
# ``offsets_diff`` writes lengths without a ctypes call.
_MODULE = _load_module() if _LIB is not None else None
_KEY_SUMS_LISTS = getattr(_MODULE, "key_sums", None)
_OFFSETS_DIFF = getattr(_MODULE, "offsets_diff", None)
_INDEX_DTYPES = (torch.int64, torch.int32)


def _key_sums_fns(lib: ctypes.CDLL | None) -> dict[torch.dtype, object] | None:
    if lib is None:
        return None
    args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    out = {}
    for dtype, fn in ((torch.int64, lib.recsys_key_sums_i64), (torch.int32, lib.recsys_key_sums_i32)):
        fn.restype, fn.argtypes = ctypes.c_int64, args
        out[dtype] = fn
    return out


def _permute_fn(lib: ctypes.CDLL | None) -> Callable[..., Any] | None:
    fn = None if lib is None else getattr(lib, "recsys_permute_blocks", None)
    if fn is not None:
        fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_void_p]
    return fn


def _column_runs_fn(lib: ctypes.CDLL | None) -> Callable[..., Any] | None:
    """The helper's ctypes function (argtypes and restype set), or None."""
    fn = None if lib is None else getattr(lib, "recsys_copy_column_runs", None)
    if fn is not None:
        fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_void_p]
    return fn


_KEY_SUMS = _key_sums_fns(_LIB)
_PERMUTE = _permute_fn(_LIB)
_COLUMN_RUNS = _column_runs_fn(_LIB)
_enabled = True


def available() -> bool:
    """Whether the helper was built with the package (CI builds it; a user may lack a compiler)."""
    return _LIB is not None


@contextlib.contextmanager
def torch_path_only() -> Iterator[None]:
    """Within this block every caller runs its torch path (tests and ``bench/kjt_ops.py``
    compare the two); not thread-safe."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


@contextlib.contextmanager
def vector_level(level: int) -> Iterator[int]:
    """Within this block the helper's vector loops run their build for ``level`` (2: AVX-512,
    1: AVX2, 0: 16-byte vectors) or the CPU's, whichever is lower; yields the level in use.
    Tests run every build the machine can this way; not thread-safe."""
    fn = getattr(_MODULE, "vector_level", None)
    if fn is None:
        yield 0
        return
    previous = fn()
    try:
        yield fn(level)
    finally:
        fn(previous)


def key_sums(dtype: torch.dtype) -> object | None:
    """``recsys_key_sums_{i64,i32}(lengths, keys, stride, max_length, sums_out) -> 0 | 1`` for
    lengths of ``dtype`` (per-key sums + range proof; see ``_native.c``), or None."""
    if not _enabled or _KEY_SUMS is None:
        return None
    return _KEY_SUMS.get(dtype)


def key_sums_lists() -> object | None:
    """``key_sums(address, element_size, num_keys, stride, max_length) -> (sums, offsets) |
    None`` of ``_native.c`` (the one-pass proof and per-key sums, with the running offsets, as
    lists), or None where the helper is absent or switched off."""
    return _KEY_SUMS_LISTS if _enabled else None


def offsets_to_lengths(offsets: torch.Tensor) -> torch.Tensor | None:
    """``offsets[1:] - offsets[:-1]`` in one C loop (a new tensor, same dtype) for a 1-D
    contiguous host tensor of at least two int64 / int32 offsets, or None (the caller's torch
    op then runs): torch's int64 subtraction took 68 us for 106k offsets on one thread of an
    AVX-512 EPYC, this loop 26 (most of it writing the new tensor)."""
    fn = _OFFSETS_DIFF if _enabled else None
    if (
        fn is None
        or type(offsets) is not torch.Tensor
        or not offsets.is_cpu
        or offsets.dtype not in _INDEX_DTYPES
        or offsets.stride() != (1,)
        or torch.compiler.is_compiling()
        or torch.jit.is_tracing()  # a trace would record the empty tensor, not the C loop
    ):
        return None
    n = offsets.numel() - 1
    if n < 1:
        return None
    lengths = torch.empty(n, dtype=offsets.dtype)
    fn(offsets.data_ptr(), lengths.data_ptr(), n, offsets.element_size())
    return lengths


def _plain_host(t: torch.Tensor) -> bool:
    """A dense, contiguous CPU tensor with real storage and no autograd history to keep."""
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.requires_grad
    )


def permute_blocks(
    indices: list[int],
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    stride_per_key: list[int],
    length_per_key: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``KeyedJaggedTensor.permute``'s gather of per-key blocks of 1-D ``lengths`` and of
    ``values``/``weights`` (rows ``length_per_key``) in one C call, or None where the helper
    is absent or a tensor is not a plain contiguous host tensor (the caller's torch path then
    runs). The caller has proven the layout (per-key blocks inside their tensors); the helper
    re-checks the block bounds and returns None instead of copying if they fail."""
    fn = _PERMUTE if _enabled else None
    if (
        fn is None
        or torch.jit.is_scripting()
        or torch.compiler.is_compiling()
        or torch.jit.is_tracing()  # a trace would record the empty tensors, not the copies
    ):
        return None
    if not (_plain_host(lengths) and _plain_host(values)):
        return None
    if weights is not None and not (_plain_host(weights) and weights.size(0) == values.size(0)):
        return None
    num_lengths = 0
    num_values = 0
    for i in indices:
        num_lengths += stride_per_key[i]
        num_values += length_per_key[i]
    new_lengths = lengths.new_empty(num_lengths)
    new_values = values.new_empty((num_values, *values.shape[1:]))
    new_weights = None
    weights_meta = [0, 0, 0, 0]
    if weights is not None:
        new_weights = weights.new_empty((num_values, *weights.shape[1:]))
        weights_meta = [
            weights.data_ptr(), new_weights.data_ptr(), _row_bytes(weights), weights.size(0)
        ]
    meta = np.array(
        [
            len(stride_per_key), len(indices),
            lengths.data_ptr(), new_lengths.data_ptr(), lengths.element_size(), lengths.numel(),
            values.data_ptr(), new_values.data_ptr(), _row_bytes(values), values.size(0),
            *weights_meta, *indices, *stride_per_key, *length_per_key,
        ],
        dtype=np.int64,
    )
    if fn(meta.ctypes.data) != 0:
        return None
    return new_lengths, new_values, new_weights


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one entry along dim 0 (a scalar for 1-D tensors)."""
    row = 1
    for s in t.shape[1:]:
        row *= s
    return row * t.element_size()


def _row_major(t: torch.Tensor, rows: int, dtype: torch.dtype) -> bool:
    return (type(t) is torch.Tensor and t.is_cpu and t.dim() == 2 and t.shape[0] == rows
            and t.dtype == dtype and (t.stride(1) == 1 or t.shape[1] <= 1))


def copy_column_runs(
    wide: torch.Tensor,
    parts: Sequence[torch.Tensor | None],
    runs: Sequence[tuple[int, int, int, int]],
    to_parts: bool,
) -> bool:
    """Copy column runs between ``wide`` and ``parts`` (2-D host tensors of the same rows and
    dtype, each row contiguous): run ``(part, part_col, wide_col, cols)`` is
    ``wide[:, wide_col:wide_col + cols]`` and ``parts[part][:, part_col:part_col + cols]``,
    copied into ``parts`` with ``to_parts``, else into ``wide``; runs of a None part are
    skipped. One C loop, row by row (see ``recsys_copy_column_runs``). Returns False without
    copying when the helper is absent or switched off or a tensor does not qualify (the caller
    then copies with torch); a run outside its tensors raises."""
    fn = _COLUMN_RUNS if _enabled else None
    if fn is None or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    rows, dtype = wide.shape[0] if wide.dim() == 2 else -1, wide.dtype
    if not _row_major(wide, rows, dtype) or any(
        p is not None and not _row_major(p, rows, dtype) for p in parts
    ):
        return False
    size = wide.element_size()
    meta = [rows, 0, int(to_parts), wide.data_ptr(), wide.stride(0) * size]
    for part, part_col, wide_col, cols in runs:
        p = parts[part]
        if p is None or cols == 0:
            continue
        if not (0 <= part_col <= p.shape[1] - cols and 0 <= wide_col <= wide.shape[1] - cols
                and cols > 0):
            raise ValueError(
                f"copy_column_runs: run of {cols} column(s) at column {part_col} of part {part} "
                f"(width {p.shape[1]}) and column {wide_col} of the wide tensor (width "
                f"{wide.shape[1]}) lies outside them")
        meta += [p.data_ptr(), p.stride(0) * size, part_col * size, wide_col * size, cols * size]
        meta[1] += 1
    if rows == 0 or meta[1] == 0:
        return True
    if fn((ctypes.c_int64 * len(meta))(*meta)) != 0:
        raise RuntimeError("copy_column_runs: the C helper refused its arguments")
    return True
