"""Criteo (Kaggle display-ads and 1TB click logs) TSV -> Parquet shards + ``dataset.json``.

The row format and the split rules are :mod:`dlrm_app.data.criteo.format`; the transforms and
encodings :mod:`dlrm_app.data.criteo.encoding`.

Engineering: input is read in blocks of ``block_bytes`` of whole lines; each block is padded
(numpy finds short rows) and parsed by ``pyarrow.csv`` with an explicit schema, and every
transform is vectorized. ``workers=N > 1`` runs that work in N processes (a fork server: no
state of the parent is inherited). Every path writes the same rows in the same order through
one shard writer, so the bytes are the same for every N and path. Shards are written to
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
(two workers), gzip 0.5 / 0.9 GB. Add the vocabulary counts (one entry per distinct raw id)
and the line numbers of skipped bad rows (8 bytes each).

Resumption: each shard is written to a hidden temp name and renamed when complete, then a
small done-marker records its checksum; a rerun keeps every finished shard and redoes only
the others, and a killed run plus a rerun gives the same bytes as one uninterrupted run.
Finished shards are not re-parsed. ``dataset.json`` is written last.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from dlrm_app.data.criteo.encoding import EncodeSpec, choose_encoding, encoder
from dlrm_app.data.criteo.finalize import finalize
from dlrm_app.data.criteo.format import DENSE_NAMES, LABEL, SPARSE_NAMES, SplitRule
from dlrm_app.data.criteo.lines import blocks, line_counts, prefetch
from dlrm_app.data.criteo.parse import check_not_empty
from dlrm_app.data.criteo.shard_tasks import Spiller, run_shard_tasks, stage_shards
from dlrm_app.data.criteo.staging import STAGING_DIR, stage
from dlrm_app.data.criteo.workers import Runner, runner
from dlrm_app.data.schema import (
    DatasetKind,
    DatasetSpec,
    SparseFeature,
    SplitSpec,
)


def many_shards(paths: list[Path], rows_per_shard: int, workers: int) -> bool:
    """Whether the inputs likely hold 2 shards per worker (gzip Criteo holds about 10 rows per
    KB; a plain file fewer, so this errs high): only then do whole-shard tasks beat streaming
    (a shard's worker starts when its last line is read)."""
    return sum(p.stat().st_size for p in paths) // 1024 * 8 >= 2 * workers * rows_per_shard


def _preprocess(run: Runner, paths: list[Path], out: Path, rule: SplitRule,
                num_embeddings_per_feature: int | Sequence[int] | None,
                frequency_threshold: int | None, rows_per_shard: int, row_group_size: int,
                on_bad_row: str, like: str | os.PathLike[str] | None, block_bytes: int,
                workers: int) -> tuple[tuple[SplitSpec, ...], list[int], dict, list[int], list]:
    """preprocess_criteo's work, with its runner: the splits, table sizes, encoding record,
    input line counts and skipped lines."""
    # Line counts up front where cheap (plain files: a newline count over byte ranges, in
    # the workers) or needed anyway (a kaggle vocabulary); a gzip input is decompressed
    # once. With bad rows as errors, rows are lines and the workers write whole shards:
    # plain inputs are read by the workers, gzip is cut into shards here (see the doc).
    plain = [p.suffix != ".gz" for p in paths]
    direct = all(plain) and on_bad_row == "error"
    spill = not direct and on_bad_row == "error" and workers > 1 and \
        many_shards(paths, rows_per_shard, workers)
    if direct:
        which = [True] * len(paths)
    elif rule.fmt == "terabyte":
        which = [False] * (len(paths) - 1) + plain[-1:]
    else:
        which = [all(plain) or frequency_threshold is not None] * len(paths)
    counts, indexes = line_counts(run, paths, which, block_bytes)
    encoding = choose_encoding(run, paths, out, rule, counts, num_embeddings_per_feature,
                               frequency_threshold, like, block_bytes, on_bad_row)
    num_embeddings = list(encoding["num_embeddings"])
    spec = EncodeSpec.of(encoding, out)
    # block_bytes and workers are left out: they do not change a byte of the output
    config = {"inputs": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths],
              "fmt": rule.fmt, "encoding": encoding, "rows_per_shard": rows_per_shard,
              "row_group_size": row_group_size, "on_bad_row": on_bad_row}
    fingerprint = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    shard_args = (spec, block_bytes, row_group_size, fingerprint)
    if direct:
        staged = stage_shards(run, paths, out, rule, counts, indexes, rows_per_shard,
                              *shard_args)
        input_lines, skipped = counts, []
    elif spill:
        spiller = Spiller(paths, out, rule.starts(counts), rows_per_shard, fingerprint)
        with contextlib.closing(prefetch(blocks(paths, block_bytes))) as read:
            staged = run_shard_tasks(run, out, spiller.tasks(read), spiller.shards,
                                     *shard_args, total=None)
        input_lines, skipped = spiller.input_lines, []
    else:
        stream = stage(run, paths, out, spec, rule.starts(counts), rows_per_shard,
                       row_group_size, on_bad_row, block_bytes, fingerprint,
                       None if None in counts else sum(counts))
        staged, input_lines, skipped = stream.shards, stream.input_lines, stream.skipped
    for p, n, m in zip(paths, counts, input_lines, strict=True):
        if n is not None and n != m:
            raise ValueError(f"{p}: {n} lines when counted, {m} when read; the file "
                             f"changed during the run, rerun when it is complete")
    edges = rule.row_edges(input_lines, skipped)
    splits = finalize(run, out, staged, edges, rows_per_shard, row_group_size, fingerprint)
    return splits, num_embeddings, encoding, input_lines, skipped


