"""Criteo (Kaggle display-ads and 1TB click logs) TSV -> Parquet shards + ``dataset.json``.

The row format and the split rules are :mod:`dlrm_app.data.criteo.format`; the transforms and
encodings :mod:`dlrm_app.data.criteo.encoding`.

Engineering: input is read in blocks of ``block_bytes`` of whole lines; each block is padded
(numpy finds short rows) and parsed by ``pyarrow.csv`` with an explicit schema, and every
transform is vectorized. ``workers=N > 1`` runs that work in N processes (a fork server: no
state of the parent is inherited); with one worker this process runs up to ``threads`` tasks
at once (two where two CPUs are usable; one for gzip input, whose decompression sets the
pace). Every path writes the same rows in the same order through one shard writer, so the bytes are the same for every N and path. Shards are written to
``.staging/stage-*.parquet`` and renamed (or cut) to their final names at the end
(:mod:`~dlrm_app.data.criteo.finalize`), so a failed run leaves nothing finished-looking.
Three paths:

* Bad rows are errors and every input is plain: rows are lines; each worker reads, parses,
  encodes and writes whole shards (:mod:`~dlrm_app.data.criteo.shard_tasks`).
* Bad rows are errors, some input is gzip, ``workers > 1``: the parent decompresses (once) and
  cuts the lines into shards for the workers (same module).
* Otherwise (skipping bad rows, or gzip in one process): one streaming pass
  (:mod:`~dlrm_app.data.criteo.staging`).

Memory does not grow with the input (a 1TB day is streamed). A process that writes whole
shards (one process, or each worker) peaks at about 0.25 GB + 3 x ``block_bytes``, a gzip
parent that only cuts lines at about 0.1 GB + 3 x ``block_bytes``, plus the spilled lines of
at most ``2 * workers`` shards on disk. Streaming: one process about 0.2 GB + 10 x
``block_bytes``; with workers, each about 0.2 GB + 6 x ``block_bytes`` and the parent (up to
``2 * workers`` blocks and their encoded rows in flight) about 0.2 GB + (3 + 4 x workers) x
``block_bytes``. Measured with 32 MB blocks, in total: plain 0.4 GB (one process) / 0.8 GB
(two workers), gzip 0.5 / 0.9 GB. Two threads in one process hold two tasks' blocks: peak
RSS on 1M rows 0.23 -> 0.35 GB hashed, 0.32 -> 0.45-0.48 GB with the default vocabulary. A
shard's row groups are written by a thread of the process that makes them (at most 2 row groups in flight, about 15 MB each at the default 65,536 rows)
while it parses and encodes the next block. Add the line numbers of skipped bad rows (8 bytes
each), and for the default vocabulary: its counting pass (bounded by
``vocabulary_memory_bytes``, see :mod:`~dlrm_app.data.criteo.vocabulary`) and the vocabulary
itself (8 bytes per id with a row): in this process until ``vocabulary.parquet`` is written (by
a thread, during the main pass), and one copy in ``.staging`` that every encoding process maps
(shared page cache), plus each encoding process's bucket index of it for the C lookup (at most
4 bytes per id, see :class:`~dlrm_app.data.criteo.encoding.VocabularyIndex`).

The default vocabulary reads the train split twice (a counting pass, then the main pass), but
with plain inputs and bad rows as errors parses it once: the counting tasks keep the rows they
parsed in ``.staging`` and the main pass reads those (:mod:`~dlrm_app.data.criteo.spill`); a
kaggle vocabulary needs every input's line count first (a gzip input is decompressed once
more to count them). Plain inputs are counted (and indexed) in any case, so that in the
counting pass too each worker reads its own line ranges: only line numbers go to the workers
and per-range id counts come back (merged here).

Resumption: each shard is written to a hidden temp name and renamed when complete, then a
small done-marker records its checksum; a rerun keeps every finished shard and redoes only
the others, and a killed run plus a rerun gives the same bytes as one uninterrupted run.
Finished shards are not re-parsed. ``dataset.json`` is written last.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from dlrm_app.data.criteo.add_day import add_criteo_days
from dlrm_app.data.criteo.encoding import EncodingRequest
from dlrm_app.data.criteo.format import (
    DENSE_NAMES,
    LABEL,
    SPARSE_NAMES,
    SplitRule,
)
from dlrm_app.data.criteo.job import _Job, day_name, run_job
from dlrm_app.data.criteo.parse import check_not_empty
from dlrm_app.data.criteo.staging import STAGING_DIR
from dlrm_app.data.criteo.vocabulary import DEFAULT_VOCABULARY_MEMORY_BYTES
from dlrm_app.data.days import DAYS, locate_days
from dlrm_app.data.schema import (
    DatasetKind,
    DatasetSpec,
    SparseFeature,
    SplitSpec,
)
from dlrm_app.data.tables import table_summary
from dlrm_app.inputs import check_criteo_inputs


def _days(paths: list[Path], fmt: str, days: int | None, input_lines: list[int],
          skipped: Sequence[int], splits: tuple[SplitSpec, ...], sizes: list[int]) -> list[dict]:
    """The ``days`` record: terabyte, one day per input; kaggle, ``days`` runs of consecutive
    lines (``L * d // days`` from the first line of all inputs; one by default)."""
    if fmt == "terabyte":
        line_edges = np.cumsum([0, *input_lines]).tolist()
        names = [day_name(p) for p in paths]
        inputs = [[str(p)] for p in paths]
    else:
        n, total = days or 1, sum(input_lines)
        line_edges = [total * d // n for d in range(n + 1)]
        names = [f"day_{d}" for d in range(n)]
        inputs = [[str(p) for p in paths]] * n
    bad = np.sort(np.asarray(skipped, np.int64))
    dropped = [int(np.searchsorted(bad, x)) for x in line_edges]
    row_edges = [x - b for x, b in zip(line_edges, dropped, strict=True)]
    pieces = locate_days(splits, row_edges)
    return [{"index": d, "name": names[d], "rows": row_edges[d + 1] - row_edges[d],
             "pieces": pieces[d], "inputs": inputs[d],
             "lines": line_edges[d + 1] - line_edges[d],
             "skipped_rows": dropped[d + 1] - dropped[d], "num_embeddings": list(sizes)}
            for d in range(len(names))]


def preprocess_criteo(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    fmt: Literal["kaggle", "terabyte"] = "kaggle",
    num_embeddings_per_feature: int | Sequence[int] | None = None,
    frequency_threshold: int | None = None,
    max_embeddings_per_feature: int | Sequence[int] | None = None,
    like: str | os.PathLike[str] | None = None,
    one_split: Literal["train", "validation", "test"] | None = None,
    rows_per_shard: int = 1_000_000,
    row_group_size: int = 65_536,
    on_bad_row: Literal["error", "skip"] = "error",
    block_bytes: int = 32 << 20,
    workers: int = 1,
    vocabulary_memory_bytes: int = DEFAULT_VOCABULARY_MEMORY_BYTES,
    id_mapping: Literal["vocabulary", "hash", "zch"] | None = None,
    max_bad_row_fraction: float = 0.5,
    threads: int | None = None,
    days: int | None = None,
    add_day: bool = False,
) -> DatasetSpec:
    """Preprocess Criteo TSV files into ``out_dir`` (shards + dataset.json); see the module doc.

    Table sizes (one kind per call):

    * default: a train-split vocabulary, tables sized from the data. Ids seen at least
      ``frequency_threshold`` times in train (default ``DEFAULT_FREQUENCY_THRESHOLD`` = 1) get
      rows, at most ``max_embeddings_per_feature`` rows per table (one int or 26; default
      ``DEFAULT_MAX_EMBEDDINGS_PER_FEATURE`` = 10 M; the most frequent ids keep rows), every
      other id shares row 0. The count of distinct train ids may use
      ``vocabulary_memory_bytes``; past that it stops with an error naming the hashing option.
    * ``num_embeddings_per_feature`` (one int or 26): modulo hashing into that many rows (e.g.
      40,000,000, the reference's for Criteo 1TB).
    * ``id_mapping="zch"``: the raw ids kept (``[0, 2^32)``; features marked ``raw_ids``); the
      model maps them to rows at training time (zero-collision hashing, ``--zch-rows``).
    * ``like``: the encoding (and vocabulary) of an existing dataset, so that its model reads
      this one. With ``one_split`` (``"train"``, ``"validation"`` or ``"test"``), every row
      goes to that split and the others are empty: a held-out file evaluated as a whole.

    ``parameters["tables"]`` summarizes the table sizes and the memory they need to train
    (:func:`dlrm_app.data.tables.table_summary`). Bad rows raise ValueError with file and
    line, or with ``on_bad_row="skip"`` are dropped and counted in
    ``parameters["skipped_rows"]``; inputs of bad rows only, empty or truncated (gzip) inputs
    always raise. ``workers > 1`` runs the parsing, encoding and (plain input) shard writing
    in that many processes; with ``workers=1`` this process runs up to ``threads`` tasks at
    once (None: :func:`~dlrm_app.data.criteo.workers.task_threads`, two where two CPUs are
    usable, one for gzip input). The output is byte-identical for every ``workers`` and
    ``threads``. As with any multiprocessing, a script that passes
    ``workers > 1`` needs the ``if __name__ == "__main__":`` guard.

    Days (:mod:`dlrm_app.data.days`): ``parameters["days"]`` records each day's rows. Terabyte:
    each input is a day; kaggle: the inputs' lines are one day, or with ``days=N`` N days of
    consecutive lines (day ``d``: lines ``[L*d//N, L*(d+1)//N)`` of the ``L``). ``add_day``:
    each input is appended to the existing dataset in ``out_dir`` as a new day
    (:func:`~dlrm_app.data.criteo.add_day.add_criteo_days`; the encoding arguments must be
    left out: the dataset's encoding is used).
    """
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("no input files; pass at least one Criteo TSV (plain or .gz)")
    if add_day:
        given = [flag for flag, value in (
            ("--num-embeddings-per-feature", num_embeddings_per_feature),
            ("--frequency-threshold", frequency_threshold),
            ("--max-embeddings-per-feature", max_embeddings_per_feature),
            ("--like", like), ("--one-split", one_split), ("--id-mapping", id_mapping),
            ("--days", days)) if value is not None]
        if given:
            raise ValueError(f"--add-day appends each input as one day encoded as the dataset "
                             f"in {out_dir} is (its encoding and budget); drop "
                             f"{', '.join(given)}")
        return add_criteo_days(paths, out_dir, on_bad_row=on_bad_row, block_bytes=block_bytes,
                               workers=workers, threads=threads,
                               max_bad_row_fraction=max_bad_row_fraction,
                               vocabulary_memory_bytes=vocabulary_memory_bytes)
    if days is not None and (isinstance(days, bool) or not isinstance(days, int) or days < 1):
        raise ValueError(f"days (--days) must be a positive int, got {days!r}")
    if days is not None and fmt != "kaggle":
        raise ValueError("--days cuts a kaggle input into days; terabyte inputs are one day "
                         "each: drop --days")
    rule = SplitRule(fmt, one_split)
    if one_split is not None and like is None:
        raise ValueError(f"one_split={one_split!r} encodes a held-out file for a model trained "
                         f"on another dataset: pass that dataset as like= (--like DIR)")
    if fmt == "terabyte" and one_split is None and len(paths) < 2:
        raise ValueError("terabyte format needs at least 2 day files (train days + the last "
                         "day for validation/test); pass the day files in order")
    request = EncodingRequest(
        num_embeddings_per_feature=num_embeddings_per_feature,
        frequency_threshold=frequency_threshold,
        max_embeddings_per_feature=max_embeddings_per_feature, like=like,
        vocabulary_memory_bytes=vocabulary_memory_bytes, id_mapping=id_mapping)
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"--on-bad-row must be 'error' or 'skip', got {on_bad_row!r}")
    if not 0.0 <= max_bad_row_fraction <= 1.0:
        raise ValueError(f"--max-bad-row-fraction must be in [0, 1], got {max_bad_row_fraction}")
    if rows_per_shard < 1 or row_group_size < 1 or block_bytes < 1:
        raise ValueError("rows_per_shard, row_group_size and block_bytes must be positive")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    check_criteo_inputs(paths)
    for p in paths:
        check_not_empty(p)
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    (out / "dataset.json").unlink(missing_ok=True)  # a run in progress is not finished
    job = _Job(paths=paths, out=out, rule=rule, request=request, rows_per_shard=rows_per_shard,
               row_group_size=row_group_size, on_bad_row=on_bad_row, block_bytes=block_bytes,
               workers=workers, max_bad_row_fraction=max_bad_row_fraction)
    splits, encoding, input_lines, skipped = run_job(job, threads, created)
    raw = encoding["mode"] == "zch"
    features = tuple(SparseFeature(name=n, num_embeddings=e, multi_hot=False, raw_ids=raw)
                     for n, e in zip(SPARSE_NAMES, encoding["num_embeddings"], strict=True))
    spec = DatasetSpec(
        name=f"criteo-{fmt}",
        kind=DatasetKind.CRITEO,
        dense_features=DENSE_NAMES,
        sparse_features=features,
        label=LABEL,
        label_dtype="float32",
        splits=splits,
        parameters={
            "preprocessor": "dlrm_app.data.criteo",
            "format": fmt,
            "inputs": [str(p) for p in paths],
            "input_lines": input_lines,
            "split_rule": rule.description,
            "one_split": one_split,
            "dense_transform": "missing->0, clamp negatives to 0, log(x+1)",
            "categorical_transform": "hex->int, missing->0, then encoding",
            "encoding": encoding,
            "tables": table_summary(features),
            "rows_per_shard": rows_per_shard,
            "row_group_size": row_group_size,
            "on_bad_row": on_bad_row,
            "skipped_rows": len(skipped),
            DAYS: _days(paths, fmt, days, input_lines, skipped, splits,
                        list(encoding["num_embeddings"])),
        },
        created_by=f"dlrm_app {importlib.metadata.version('recsys-dlrm')}",
    )
    spec.save(out)
    shutil.rmtree(out / STAGING_DIR)
    return spec
