"""Appending a day to a preprocessed Criteo dataset, without rewriting the days it has.

``preprocess criteo day_24.gz --out DIR --add-day`` (:func:`add_criteo_days`) encodes each
input as one new day, the way the dataset encodes its rows:

* ``hash``: the same modulo; ``zch``: the raw ids, as ever;
* ``vocabulary``: the ids the vocabulary has keep their rows. An id it has no row for (first
  seen in the new day, or seen only in validation/test days or too rarely before) that the new
  day has at least the dataset's ``frequency_threshold`` times gets the table's next row
  while the table has fewer rows than its budget (``max_embeddings_per_feature``); if more
  qualify than fit, the most frequent do (ties: the smaller raw id), and the kept ones get
  their rows in raw-id order. Every other id reads the out-of-vocabulary row 0. The tables grow
  (``num_embeddings`` in dataset.json and in the day's entry); the vocabulary with the new
  rows is written as ``vocabulary-day-<index>.parquet`` (columns ``feature, raw_id, row``),
  named by ``encoding.grown_vocabulary``; ``vocabulary.parquet`` (the first preprocessing's)
  stays as it was.

The day's rows go to shards of their own, ``day-<index>-00000.parquet``, ..., listed in its
entry of ``parameters.days`` and in no split (:mod:`dlrm_app.data.days`); no existing file
changes but ``dataset.json``. Atomic: everything is written under a hidden
``.add-day-<index>`` folder (and hidden temp names), moved to its final names, and
``dataset.json`` is replaced last; an error on the way removes what this call wrote, so the
dataset stays as it was. A killed append leaves files no ``dataset.json`` lists, which the
next append of that day removes first.

Before anything is written, the new file's first row must be a row of the dataset's schema
(label, 13 integer and 26 hex categorical fields), and the dataset a Criteo one that records
its days; else ValueError says what differs and what to do.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq

from dlrm_app.data.criteo.encoding import EncodingRequest
from dlrm_app.data.criteo.format import (
    COLUMNS,
    DENSE_NAMES,
    LABEL,
    NUM_DENSE,
    NUM_FIELDS,
    OUTPUT_SCHEMA,
    SPARSE_NAMES,
    SplitRule,
    value_problem,
)
from dlrm_app.data.criteo.job import _Job, day_name, run_job
from dlrm_app.data.criteo.lines import line_counts
from dlrm_app.data.criteo.parse import check_not_empty
from dlrm_app.data.criteo.vocabulary import (
    DEFAULT_VOCABULARY_MEMORY_BYTES,
    GROWN_VOCABULARY,
    VOCABULARY_FILE,
    count_train_ids,
    grow,
    grown_vocabulary_file,
    load_vocabulary_rows,
    save_grown_vocabulary,
)
from dlrm_app.data.criteo.workers import runner, task_threads
from dlrm_app.data.days import DAYS, read_days, shard_files
from dlrm_app.data.integrity import verify_file
from dlrm_app.data.schema import DatasetKind, DatasetSpec
from dlrm_app.data.tables import table_summary
from dlrm_app.inputs import check_criteo_inputs


def day_shard_file(day: int, k: int) -> str:
    return f"day-{day:05d}-{k:05d}.parquet"


def _work_dir(out: Path, day: int) -> Path:
    return out / f".add-day-{day:05d}"


def _first_line(path: Path) -> str:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return f.readline(1 << 20).decode("utf-8", "replace").rstrip("\r\n")


def row_schema_problem(text: str) -> str | None:
    """Why a raw line is not a labeled Criteo row (label, 13 integers, 26 hex categoricals;
    trailing empty fields may be stripped), or None."""
    fields = text.split("\t")
    if len(fields) > NUM_FIELDS:
        return f"{len(fields)} tab-separated fields, more than the dataset's {NUM_FIELDS}"
    if fields[0] not in ("0", "1"):
        unlabeled = " (39 fields: an unlabeled file, like Criteo's test files?)" \
            if len(fields) == NUM_FIELDS - 1 else ""
        return f"first field {fields[0][:20]!r} is not a 0/1 label{unlabeled}"
    for j, value in enumerate(fields[1:]):
        if value and (problem := value_problem(j, value)):
            kind = "integer" if j < NUM_DENSE else "categorical"
            return f"{kind} field {COLUMNS[j + 1]} = {value[:20]!r} {problem}"
    return None


def check_day_schema(path: Path, out: Path, spec: DatasetSpec) -> None:
    """Refuse a new day whose rows, or a dataset whose columns, are not the Criteo schema."""
    names = (spec.label, spec.dense_features, tuple(f.name for f in spec.sparse_features))
    if spec.kind != DatasetKind.CRITEO or names != (LABEL, DENSE_NAMES, SPARSE_NAMES):
        raise ValueError(f"{out}: a {spec.kind.value} dataset ('{spec.name}'), not one made "
                         f"by preprocess criteo: days of Criteo files are added to Criteo "
                         f"datasets only; preprocess {path} into its own --out")
    shard = next(iter(shard_files(spec, read_days(spec)).values()), None)
    if shard is not None and not pq.read_schema(out / shard.file).equals(OUTPUT_SCHEMA):
        raise ValueError(f"{out / shard.file}: its columns are not the ones this version "
                         f"writes ({OUTPUT_SCHEMA.names[:3]} ...): preprocess all days again "
                         f"into a fresh --out")
    problem = row_schema_problem(_first_line(path))
    if problem is not None:
        raise ValueError(
            f"{path}:1: {problem}: its rows do not match the dataset in {out} (label, "
            f"{len(DENSE_NAMES)} integer and {len(SPARSE_NAMES)} hex categorical fields, "
            f"tab-separated). Add a labeled day file of the same Criteo release, or preprocess "
            f"this file into its own --out")


def _remove_leftovers(out: Path, day: int) -> None:
    """Files of an interrupted append of ``day`` (no dataset.json lists them)."""
    shutil.rmtree(_work_dir(out, day), ignore_errors=True)
    for f in out.glob(f"day-{day:05d}-*.parquet"):
        f.unlink()
    (out / grown_vocabulary_file(day)).unlink(missing_ok=True)


def add_criteo_days(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    on_bad_row: str = "error",
    block_bytes: int = 32 << 20,
    workers: int = 1,
    threads: int | None = None,
    max_bad_row_fraction: float = 0.5,
    vocabulary_memory_bytes: int = DEFAULT_VOCABULARY_MEMORY_BYTES,
) -> DatasetSpec:
    """Append each input to the dataset in ``out_dir`` as one new day (see the module doc);
    returns the dataset's new spec. Shards keep the dataset's ``rows_per_shard`` and
    ``row_group_size``."""
    out = Path(out_dir)
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("--add-day: no input files; pass the new day's Criteo TSV")
    spec = DatasetSpec.load(out)  # a missing dataset says so, with the fix
    if not spec.day_records and spec.kind == DatasetKind.CRITEO:
        raise ValueError(f"{out}: its dataset.json records no days (preprocessed before days "
                         f"were recorded); preprocess its inputs again, then add days")
    check_criteo_inputs(paths)
    names = {d.name: d.index for d in read_days(spec)} if spec.kind == DatasetKind.CRITEO \
        else {}
    for path in paths:
        check_not_empty(path)
        check_day_schema(path, out, spec)
        if day_name(path) in names:  # most likely the same day twice
            where = "among the inputs twice" if names[day_name(path)] < 0 else \
                f"in {out} already (day {names[day_name(path)]})"
            raise ValueError(
                f"{path}: a day named '{day_name(path)}' is {where}; a day is added once. If "
                f"this file is another day, give it its own name")
        names[day_name(path)] = -1
    for path in paths:
        spec = _add_one(path, out, spec, on_bad_row=on_bad_row, block_bytes=block_bytes,
                        workers=workers, threads=threads,
                        max_bad_row_fraction=max_bad_row_fraction,
                        vocabulary_memory_bytes=vocabulary_memory_bytes)
    return spec


def _add_one(path: Path, out: Path, spec: DatasetSpec, *, on_bad_row: str, block_bytes: int,
             workers: int, threads: int | None, max_bad_row_fraction: float,
             vocabulary_memory_bytes: int) -> DatasetSpec:
    params = dict(spec.parameters)
    days = list(params[DAYS])
    index = len(days)
    _remove_leftovers(out, index)
    encoding = dict(params["encoding"])
    rule = SplitRule(params["format"], "train")  # every row of the day, in one run
    fixed: tuple[dict, list | None, list | None] = (encoding, None, None)
    grown = None
    if encoding["mode"] == "vocabulary":
        old = encoding.get(GROWN_VOCABULARY)
        verify_file(out / VOCABULARY_FILE, encoding.get("vocabulary_sha256"))
        if old is not None:
            verify_file(out / old["file"], old["sha256"])
        ids, rows = load_vocabulary_rows(out, None if old is None else old["file"])
        plain = path.suffix != ".gz"
        with runner(workers, task_threads([path], workers) if threads is None
                    else threads) as run:
            counts, indexes = line_counts(run, [path], [plain], block_bytes)
            day_ids, day_counts, _, _ = count_train_ids(
                run, [path], rule, counts, indexes, block_bytes, on_bad_row,
                vocabulary_memory_bytes)
        grown = grow(ids, rows, encoding["num_embeddings"], day_ids, day_counts,
                     encoding["frequency_threshold"], encoding["max_embeddings_per_feature"])
        encoding["num_embeddings"] = grown.num_embeddings
        fixed = (encoding, grown.ids, grown.rows)
    work = _work_dir(out, index)
    work.mkdir()
    job = _Job(paths=[path], out=work, rule=rule, request=EncodingRequest(),
               rows_per_shard=params["rows_per_shard"], row_group_size=params["row_group_size"],
               on_bad_row=on_bad_row, block_bytes=block_bytes, workers=workers,
               max_bad_row_fraction=max_bad_row_fraction, fixed=fixed)
    written: list[Path] = []
    try:
        splits, _, input_lines, skipped = run_job(job, threads, created=True)
        shards = []
        for k, shard in enumerate(splits[0].shards):
            name = day_shard_file(index, k)
            os.replace(work / shard.file, out / name)
            written.append(out / name)
            shards.append(dataclasses.replace(shard, file=name))
        if grown is not None:
            file = grown_vocabulary_file(index)
            written.append(out / file)
            encoding[GROWN_VOCABULARY] = {
                "file": file, "sha256": save_grown_vocabulary(out, file, grown.ids, grown.rows),
                "day": index}
        n_rows = sum(s.rows for s in shards)
        record = {"index": index, "name": day_name(path), "rows": n_rows,
                  "pieces": [{"file": s.file, "first_row": 0, "rows": s.rows} for s in shards],
                  "shards": [dataclasses.asdict(s) for s in shards], "inputs": [str(path)],
                  "lines": input_lines[0], "skipped_rows": len(skipped),
                  "num_embeddings": list(encoding["num_embeddings"])}
        if grown is not None:
            record["new_ids_with_rows"] = grown.added
            record["new_ids_out_of_budget"] = grown.refused
        features = tuple(dataclasses.replace(f, num_embeddings=n) for f, n in
                         zip(spec.sparse_features, encoding["num_embeddings"], strict=True))
        params.update(encoding=encoding, tables=table_summary(features),
                      **{DAYS: [*days, record]})
        new = dataclasses.replace(spec, sparse_features=features, parameters=params)
        new.save(out)  # the commit: until here the old dataset.json lists none of it
    except BaseException:
        for f in written:
            f.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    old = (spec.encoding or {}).get(GROWN_VOCABULARY)
    if old is not None:  # superseded (the shards hold rows, not raw ids)
        (out / old["file"]).unlink(missing_ok=True)
    return new
