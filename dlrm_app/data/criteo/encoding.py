"""How raw categorical ids become table rows, and the encoder that writes a block's rows.

Transforms (the reference DLRM's defaults):

* dense: missing -> 0, negatives clamped to 0, then ``log(x + 1)``, stored as float32;
* categorical: hex -> integer, missing -> 0 *before* encoding (so a missing value shares the
  id of the hex value ``0``, as in the reference), then either

  - by default a train-split vocabulary (:mod:`dlrm_app.data.criteo.vocabulary`): tables sized
    from the data, ids seen at least ``frequency_threshold`` times in train, at most
    ``max_embeddings_per_feature`` rows per table, everything else in row 0; or
  - modulo hashing ``id % num_embeddings`` into ``num_embeddings_per_feature`` rows (e.g. the
    reference's 40,000,000 ``max-ind-range`` for Criteo 1TB, whose distinct ids are too many
    to count exactly in memory); or
  - ``zch``: the raw ids themselves (``[0, 2^32)``), mapped to table rows by the model at
    training time with zero-collision hashing (tables sized by ``dlrm-app train --zch-rows``).

The ``encoding`` record of ``dataset.json`` says which: ``mode`` (``vocabulary``, ``hash`` or
``zch``) and ``num_embeddings`` (the 26 table sizes; for ``zch`` the raw id space); a vocabulary adds ``frequency_threshold``,
``max_embeddings_per_feature``, ``rare_id`` (0), ``vocabulary_sha256``, and per feature
``distinct_train_ids``, ``qualified_ids`` (seen at least ``frequency_threshold`` times, before
the cap) and ``train_coverage`` (the share of train rows whose id has a row of its own). With
``like``, the record (and vocabulary) of another dataset is copied, plus ``like`` (where from),
so both encode every raw row the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from dlrm_app.config import DEFAULT_FREQUENCY_THRESHOLD, DEFAULT_MAX_EMBEDDINGS_PER_FEATURE
from dlrm_app.data.criteo import fastparse
from dlrm_app.data.criteo.format import NUM_DENSE, NUM_SPARSE, OUTPUT_SCHEMA, SplitRule
from dlrm_app.data.criteo.lines import LineIndex
from dlrm_app.data.criteo.parse import Rows
from dlrm_app.data.criteo.spill import SpillPlan
from dlrm_app.data.criteo.vocabulary import (
    DEFAULT_VOCABULARY_MEMORY_BYTES,
    GROWN_VOCABULARY,
    RARE_ID,
    VOCABULARY_FILE,
    build_vocabulary,
    load_vocabulary_rows,
)
from dlrm_app.data.criteo.workers import Runner
from dlrm_app.data.schema import DatasetSpec, sha256_file

ID_MAPPINGS = ("vocabulary", "hash", "zch")
"""``preprocess criteo --id-mapping`` choices."""

RAW_ID_SPACE = 1 << 32
"""With ``--id-mapping zch`` the ids stay raw: Criteo's 8-hex-digit values, ``[0, 2^32)``."""


class Encoder:
    """Raw rows -> the Parquet table of the dataset.json contract."""

    def __init__(self, num_embeddings: list[int], vocab: list[np.ndarray] | None,
                 rows: list[np.ndarray] | None = None) -> None:
        self.num_embeddings, self.vocab = num_embeddings, vocab
        # a vocabulary grown by added days: vocab[k][i] has row rows[k][i], not i + 1
        self.table = None if rows is None else \
            [np.concatenate([[RARE_ID], r]).astype(np.int64) for r in rows]
        self.index = None if vocab is None or not fastparse.lookup_available() else \
            [VocabularyIndex(v) for v in vocab]

    def encode(self, rows: Rows, sl: slice) -> pa.Table:
        n = len(rows.label[sl])
        dense = np.log1p(np.maximum(rows.dense[sl], 0).astype(np.float64)).astype(np.float32)
        offsets = pa.array(np.arange(n + 1, dtype=np.int32))
        cols = []
        for k, raw in enumerate(rows.cats):
            raw = raw[sl]
            if self.vocab is None:
                ids = raw % self.num_embeddings[k]
            elif self.index is not None:
                ids = self.index[k].rows(raw)
            else:
                ids = vocabulary_rows(self.vocab[k], raw)
            if self.vocab is not None and self.table is not None:
                ids = self.table[k][ids]
            cols.append(pa.ListArray.from_arrays(offsets, pa.array(ids)))
        dense_col = pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), NUM_DENSE)
        return pa.Table.from_arrays([pa.array(rows.label[sl]), dense_col, *cols],
                                    schema=OUTPUT_SCHEMA)


