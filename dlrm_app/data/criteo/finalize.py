"""Once the line counts are known: staging shards -> train / validation / test shards.

Where the split starts were known up front (plain inputs: counted; the terabyte validation
starts with the last day; a kaggle vocabulary needs the counts anyway), the staging shards
restart there and every one of them is a final shard, renamed. Where not (gzip: decompressed
once, so the splits are found at the end), a staging shard holding exactly a final shard's rows
is renamed and the rest (kaggle: about ``rows_per_shard + N / 7`` rows) is rewritten from
staging shards, in the workers.
"""

from __future__ import annotations

import bisect
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_app.data import shard_writer
from dlrm_app.data.criteo.format import LABEL, OUTPUT_SCHEMA
from dlrm_app.data.criteo.staging import STAGING_DIR, stage_file
from dlrm_app.data.criteo.workers import Runner
from dlrm_app.data.schema import SPLIT_NAMES, ShardFile, SplitSpec, sha256_file
from dlrm_app.data.shard_writer import ShardWriter, read_marker


def rewrite_shard(out: Path, file: str, pieces: list[tuple[str, int, int]],
                  row_group_size: int, fingerprint: str) -> tuple[str, int]:
    """Worker task: write final shard ``file`` from row ranges (stage file, first row, rows) of
    staging shards, one row group at a time; returns its checksum and label sum."""
    w = ShardWriter(out, file, OUTPUT_SCHEMA, row_group_size, LABEL, background=True)
    try:
        for stage, first, n in pieces:
            with pq.ParquetFile(out / STAGING_DIR / stage) as pf:
                row = 0
                for g in range(pf.num_row_groups):
                    size = pf.metadata.row_group(g).num_rows
                    lo, hi = max(first, row), min(first + n, row + size)
                    if lo < hi:
                        part = pf.read_row_group(g).slice(lo - row, hi - lo)
                        w.add(pa.Table.from_arrays(part.columns, schema=OUTPUT_SCHEMA))
                    row += size
        w.close()
    finally:
        w.abort()
    sha = shard_writer.finish_shard(out, file, w.rows, fingerprint, {"label_sum": w.label_sum})
    return sha, w.label_sum


def finalize(run: Runner, out: Path, stage: list[dict], edges: list[int],
             rows_per_shard: int, row_group_size: int, fingerprint: str) -> tuple[SplitSpec, ...]:
    """Cut rows [edges[s], edges[s + 1]) into split s's shards. A shard with exactly the rows of
    a staging shard is that file renamed (every shard where the split starts were known up
    front, else every train shard but the last); the rest are rewritten from staging shards,
    in the workers."""
    staging = out / STAGING_DIR
    if sum(m["rows"] for m in stage) != edges[-1]:
        raise RuntimeError(f"{staging}: staged rows do not add up to the input's; delete "
                           f"{out} and rerun")
    by_rows = {(m["first_row"], m["rows"]): k for k, m in enumerate(stage)}
    firsts = [m["first_row"] for m in stage]
    plan: list[tuple[str, str, int, int]] = []  # (split, file, first row, rows)
    for split, a, b in zip(SPLIT_NAMES, edges[:-1], edges[1:], strict=True):
        plan += [(split, f"{split}-{j:05d}.parquet", s, min(s + rows_per_shard, b) - s)
                 for j, s in enumerate(range(a, b, rows_per_shard))]
    results: dict[str, tuple[str, int]] = {}  # file -> (sha256, label sum)
    tasks = []
    for _, file, first, n in plan:
        k = by_rows.get((first, n))
        if k is not None:
            if stage[k].get("renamed_to") != file:  # recorded first: a kill may fall between
                stage[k]["renamed_to"] = file
                marker = staging / f".{stage_file(k)}.done"
                marker.write_text(json.dumps({**stage[k], "config": fingerprint}))
            if (staging / stage_file(k)).exists():
                os.replace(staging / stage_file(k), out / file)
            results[file] = (stage[k]["sha256"], stage[k]["label_sum"])
            continue
        done = read_marker(out, file, fingerprint)
        if done is not None and (out / file).exists() and \
                sha256_file(out / file) == done["sha256"]:
            results[file] = (done["sha256"], done["label_sum"])
            continue
        pieces = []
        k = bisect.bisect_right(firsts, first) - 1
        while n:
            offset = first - stage[k]["first_row"]
            take = min(n, stage[k]["rows"] - offset)
            pieces.append((stage_file(k), offset, take))
            first, n, k = first + take, n - take, k + 1
        tasks.append((out, file, pieces, row_group_size, fingerprint))
    for task, result in zip(tasks, run.map(rewrite_shard, tasks), strict=True):
        results[task[1]] = result
    splits = []
    for split, a, b in zip(SPLIT_NAMES, edges[:-1], edges[1:], strict=True):
        shards = tuple(ShardFile(file=f, rows=n, sha256=results[f][0],
                                 row_group_size=row_group_size)
                       for s, f, _, n in plan if s == split)
        label_sum = sum(results[f][1] for s, f, _, _ in plan if s == split)
        splits.append(SplitSpec(name=split, label_rate=label_sum / (b - a) if b > a else 0.0,
                                shards=shards))
    return tuple(splits)
