"""The preprocessing job shared by a new dataset and an added day: one pass that parses,
encodes and writes the inputs' rows (:func:`run_job`), and a day's name."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from dlrm_app.data.criteo.encoding import EncodeSpec, EncodingRequest, choose_encoding, encoder
from dlrm_app.data.criteo.finalize import finalize
from dlrm_app.data.criteo.format import (
    NUM_DENSE,
    NUM_SPARSE,
    SplitRule,
)
from dlrm_app.data.criteo.lines import LineIndex, blocks, line_counts, prefetch
from dlrm_app.data.criteo.parse import no_valid_rows_error
from dlrm_app.data.criteo.shard_tasks import Spiller, run_shard_tasks, stage_shards
from dlrm_app.data.criteo.spill import SpillPlan, remove_spills, should_spill
from dlrm_app.data.criteo.staging import STAGING_DIR, stage
from dlrm_app.data.criteo.vocabulary import save_vocabulary
from dlrm_app.data.criteo.workers import Runner, runner, task_threads
from dlrm_app.data.schema import (
    SplitSpec,
)


def many_shards(paths: list[Path], rows_per_shard: int, workers: int) -> bool:
    """Whether the inputs likely hold 2 shards per worker (gzip Criteo holds about 10 rows per
    KB; a plain file fewer, so this errs high): only then do whole-shard tasks beat streaming
    (a shard's worker starts when its last line is read)."""
    return sum(p.stat().st_size for p in paths) // 1024 * 8 >= 2 * workers * rows_per_shard


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Job:
    """preprocess_criteo's checked arguments."""

    paths: list[Path]
    out: Path
    rule: SplitRule
    request: EncodingRequest
    rows_per_shard: int
    row_group_size: int
    on_bad_row: str
    block_bytes: int
    workers: int
    max_bad_row_fraction: float = 0.5
    fixed: tuple[dict, list | None, list | None] | None = None
    """An added day's encoding: the record, and a vocabulary's ids and rows (no counting
    pass; see :mod:`~dlrm_app.data.criteo.add_day`)."""


def _main_pass(run: Runner, job: _Job, spec: EncodeSpec, counts: list[int | None],
               indexes: list[LineIndex | None], fingerprint: str,
               spill: SpillPlan | None) -> tuple[list, list, list]:
    """Every row parsed (or read from the counting pass's ``spill``), encoded and written to
    a staging shard: the shards' markers, the input line counts and the skipped lines."""
    paths, out, rule = job.paths, job.out, job.rule
    shard_args = (spec, job.block_bytes, job.row_group_size, fingerprint)
    if all(p.suffix != ".gz" for p in paths) and job.on_bad_row == "error":
        # the caller counted and indexed every input in this (direct) case: see its `which`
        known_counts = [n for n in counts if n is not None]
        known_indexes = [x for x in indexes if x is not None]
        assert len(known_counts) == len(known_indexes) == len(paths)
        staged = stage_shards(run, paths, out, rule, known_counts, known_indexes,
                              job.rows_per_shard, *shard_args, spill=spill)
        return staged, counts, []
    if job.on_bad_row == "error" and job.workers > 1 and \
            many_shards(paths, job.rows_per_shard, job.workers):
        spiller = Spiller(paths, out, rule.starts(counts), job.rows_per_shard, fingerprint)
        with contextlib.closing(prefetch(blocks(paths, job.block_bytes))) as read:
            staged = run_shard_tasks(run, out, spiller.tasks(read), spiller.shards,
                                     *shard_args, total=None)
        return staged, spiller.input_lines, []
    stream = stage(run, paths, out, spec, rule.starts(counts), job.rows_per_shard,
                   job.row_group_size, job.on_bad_row, job.block_bytes, fingerprint,
                   None if None in counts else sum(counts))
    return stream.shards, stream.input_lines, stream.skipped


def _preprocess(run: Runner, job: _Job) -> tuple[tuple[SplitSpec, ...], dict, list[int], list]:
    """preprocess_criteo's work, with its runner: the splits, the encoding record, the input
    line counts and the skipped lines."""
    paths, out, rule = job.paths, job.out, job.rule
    # Line counts up front where cheap (plain files: a newline count over byte ranges, in
    # the workers) or needed anyway (a kaggle vocabulary); a gzip input is decompressed
    # once. With bad rows as errors, rows are lines and the workers write whole shards:
    # plain inputs are read by the workers, gzip is cut into shards here (see the doc).
    plain = [p.suffix != ".gz" for p in paths]
    direct = all(plain) and job.on_bad_row == "error"  # see _main_pass
    if direct:
        which = [True] * len(paths)
    elif rule.one_split is not None:
        which = [False] * len(paths)  # no split starts to find
    elif rule.fmt == "terabyte":
        which = [False] * (len(paths) - 1) + plain[-1:]
    else:
        which = [all(plain) or job.request.mode == "vocabulary"] * len(paths)
    if job.request.mode == "vocabulary" and all(plain) and job.fixed is None:
        which = [True] * len(paths)  # the workers read their own train lines to count ids
    counts, indexes = line_counts(run, paths, which, job.block_bytes)
    # parse once: the vocabulary's counting pass keeps the train rows it parsed for the main
    # pass (where the workers read line ranges, and the disk has room; see spill.py)
    spill_to = None
    if direct and job.request.mode == "vocabulary" and job.fixed is None:
        spill_to = out / STAGING_DIR
        spill_to.mkdir(exist_ok=True)
        remove_spills(spill_to)  # of a killed run
        train = sum(min(t, n) for t, n in zip(rule.train_lines(counts), counts, strict=True))
        if not should_spill(spill_to, int(train)):
            spill_to = None
    rows = None
    if job.fixed is not None:
        encoding, vocab, rows = dict(job.fixed[0]), job.fixed[1], job.fixed[2]
        spill = None
    else:
        encoding, vocab, spill = choose_encoding(run, paths, out, rule, counts, indexes,
                                                 job.request, job.block_bytes, job.on_bad_row,
                                                 spill_to)
    # vocabulary.parquet is written by a thread (GIL released) while the rows are encoded
    with concurrent.futures.ThreadPoolExecutor(1) as saver:
        saved = None if vocab is None or job.fixed is not None else \
            saver.submit(save_vocabulary, out, vocab)
        spec = EncodeSpec.of(encoding, out, out / STAGING_DIR, vocab, rows)
        del vocab  # the encoders map it from the staging copy
        # block_bytes and workers are left out: they do not change a byte of the output (a
        # new vocabulary's checksum is not known yet: the digest of its ids stands in)
        config = {"inputs": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths],
                  "fmt": rule.fmt, "one_split": rule.one_split, "encoding": encoding,
                  "vocabulary": spec.vocabulary_digest, "rows_per_shard": job.rows_per_shard,
                  "row_group_size": job.row_group_size, "on_bad_row": job.on_bad_row}
        fingerprint = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
        staged, input_lines, skipped = _main_pass(run, job, spec, counts, indexes, fingerprint,
                                                  spill)
    if saved is not None:
        encoding["vocabulary_sha256"] = saved.result()
    for p, n, m in zip(paths, counts, input_lines, strict=True):
        if n is not None and n != m:
            raise ValueError(f"{p}: {n} lines when counted, {m} when read; the file "
                             f"changed during the run, rerun when it is complete")
    if len(skipped) == sum(input_lines):
        raise no_valid_rows_error(paths, rule.fmt, sum(input_lines))
    if len(skipped) > job.max_bad_row_fraction * sum(input_lines):
        total = sum(input_lines)
        raise ValueError(
            f"{len(skipped):,} of the {total:,} rows ({len(skipped) / total:.0%}) are bad rows, "
            f"more than --max-bad-row-fraction {job.max_bad_row_fraction} allows (e.g. "
            f"{_first_skipped(paths, input_lines, skipped)}): check that these are Criteo "
            f"{rule.fmt} files (label, {NUM_DENSE} integer and {NUM_SPARSE} hex fields, "
            f"tab-separated); to keep the good rows anyway, raise --max-bad-row-fraction")
    edges = rule.row_edges(input_lines, skipped)
    splits = finalize(run, out, staged, edges, job.rows_per_shard, job.row_group_size,
                      fingerprint)
    return splits, encoding, input_lines, skipped


