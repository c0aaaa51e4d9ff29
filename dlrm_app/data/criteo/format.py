"""The Criteo row format: what a raw row is, for preprocessing and for serving alike.

A row is one line of tab-separated fields::

    label \\t I1 .. I13 \\t C1 .. C26
    1     \\t 5 \\t \\t -1 ... \\t 68fd1e64 \\t \\t 80e26c9b ...

* ``label``: ``0`` or ``1`` (served rows carry no label unless the request says so);
* ``I1..I13``: integers in decimal (negatives allowed), empty = missing;
* ``C1..C26``: categoricals as 1-8 hex digits (8 in the real data, either case), empty =
  missing, read as the integer they spell;
* a row with fewer fields is padded with missing values at the end (the Kaggle files strip
  empty trailing fields); more fields than 40 is an error.

Both releases use this row; they differ in how rows are split (:class:`SplitRule`):

* ``kaggle``: of the ``N`` lines of all inputs concatenated, the first ``N * 6 // 7`` are
  train, of the rest the first half (rounded down) is validation and the remainder test;
* ``terabyte``: every input is one day; all but the last are train, the last day's first half
  of lines (rounded down) is validation and the rest test;
* or every row in one named split (a held-out file encoded like another dataset).

The splits count lines, bad rows included, so skipping a bad row never moves a boundary.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from dlrm_app.data.schema import DENSE_COLUMN, SPLIT_NAMES

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
"""Fields of a labeled row (label, dense, categorical)."""
MAX_HEX_DIGITS = 8
LABEL = "label"
DENSE_NAMES = tuple(f"int_{i}" for i in range(NUM_DENSE))
SPARSE_NAMES = tuple(f"cat_{i}" for i in range(NUM_SPARSE))
COLUMNS = (LABEL, *DENSE_NAMES, *SPARSE_NAMES)
"""Names of a labeled row's fields, in order."""
FORMATS = ("kaggle", "terabyte")

DENSE_FIELD = re.compile(r"-?[0-9]+")
MAX_DENSE_DIGITS = 18
"""Longer integers may not fit int64: such a row is a bad row (real values have a few digits)."""
MAX_LINE_BYTES = 256 << 10
"""A longer line is a bad row (real rows are a few hundred bytes); it never reaches the CSV
parser, whose blocks it could straddle."""
"""A present integer field."""
_HEX_DIGIT = "[0-9a-fA-F]"
SPARSE_FIELD = re.compile(rf"{_HEX_DIGIT}{{1,{MAX_HEX_DIGITS}}}")
"""A present categorical field."""

HEX_LUT = np.full(256, 255, dtype=np.uint8)
"""Byte -> hex digit value, 255 for a byte that is not a hex digit."""
for _i, _c in enumerate(b"0123456789abcdef"):
    HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    HEX_LUT[_c] = 10 + _i

OUTPUT_SCHEMA = pa.schema([(LABEL, pa.float32()),
                           (DENSE_COLUMN, pa.list_(pa.float32(), NUM_DENSE))]
                          + [(n, pa.list_(pa.int64())) for n in SPARSE_NAMES])
"""The Parquet columns of a preprocessed shard (the dataset.json contract's layout)."""


def value_problem(feature: int, value: str) -> str | None:
    """Why the present field ``value`` of feature ``feature`` (0..38: dense, then
    categorical) is invalid, or None."""
    if feature < NUM_DENSE:
        if not DENSE_FIELD.fullmatch(value):
            return "is not a decimal integer"
        digits = len(value.lstrip("-"))
        return None if digits <= MAX_DENSE_DIGITS else f"has {digits} digits (beyond int64)"
    return None if SPARSE_FIELD.fullmatch(value) else f"is not 1-{MAX_HEX_DIGITS} hex digits"


def row_pattern(num_dense: int = NUM_DENSE, num_sparse: int = NUM_SPARSE) -> re.Pattern:
    """Matches an unlabeled row padded to all its fields (missing = empty)."""
    return re.compile("\t".join([f"(?:{DENSE_FIELD.pattern})?"] * num_dense
                                + [f"{_HEX_DIGIT}{{0,{MAX_HEX_DIGITS}}}"]
                                * num_sparse))