def vocabulary_rows(vocab: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """Table rows of ``raw`` ids in the sorted ``vocab`` (``i + 1`` for ``vocab[i]``, else
    ``RARE_ID``), in numpy: the path without the C helper, and the reference for it."""
    pos = _positions(vocab, raw)
    hit = vocab[np.minimum(pos, len(vocab) - 1)] == raw if len(vocab) \
        else np.zeros(len(raw), bool)
    return np.where(hit, pos + 1, RARE_ID).astype(np.int64)


class VocabularyIndex:
    """One feature's sorted vocabulary with a bucket index on its ids' high bits, searched by
    the C helper (:func:`~dlrm_app.data.criteo.fastparse.vocab_lookup`). About 2-4 ids a
    bucket (raw ids are spread over their range), so a lookup reads an index entry and a
    cache line of the vocabulary: 5x faster than sorting the keys for ``np.searchsorted`` on
    the 9.8 M-id vocabulary of 10 M generated rows (4 M ids in its largest table; 41 against
    200 ms a block of 126k rows). The index holds 8 bytes per bucket (at most 4 per id), built
    in each encoding process (30 ms for 9.8 M ids) from the shared mapped vocabulary. Ids
    clustered in a small part of the range share buckets: then a lookup is a binary search
    within its bucket, never worse than over the whole vocabulary."""

    def __init__(self, vocab: np.ndarray) -> None:
        self.vocab = np.ascontiguousarray(vocab, np.int64)
        n, top = len(self.vocab), int(self.vocab[-1]) if len(self.vocab) else 0
        self.shift = max(0, top.bit_length() - max(0, n.bit_length() - 2))
        buckets = (top >> self.shift) + 1
        self.first = np.zeros(buckets + 1, np.int64)
        if n and self.vocab[0] >= 0:  # raw ids are never negative; else none is found
            np.cumsum(np.bincount(self.vocab >> self.shift, minlength=buckets),
                      out=self.first[1:])

    def rows(self, raw: np.ndarray) -> np.ndarray:
        """Table rows of the ``raw`` ids: as :func:`vocabulary_rows`."""
        if not len(self.vocab) or self.vocab[0] < 0:
            return vocabulary_rows(self.vocab, raw)
        return fastparse.vocab_lookup(self.vocab, self.first, self.shift,
                                      np.ascontiguousarray(raw, np.int64))


_CACHED_VOCABULARY = 1 << 16  # ids (512 KB): a binary search stays in the CPU cache


def _positions(vocab: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """``np.searchsorted(vocab, raw)``. A large vocabulary is searched with the keys sorted:
    each search starts where the last ended, in memory the last one brought into the cache
    (5x faster for a 10 M-id vocabulary than keys in row order). The keys are sorted with
    their row numbers packed into the low bits (raw ids have at most 32 bits), twice as fast
    as an argsort."""
    if len(vocab) <= _CACHED_VOCABULARY:
        return np.searchsorted(vocab, raw)
    bits = np.uint64(max(len(raw) - 1, 1).bit_length())
    packed = (raw.astype(np.uint64) << bits) | np.arange(len(raw), dtype=np.uint64)
    packed.sort()
    pos = np.empty(len(raw), np.int64)
    pos[(packed & ((np.uint64(1) << bits) - np.uint64(1))).astype(np.intp)] = \
        np.searchsorted(vocab, (packed >> bits).astype(np.int64))
    return pos


SHARED_VOCABULARY = "vocabulary.npy"
"""In ``.staging``: every feature's kept ids, concatenated, mapped by every encoding process."""


@dataclasses.dataclass(frozen=True, slots=True)
class EncodeSpec:
    """What a worker needs to build the encoder: the table sizes and, for a vocabulary, the
    ``.npy`` file it is memory-mapped from (one copy in the page cache for all processes,
    nothing to decode) with each feature's ``[start, end)`` in it."""

    num_embeddings: tuple[int, ...]
    vocabulary: str | None = None
    vocabulary_edges: tuple[int, ...] = ()
    vocabulary_digest: str | None = None
    """A hash of the mapped ids: which vocabulary this is (for the run's fingerprint)."""
    vocabulary_rows: str | None = None
    """A vocabulary grown by added days: the ``.npy`` file of every kept id's row (same
    edges); None: id ``i`` of a feature is row ``i + 1``."""

    @classmethod
    def of(cls, encoding: dict, out: Path, staging: Path,
           vocab: list[np.ndarray] | None = None,
           rows: list[np.ndarray] | None = None) -> EncodeSpec:
        """The spec of an ``encoding`` record whose vocabulary (if any) is ``vocab`` (with
        ``rows``, a grown one: see :func:`~dlrm_app.data.criteo.vocabulary.grow`) or in
        ``out``; a vocabulary is written to ``staging`` for the encoding processes."""
        sizes = tuple(encoding["num_embeddings"])
        if encoding["mode"] != "vocabulary":
            return cls(sizes)
        if vocab is None:
            grown = encoding.get(GROWN_VOCABULARY)
            vocab, rows = load_vocabulary_rows(out, None if grown is None else grown["file"])
        staging.mkdir(exist_ok=True)
        ids = np.concatenate(vocab).astype(np.int64, copy=False)
        edges = tuple(np.cumsum([0, *map(len, vocab)]).tolist())
        digest = hashlib.sha256(ids.data)
        digest.update(np.asarray(edges, np.int64).data)
        _save_npy(staging / SHARED_VOCABULARY, ids)
        rows_file = None
        if rows is not None:
            flat = np.concatenate(rows).astype(np.int64, copy=False)
            digest.update(flat.data)
            rows_file = str(staging / SHARED_ROWS)
            _save_npy(staging / SHARED_ROWS, flat)
        return cls(sizes, str(staging / SHARED_VOCABULARY), edges, digest.hexdigest(),
                   rows_file)


SHARED_ROWS = "vocabulary-rows.npy"
"""In ``.staging``, for a grown vocabulary: the row of every id of ``SHARED_VOCABULARY``."""


def _save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


@functools.lru_cache(maxsize=1)
def encoder(spec: EncodeSpec) -> Encoder:
    vocab = rows = None
    if spec.vocabulary is not None:
        ids = np.load(spec.vocabulary, mmap_mode="r")
        edges = spec.vocabulary_edges
        vocab = [ids[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]
        if spec.vocabulary_rows is not None:
            flat = np.load(spec.vocabulary_rows)
            rows = [flat[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return Encoder(list(spec.num_embeddings), vocab, rows)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncodingRequest:
    """How the caller asked for ids to be encoded; checked once, before any reading.

    Three kinds, one per call: ``like`` (another dataset's encoding), hashing
    (``num_embeddings_per_feature``), or a train-split vocabulary (the default; its
    ``frequency_threshold`` and ``max_embeddings_per_feature`` default to the module
    constants).
    """

    num_embeddings_per_feature: int | Sequence[int] | None = None
    """Hash into this many rows per feature (one int or 26)."""
    frequency_threshold: int | None = None
    """Vocabulary: train occurrences an id needs for a row of its own."""
    max_embeddings_per_feature: int | Sequence[int] | None = None
    """Vocabulary: rows per table at most (one int or 26), the out-of-vocabulary row included."""
    like: str | os.PathLike[str] | None = None
    """Reuse this dataset's encoding (and vocabulary)."""
    vocabulary_memory_bytes: int = DEFAULT_VOCABULARY_MEMORY_BYTES
    """Vocabulary: memory the count of distinct train ids may use."""
    id_mapping: str | None = None
    """``vocabulary``, ``hash`` or ``zch`` (raw ids kept; the model maps them at training
    time); None: ``hash`` when ``num_embeddings_per_feature`` is given, else ``vocabulary``."""

    def __post_init__(self) -> None:
        mapping = self.id_mapping
        if mapping is not None and mapping not in ID_MAPPINGS:
            raise ValueError(f"id_mapping (--id-mapping) must be one of {list(ID_MAPPINGS)}, "
                             f"got {mapping!r}")
        if mapping is not None and self.like is not None:
            raise ValueError(f"like= reuses {self.like}'s id mapping; drop --id-mapping")
        if mapping == "hash" and self.num_embeddings_per_feature is None:
            raise ValueError("--id-mapping hash needs the table sizes: pass "
                             "--num-embeddings-per-feature N (one int or 26)")
        if mapping == "zch":
            given = [flag for flag, value in (
                ("--num-embeddings-per-feature", self.num_embeddings_per_feature),
                ("--frequency-threshold", self.frequency_threshold),
                ("--max-embeddings-per-feature", self.max_embeddings_per_feature))
                if value is not None]
            if given:
                raise ValueError(f"--id-mapping zch keeps raw ids and sizes the tables at "
                                 f"training time (dlrm-app train --zch-rows); drop "
                                 f"{', '.join(given)}")
        if mapping == "vocabulary" and self.num_embeddings_per_feature is not None:
            raise ValueError("--num-embeddings-per-feature hashes ids; with --id-mapping "
                             "vocabulary drop it (or pass --id-mapping hash)")
        vocabulary = [n for n, v in (("frequency_threshold", self.frequency_threshold),
                                     ("max_embeddings_per_feature",
                                      self.max_embeddings_per_feature)) if v is not None]
        if self.like is not None and (vocabulary or self.num_embeddings_per_feature is not None):
            given = vocabulary + ["num_embeddings_per_feature"] * (
                self.num_embeddings_per_feature is not None)
            raise ValueError(f"like= reuses {self.like}'s encoding; drop {', '.join(given)} "
                             f"(the table sizes come from {self.like})")
        if self.num_embeddings_per_feature is not None and vocabulary:
            raise ValueError(
                f"num_embeddings_per_feature (--num-embeddings-per-feature) hashes ids into "
                f"tables of fixed size; {' and '.join(vocabulary)} "
                f"({' and '.join('--' + v.replace('_', '-') for v in vocabulary)}) size tables "
                f"from a train-split vocabulary; pass one kind, not both")
        if self.num_embeddings_per_feature is not None:
            _per_feature(self.num_embeddings_per_feature, "num_embeddings_per_feature")
        if self.max_embeddings_per_feature is not None:
            _per_feature(self.max_embeddings_per_feature, "max_embeddings_per_feature")
        threshold = self.frequency_threshold
        if threshold is not None and (isinstance(threshold, bool)
                                      or not isinstance(threshold, int) or threshold < 1):
            raise ValueError(f"frequency_threshold must be an int >= 1, got {threshold!r}")
        if self.vocabulary_memory_bytes < 1:
            raise ValueError(f"vocabulary_memory_bytes must be positive, got "
                             f"{self.vocabulary_memory_bytes}")

    @property
    def mode(self) -> str:
        """``like``, ``zch``, ``hash`` or ``vocabulary``."""
        if self.like is not None:
            return "like"
        if self.id_mapping == "zch":
            return "zch"
        return "hash" if self.num_embeddings_per_feature is not None else "vocabulary"


def _per_feature(value: int | Sequence[int], name: str) -> list[int]:
    sizes = [value] * NUM_SPARSE if isinstance(value, int) else list(value)
    if len(sizes) != NUM_SPARSE or any(isinstance(n, bool) or not isinstance(n, int | np.integer)
                                       or n < 1 for n in sizes):
        raise ValueError(f"{name} must be one positive int or {NUM_SPARSE} (one per "
                         f"categorical feature), got {value!r}")
    return [int(n) for n in sizes]


def choose_encoding(run: Runner, paths: list[Path], out: Path, rule: SplitRule,
                    counts: list[int | None], indexes: list[LineIndex | None],
                    request: EncodingRequest, block_bytes: int, on_bad_row: str,
                    spill_to: Path | None = None
                    ) -> tuple[dict, list[np.ndarray] | None, SpillPlan | None]:
    """The ``encoding`` record of dataset.json, the vocabulary it built (None if it built
    none; its ``vocabulary_sha256`` is then None until the caller saves it with
    :func:`~dlrm_app.data.criteo.vocabulary.save_vocabulary`), and where the vocabulary's
    counting pass kept the rows it parsed (with ``spill_to``; see
    :mod:`~dlrm_app.data.criteo.spill`); a ``like`` vocabulary is copied into ``out``."""
    if request.mode == "like":
        like = request.like
        assert like is not None
        recorded = DatasetSpec.load(like).encoding
        if recorded is None:
            raise ValueError(f"--like {like}: that dataset records no id encoding (hash or "
                             "vocabulary); pass a dataset made by `dlrm-app preprocess criteo`")
        encoding = dict(recorded)
        if encoding["mode"] == "vocabulary":
            src = Path(like) / VOCABULARY_FILE
            if sha256_file(src) != encoding["vocabulary_sha256"]:
                raise ValueError(f"{src}: checksum differs from {like}/dataset.json; "
                                 f"re-run the preprocessing of {like}")
            shutil.copyfile(src, out / f".{VOCABULARY_FILE}.tmp")
            os.replace(out / f".{VOCABULARY_FILE}.tmp", out / VOCABULARY_FILE)
            grown = encoding.get(GROWN_VOCABULARY)
            if grown is not None:  # days were added to it: their rows too
                src = Path(like) / grown["file"]
                if sha256_file(src) != grown["sha256"]:
                    raise ValueError(f"{src}: checksum differs from {like}/dataset.json; "
                                     f"re-run the preprocessing of {like}")
                shutil.copyfile(src, out / f".{grown['file']}.tmp")
                os.replace(out / f".{grown['file']}.tmp", out / grown["file"])
        encoding["like"] = str(like)
        return encoding, None, None
    if request.mode == "zch":
        return {"mode": "zch", "num_embeddings": [RAW_ID_SPACE] * NUM_SPARSE}, None, None
    if request.mode == "hash":
        assert request.num_embeddings_per_feature is not None
        return {"mode": "hash", "num_embeddings": _per_feature(
            request.num_embeddings_per_feature, "num_embeddings_per_feature")}, None, None
    threshold = DEFAULT_FREQUENCY_THRESHOLD if request.frequency_threshold is None \
        else request.frequency_threshold
    cap = _per_feature(DEFAULT_MAX_EMBEDDINGS_PER_FEATURE if request.max_embeddings_per_feature
                       is None else request.max_embeddings_per_feature,
                       "max_embeddings_per_feature")
    vocab = build_vocabulary(run, paths, rule, counts, indexes, threshold, cap, block_bytes,
                             on_bad_row, request.vocabulary_memory_bytes, spill_to)
    return {"mode": "vocabulary", "frequency_threshold": threshold,
            "max_embeddings_per_feature": cap, "rare_id": RARE_ID,
            "vocabulary_sha256": None,  # the caller saves it (save_vocabulary)
            "num_embeddings": vocab.num_embeddings,
            "distinct_train_ids": vocab.distinct, "qualified_ids": vocab.qualified,
            "train_coverage": [round(c, 6) for c in vocab.coverage]}, vocab.ids, vocab.spill