def _first_skipped(paths: list[Path], input_lines: list[int], skipped: Sequence[int]) -> str:
    """``file:line`` of the first bad row (``skipped`` holds global line numbers)."""
    first, start = int(min(skipped)), 0
    for path, lines in zip(paths, input_lines, strict=True):
        if first < start + lines:
            return f"{path}:{first - start + 1}"
        start += lines
    return str(paths[-1])


def run_job(job: _Job, threads: int | None, created: bool
            ) -> tuple[tuple[SplitSpec, ...], dict, list[int], list]:
    """Run a checked job into ``job.out``: the splits, the encoding record, the input line
    counts and the skipped lines (global, 0-based). Bad input (ValueError) removes the
    staging, and ``job.out`` if this call ``created`` it."""
    out = job.out
    try:
        try:
            with runner(job.workers, task_threads(job.paths, job.workers) if threads is None
                        else threads) as run:  # its threads have ended when it exits
                return _preprocess(run, job)
        finally:
            encoder.cache_clear()  # this process's vocabulary, if it encoded rows itself
    except ValueError:
        # bad input: nothing worth resuming; leave no half-made output behind (an interrupted
        # run keeps its staging, which a rerun with the same arguments picks up)
        shutil.rmtree(out / STAGING_DIR, ignore_errors=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:  # after the workers stopped: spilled lines of shards not written (after an
        # error), and the rows the counting pass parsed
        for spilled in (out / STAGING_DIR).glob("*.tsv"):
            spilled.unlink()
        if (out / STAGING_DIR).is_dir():
            remove_spills(out / STAGING_DIR)


def day_name(path: Path) -> str:
    """A day's name: its input file's name without ``.gz`` (``day_3.gz`` -> ``day_3``)."""
    return path.name[:-3] if path.name.endswith(".gz") else path.name
