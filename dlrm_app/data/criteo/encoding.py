"""How raw categorical ids become table rows, and the encoder that writes a block's rows.

Transforms (the reference DLRM's defaults):

* dense: missing -> 0, negatives clamped to 0, then ``log(x + 1)``, stored as float32;
* categorical: hex -> integer, missing -> 0 *before* encoding (so a missing value shares the
  id of the hex value ``0``, as in the reference), then either modulo hashing
  ``id % num_embeddings`` (default 40,000,000 per feature, the reference's ``max-ind-range``)
  or a frequency-threshold vocabulary (:mod:`dlrm_app.data.criteo.vocabulary`).

The ``encoding`` record of ``dataset.json`` says which, with the table sizes; ``like`` copies
another dataset's record (and vocabulary), so both encode every raw row the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from dlrm_app.data.criteo.format import NUM_DENSE, NUM_SPARSE, OUTPUT_SCHEMA, SplitRule
from dlrm_app.data.criteo.parse import Rows
from dlrm_app.data.criteo.vocabulary import (
    RARE_ID,
    VOCABULARY_FILE,
    build_vocabulary,
    load_vocabulary,
    save_vocabulary,
)
from dlrm_app.data.criteo.workers import Runner
from dlrm_app.data.schema import DatasetSpec, sha256_file

DEFAULT_NUM_EMBEDDINGS = 40_000_000


class Encoder:
    """Raw rows -> the Parquet table of the dataset.json contract."""

    def __init__(self, num_embeddings: list[int], vocab: list[np.ndarray] | None) -> None:
        self.num_embeddings, self.vocab = num_embeddings, vocab

    def encode(self, rows: Rows, sl: slice) -> pa.Table:
        n = len(rows.label[sl])
        dense = np.log1p(np.maximum(rows.dense[sl], 0).astype(np.float64)).astype(np.float32)
        offsets = pa.array(np.arange(n + 1, dtype=np.int32))
        cols = []
        for k, raw in enumerate(rows.cats):
            raw = raw[sl]
            if self.vocab is None:
                ids = raw % self.num_embeddings[k]
            else:
                v = self.vocab[k]
                pos = np.searchsorted(v, raw)
                hit = v[np.minimum(pos, len(v) - 1)] == raw if len(v) else np.zeros(n, bool)
                ids = np.where(hit, pos + 1, RARE_ID).astype(np.int64)
            cols.append(pa.ListArray.from_arrays(offsets, pa.array(ids)))
        dense_col = pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), NUM_DENSE)
        return pa.Table.from_arrays([pa.array(rows.label[sl]), dense_col, *cols],
                                    schema=OUTPUT_SCHEMA)


@dataclasses.dataclass(frozen=True, slots=True)
class EncodeSpec:
    """What a worker needs to build the encoder (a vocabulary is loaded once per process)."""

    num_embeddings: tuple[int, ...]
    vocabulary: str | None = None
    vocabulary_sha256: str | None = None

    @classmethod
    def of(cls, encoding: dict, out: Path) -> EncodeSpec:
        """The spec of an ``encoding`` record whose vocabulary (if any) is in ``out``."""
        sizes = tuple(encoding["num_embeddings"])
        if encoding["mode"] == "vocabulary":
            return cls(sizes, str(out / VOCABULARY_FILE), encoding["vocabulary_sha256"])
        return cls(sizes)


@functools.lru_cache(maxsize=1)
def encoder(spec: EncodeSpec) -> Encoder:
    vocab = None if spec.vocabulary is None else load_vocabulary(Path(spec.vocabulary).parent)
    return Encoder(list(spec.num_embeddings), vocab)


def choose_encoding(run: Runner, paths: list[Path], out: Path, rule: SplitRule,
                    counts: list[int | None],
                    num_embeddings_per_feature: int | Sequence[int] | None,
                    frequency_threshold: int | None, like: str | os.PathLike[str] | None,
                    block_bytes: int, on_bad_row: str) -> dict:
    """The ``encoding`` record of dataset.json; a vocabulary is built or copied into ``out``."""
    if like is not None:
        if num_embeddings_per_feature is not None or frequency_threshold is not None:
            raise ValueError("pass either like= or an encoding (num_embeddings_per_feature / "
                             "frequency_threshold), not both")
        encoding = dict(DatasetSpec.load(like).parameters["encoding"])
        if encoding["mode"] == "vocabulary":
            src = Path(like) / VOCABULARY_FILE
            if sha256_file(src) != encoding["vocabulary_sha256"]:
                raise ValueError(f"{src}: checksum differs from {like}/dataset.json; "
                                 f"re-run the preprocessing of {like}")
            shutil.copyfile(src, out / f".{VOCABULARY_FILE}.tmp")
            os.replace(out / f".{VOCABULARY_FILE}.tmp", out / VOCABULARY_FILE)
        encoding["like"] = str(like)
        return encoding
    if frequency_threshold is not None:
        if num_embeddings_per_feature is not None:
            raise ValueError("pass num_embeddings_per_feature or frequency_threshold, not both")
        if frequency_threshold < 1:
            raise ValueError(f"frequency_threshold must be >= 1, got {frequency_threshold}")
        vocab = build_vocabulary(run, paths, rule, counts, frequency_threshold, block_bytes,
                                 on_bad_row)
        return {"mode": "vocabulary", "frequency_threshold": frequency_threshold,
                "rare_id": RARE_ID, "vocabulary_sha256": save_vocabulary(out, vocab),
                "num_embeddings": [len(v) + 1 for v in vocab]}
    n = DEFAULT_NUM_EMBEDDINGS if num_embeddings_per_feature is None \
        else num_embeddings_per_feature
    sizes = [int(n)] * NUM_SPARSE if isinstance(n, int) else [int(x) for x in n]
    if len(sizes) != NUM_SPARSE or min(sizes) < 1:
        raise ValueError(f"num_embeddings_per_feature must be one positive int or "
                         f"{NUM_SPARSE}, got {n}")
    return {"mode": "hash", "num_embeddings": sizes}