def preprocess_criteo(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    fmt: Literal["kaggle", "terabyte"] = "kaggle",
    num_embeddings_per_feature: int | Sequence[int] | None = None,
    frequency_threshold: int | None = None,
    rows_per_shard: int = 1_000_000,
    row_group_size: int = 65_536,
    on_bad_row: Literal["error", "skip"] = "error",
    like: str | os.PathLike[str] | None = None,
    block_bytes: int = 32 << 20,
    workers: int = 1,
) -> DatasetSpec:
    """Preprocess Criteo TSV files into ``out_dir`` (shards + dataset.json); see the module doc.

    Encoding: modulo hashing into ``num_embeddings_per_feature`` (one int or 26; default
    40,000,000) or, with ``frequency_threshold=K``, a train-split vocabulary; ``like`` reuses
    an existing dataset's encoding instead (its vocabulary is copied). Bad rows raise
    ValueError with file and line, or with ``on_bad_row="skip"`` are dropped and counted in
    ``parameters["skipped_rows"]``. Empty or truncated (gzip) inputs always raise.
    ``workers > 1`` runs the parsing, encoding and (plain input) shard writing in that many
    processes; the output is byte-identical for every ``workers``. As with any
    multiprocessing, a script that passes ``workers > 1`` needs the
    ``if __name__ == "__main__":`` guard.
    """
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("no input files; pass at least one Criteo TSV (plain or .gz)")
    rule = SplitRule(fmt)
    if fmt == "terabyte" and len(paths) < 2:
        raise ValueError("terabyte format needs at least 2 day files (train days + the last "
                         "day for validation/test); pass the day files in order")
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if rows_per_shard < 1 or row_group_size < 1 or block_bytes < 1:
        raise ValueError("rows_per_shard, row_group_size and block_bytes must be positive")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    for p in paths:
        if not p.is_file():
            raise ValueError(f"{p}: input file not found")
        check_not_empty(p)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dataset.json").unlink(missing_ok=True)  # a run in progress is not finished
    try:
        with runner(workers) as run:
            try:
                splits, num_embeddings, encoding, input_lines, skipped = _preprocess(
                    run, paths, out, rule, num_embeddings_per_feature, frequency_threshold,
                    rows_per_shard, row_group_size, on_bad_row, like, block_bytes, workers)
            finally:
                encoder.cache_clear()  # this process's vocabulary, if it encoded rows itself
    finally:  # after the workers stopped: spilled lines of shards not written (after an error)
        for spilled in (out / STAGING_DIR).glob("*.tsv"):
            spilled.unlink()
    spec = DatasetSpec(
        name=f"criteo-{fmt}",
        kind=DatasetKind.CRITEO,
        dense_features=DENSE_NAMES,
        sparse_features=tuple(SparseFeature(name=n, num_embeddings=e, multi_hot=False)
                              for n, e in zip(SPARSE_NAMES, num_embeddings, strict=True)),
        label=LABEL,
        label_dtype="float32",
        splits=splits,
        parameters={
            "preprocessor": "dlrm_app.data.criteo",
            "format": fmt,
            "inputs": [str(p) for p in paths],
            "input_lines": input_lines,
            "split_rule": rule.description,
            "dense_transform": "missing->0, clamp negatives to 0, log(x+1)",
            "categorical_transform": "hex->int, missing->0, then encoding",
            "encoding": encoding,
            "rows_per_shard": rows_per_shard,
            "row_group_size": row_group_size,
            "on_bad_row": on_bad_row,
            "skipped_rows": len(skipped),
        },
        created_by=f"dlrm_app {importlib.metadata.version('recsys-dlrm')}",
    )
    spec.save(out)
    shutil.rmtree(out / STAGING_DIR)
    return spec