def row_problem(text: str) -> str:
    """Why one raw labeled line (without newline) is not a valid row (pure Python, slow)."""
    fields = text.split("\t")
    if len(fields) > NUM_FIELDS:
        return (f"{len(fields)} tab-separated fields, expected at most {NUM_FIELDS} "
                f"(label, {NUM_DENSE} integer, {NUM_SPARSE} categorical)")
    fields += [""] * (NUM_FIELDS - len(fields))
    if fields[0] not in ("0", "1"):
        return f"label {fields[0]!r} is not 0 or 1"
    for j, (name, f) in enumerate(zip(COLUMNS[1:], fields[1:], strict=True)):
        if f and (problem := value_problem(j, f)):
            kind = "integer" if j < NUM_DENSE else "categorical"
            shown = repr(f) if len(f) <= 40 else repr(f[:40]) + f"... ({len(f)} chars)"
            return f"{kind} feature {name} = {shown} {problem}"
    return "value out of range"


def bad_row_error(path: Path, line: int, problem: str) -> ValueError:
    return ValueError(f"{path}:{line}: {problem}; fix or delete the line, or pass "
                      f"--on-bad-row skip to drop bad rows")


def decode_hex_fields(fields: np.ndarray) -> np.ndarray:
    """int64 values of validated categorical fields: a ``[..]`` array of ``S8`` byte strings
    of 0-8 hex digits (empty -> 0)."""
    raw = fields.astype(f"S{MAX_HEX_DIGITS}")
    digits = raw.view(np.uint8).reshape(*raw.shape, MAX_HEX_DIGITS)
    out = np.zeros(raw.shape, np.int64)
    for k in range(MAX_HEX_DIGITS):
        c = digits[..., k]  # NUL past a value's end
        out = np.where(c != 0, (out << 4) | (HEX_LUT[c] & 15), out)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class SplitRule:
    """Which lines go to which split: the release's rule, or all in ``one_split``."""

    fmt: str
    one_split: str | None = None

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be 'kaggle' or 'terabyte', got {self.fmt!r}")
        if self.one_split is not None and self.one_split not in SPLIT_NAMES:
            raise ValueError(f"one_split must be one of {SPLIT_NAMES} or None, got "
                             f"{self.one_split!r}")

    @property
    def description(self) -> str:
        if self.one_split is not None:
            return f"every row in {self.one_split}"
        if self.fmt == "kaggle":
            return "kaggle: first N*6//7 lines train, then half validation, rest test"
        return "terabyte: all but the last day train, last day halves validation/test"

    def starts(self, counts: Sequence[int | None]) -> list[list[int]]:
        """Per input, the 0-based lines where validation and test start, where known without
        reading the data: kaggle needs every count, terabyte's validation starts the last
        day."""
        starts: list[list[int]] = [[] for _ in counts]
        if self.one_split is not None:
            return starts
        if self.fmt == "terabyte":
            half = counts[-1]
            starts[-1] = [0] if half is None else [0, half // 2]
        elif all(n is not None for n in counts):
            known = [n for n in counts if n is not None]  # all of them
            total = sum(known)
            train = total * 6 // 7
            offset = 0
            for i, n in enumerate(known):
                starts[i] = [c - offset for c in (train, train + (total - train) // 2)
                             if offset <= c < offset + n]
                offset += n
        return starts

    def line_edges(self, input_lines: Sequence[int]) -> list[int]:
        """Line edges [0, train end, validation end, lines] of the contiguous splits."""
        total = sum(input_lines)
        if self.one_split is not None:
            k = SPLIT_NAMES.index(self.one_split)
            return [0] * (k + 1) + [total] * (len(SPLIT_NAMES) - k)
        if self.fmt == "kaggle":
            train = total * 6 // 7
            val = train + (total - train) // 2
        else:
            train = total - input_lines[-1]
            val = train + input_lines[-1] // 2
        return [0, train, val, total]

    def row_edges(self, input_lines: Sequence[int], skipped: Sequence[int]) -> list[int]:
        """Row edges of the splits: ``line_edges`` less the skipped (0-based) lines before."""
        bad = np.sort(np.asarray(skipped, np.int64))
        return [int(x - np.searchsorted(bad, x)) for x in self.line_edges(input_lines)]

    def train_lines(self, counts: Sequence[int | None]) -> list[float]:
        """Per input, how many of its first lines are train (inf: all); kaggle needs every
        count."""
        if self.one_split is not None:
            return [float("inf") if self.one_split == "train" else 0.0] * len(counts)
        if self.fmt == "kaggle":
            known = [n for n in counts if n is not None]
            assert len(known) == len(counts), "kaggle's splits need every input's line count"
            train = self.line_edges(known)[1]
            starts = np.cumsum([0, *known[:-1]]).tolist()
            return [min(max(train - s, 0), n) for s, n in zip(starts, known, strict=True)]
        return [float("inf")] * (len(counts) - 1) + [0.0]
