"""Criteo-shaped synthetic data with a known best achievable AUC.

``generate`` writes Parquet shards in the layout documented in ``dlrm_app.data.schema`` plus a
``dataset.json``. Each split's rows are produced in chunks of ``GENERATION_CHUNK`` rows and
written as shards of ``rows_per_shard`` rows in row groups of ``row_group_size`` rows (the last
of each shard may be shorter), so memory is bounded by

    O((GENERATION_CHUNK + row_group_size) * (num_dense + sum(pooling_factors)) * ~48 bytes)
                                                  for a chunk and the row group being filled
  + 9 bytes per row of the largest split          for the exact AUC

(the second term keeps each split's teacher probabilities and labels to compute the AUC exactly;
1e8 rows per split need ~0.9 GB).

Ids: per feature, an id's popularity rank follows a bounded Zipf-like power law (continuous
inverse CDF, O(1) memory for any cardinality); ranks are scattered over ``[0, cardinality)`` by a
fixed affine bijection so that popular ids are not simply the small ones.

Labels come from a hidden "teacher": each (feature, id) has a fixed pseudo-random embedding in
``TEACHER_DIM`` dimensions computed by hashing (no tables, so any cardinality is free); bags are
mean-pooled and summed over features into ``z``; the dense features go through a random linear
map into ``h``; the logit is ``z.h + z.u + h.v + bias`` (a DLRM-like dot interaction plus linear
terms), ``p = sigmoid(logit / temperature)`` and ``label ~ Bernoulli(p)``. The teacher's AUC on
each split, computed exactly from ``p`` and the labels, is recorded in ``parameters.teacher_auc``
as the best AUC any model can expect.

Days (``days > 1``): the rows are consecutive days, all but the last train and the last day's
halves validation and test, and from day to day the data drifts by ``drift``:

* new ids arrive: each popularity rank ``r`` of a feature has a fixed hash ``h(r)`` in
  ``[0, 1)``; on day ``d`` the ranks with ``d * drift + h(r) >= 1`` (a share ``d * drift`` of
  them, more every day, and in expectation that share of the draws) take the id of a rank at
  the tail of the popularity law, which earlier days almost never drew; popularity moves with
  them (the old id of a renewed rank is no longer drawn);
* the teacher moves: day ``d``'s dense map and linear terms are day ``d - 1``'s plus a step of
  norm ``drift`` times the first day's norm, in a random direction drawn from
  ``(seed, 3, d)``; each day's weights and teacher AUC are recorded in ``parameters.days``.

Chunk ``c`` of day ``d`` draws from ``(seed, 4, d, c)``: a seed per day, so the days are
reproducible and independent of the file layout. With one day (the default) nothing drifts and
the rows are those of the splits below.

Determinism: chunk ``c`` of split ``s`` draws from its own generator seeded by
``(seed, s, c)``, and the teacher from ``seed`` alone. The rows therefore depend on the seed,
the feature arguments and the split sizes, but not on ``row_group_size`` or ``rows_per_shard``
(those only cut the same rows into files), and a seed with the same arguments gives
byte-identical shards and dataset.json.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_app.data.days import DAYS, locate_days
from dlrm_app.data.schema import (
    DENSE_COLUMN,
    SPLIT_NAMES,
    DatasetKind,
    DatasetSpec,
    ShardFile,
    SparseFeature,
    SplitSpec,
    sha256_file,
)

TEACHER_DIM = 4
"""Embedding dimension of the hidden teacher."""
TEACHER_TEMPERATURE = 2.0
"""Lower is sharper: labels closer to deterministic, higher teacher AUC."""
TEACHER_BIAS = -4.0
"""Shifts the label rate below one half, as in click data."""
LABEL = "label"
MAX_CARDINALITY = 2**31
"""Ids are scattered with int64 products of two values below the cardinality."""
GENERATION_CHUNK = 65_536
"""Rows generated at a time (per split); fixed, so the data does not depend on the file layout."""
DEFAULT_SPLITS = (0.8, 0.1, 0.1)
DEFAULT_DRIFT = 0.05
"""With days: each day the teacher's weights move by this fraction of their norm, and each
feature's popularity ranks by this fraction of its id range."""

_MASK16 = np.uint64(0xFFFF)
_UNIT = math.sqrt(12.0) / 65536.0  # 16-bit uniform -> unit variance


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A fast, well-mixed 64-bit hash (SplitMix64 finalizer); wraps modulo 2**64 by design."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _teacher_embedding(ids: np.ndarray, salt: int) -> np.ndarray:
    """Fixed pseudo-random ``[len(ids), TEACHER_DIM]`` embeddings, one 64-bit hash per id."""
    h = _splitmix64(ids.astype(np.uint64) ^ np.uint64(salt))
    parts = [((h >> np.uint64(16 * k)) & _MASK16) for k in range(TEACHER_DIM)]
    emb = np.stack(parts, axis=1).astype(np.float32)
    return (emb - 32768.0) * np.float32(_UNIT)


def _zipf_ranks(rng: np.random.Generator, n: int, cardinality: int, alpha: float) -> np.ndarray:
    """``n`` ranks in ``[0, cardinality)`` with P(rank r) ~ (r + 1) ** -alpha (continuous)."""
    u = rng.random(n)
    top = cardinality + 1.0
    if abs(alpha - 1.0) < 1e-9:
        x = np.power(top, u)
    else:
        a = 1.0 - alpha
        x = np.power(1.0 + u * (top**a - 1.0), 1.0 / a)
    return np.minimum(x.astype(np.int64) - 1, cardinality - 1)


def _scatter_multiplier(cardinality: int, salt: int) -> int:
    """An odd multiplier coprime with ``cardinality``: rank -> id is then a bijection."""
    m = (salt | 1) % cardinality or 1
    while math.gcd(m, cardinality) != 1:
        m += 1
    return m


def binary_auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Exact ROC AUC by the rank-sum formula, ties counted as one half; None if one class."""
    labels = labels.astype(bool)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    # average 1-based rank of each distinct score = start of its run + (count + 1) / 2
    starts = np.cumsum(counts) - counts
    avg_rank = starts + (counts + 1) / 2.0
    rank_sum = float(avg_rank[inverse][labels].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


@dataclasses.dataclass(frozen=True)
class _Teacher:
    """One day's teacher: the dense map, the linear terms, and how many renewals of the id
    at each popularity rank the day has seen (``renewed``: see :func:`_renew`)."""

    w_dense: np.ndarray
    u: np.ndarray
    v: np.ndarray
    renewed: float

    def moved(self, rng: np.random.Generator, step: float, renewed: float) -> _Teacher:
        """The next day's: the weights moved by ``step`` (the norm of the move over all of
        them) in a random direction, ``renewed`` as given."""
        parts = (self.w_dense, self.u, self.v)
        direction = rng.standard_normal(sum(a.size for a in parts))
        direction *= step / np.linalg.norm(direction)
        moved, at = [], 0
        for a in parts:
            moved.append(a + direction[at:at + a.size].reshape(a.shape))
            at += a.size
        return _Teacher(*moved, renewed)

    def record(self) -> dict[str, list]:
        return {"w_dense": self.w_dense.tolist(), "u": self.u.tolist(), "v": self.v.tolist()}


def _renew(ranks: np.ndarray, cardinality: int, salt: int, renewed: float) -> np.ndarray:
    """The ranks whose ids stand for ``ranks`` on a day ``renewed`` = day x drift: rank ``r``
    is in generation ``g = floor(renewed + h(r))``, ``h(r)`` a fixed hash in ``[0, 1)``;
    generation 0 keeps its own id, generation ``g >= 1`` takes the id of the rank
    ``c - g - (r x g mod c)`` counted from the tail (the least popular, which the first day
    almost never drew). So each day a share ``drift`` of the ranks (by count, and in
    expectation by popularity) passes to a new id, and a renewed rank stays renewed."""
    h = (_splitmix64(ranks.astype(np.uint64) ^ np.uint64(salt ^ 0x5DEECE66D))
         >> np.uint64(11)).astype(np.float64) * 2.0**-53
    generation = np.floor(renewed + h).astype(np.int64)
    tail = (cardinality - generation - (ranks * generation) % cardinality) % cardinality
    return np.where(generation > 0, tail, ranks)


def _split_rows(rows: int, splits: Sequence[float]) -> list[int]:
    if len(splits) != 3 or any(f <= 0 for f in splits) or abs(sum(splits) - 1.0) > 1e-9:
        raise ValueError(f"splits must be three positive fractions (train, validation, test) "
                         f"summing to 1, got {tuple(splits)}")
    counts = [int(rows * splits[0]), int(rows * splits[1])]
    counts.append(rows - sum(counts))
    if min(counts) < 1:
        raise ValueError(f"rows={rows} leaves an empty split with fractions {tuple(splits)}; "
                         f"pass more rows")
    return counts


class _SplitWriter:
    """One split's rows, added in chunks of any size, as shards ``<split>-00000.parquet``, ...
    of ``rows_per_shard`` rows in row groups of ``row_group_size`` rows (the last of each shard
    may be shorter). Each shard is written to a hidden temporary name and renamed when
    complete. Every row group is written from one chunk per column, so the bytes depend on the
    rows and the layout, not on how ``add`` calls cut them."""

    def __init__(self, out: Path, split: str, schema: pa.Schema, rows_per_shard: int,
                 row_group_size: int) -> None:
        self.out, self.split, self.schema = out, split, schema
        self.rows_per_shard, self.row_group_size = rows_per_shard, row_group_size
        self.shards: list[ShardFile] = []
        self._writer: pq.ParquetWriter | None = None
        self._shard_rows = 0
        self._pending: list[pa.Table] = []  # rows of the shard not yet in a row group
        self._pending_rows = 0

    def _file(self) -> str:
        return f"{self.split}-{len(self.shards):05d}.parquet"

    def add(self, table: pa.Table) -> None:
        while len(table):
            if self._writer is None:
                self._writer = pq.ParquetWriter(self.out / f".{self._file()}.tmp", self.schema)
            room = self.rows_per_shard - self._shard_rows
            head, table = table.slice(0, room), table.slice(room)
            self._pending.append(head)
            self._pending_rows += len(head)
            self._shard_rows += len(head)
            while self._pending_rows >= self.row_group_size:
                self._flush(self.row_group_size)
            if self._shard_rows == self.rows_per_shard:
                self._finish_shard()

    def _flush(self, n: int) -> None:
        table = self._pending[0] if len(self._pending) == 1 else pa.concat_tables(self._pending)
        if any(c.num_chunks != 1 for c in table.columns):
            table = table.combine_chunks()
        assert self._writer is not None
        self._writer.write_table(table.slice(0, n), row_group_size=n)
        rest = table.slice(n)
        self._pending = [rest] if len(rest) else []
        self._pending_rows -= n

    def _finish_shard(self) -> None:
        if self._pending_rows:
            self._flush(self._pending_rows)
        assert self._writer is not None
        self._writer.close()
        file = self._file()
        os.replace(self.out / f".{file}.tmp", self.out / file)
        self.shards.append(ShardFile(file=file, rows=self._shard_rows,
                                     sha256=sha256_file(self.out / file),
                                     row_group_size=self.row_group_size))
        self._writer, self._shard_rows = None, 0

    def close(self) -> list[ShardFile]:
        """Finish the last shard; the shards in order."""
        if self._writer is not None:
            self._finish_shard()
        return self.shards


def generate(
    out_dir: str | os.PathLike[str],
    *,
    rows: int,
    num_dense: int = 13,
    cardinalities: Sequence[int],
    pooling_factors: Sequence[float],
    zipf_alpha: float = 1.05,
    splits: Sequence[float] = DEFAULT_SPLITS,
    rows_per_shard: int = 1_000_000,
    row_group_size: int = 65_536,
    seed: int = 0,
    days: int = 1,
    drift: float = DEFAULT_DRIFT,
) -> DatasetSpec:
    """Write a synthetic dataset to ``out_dir`` and return its spec (also saved there).

    One sparse feature per entry of ``cardinalities``; ``pooling_factors`` gives each one's mean
    ids per row (1.0 = one-hot, exactly one id; above 1, lengths are ``1 + Poisson(pf - 1)``).
    Each shard is written to a hidden temporary name and renamed when complete; dataset.json is
    written last, so a killed run never leaves a dataset that looks finished.

    ``days > 1``: the rows are ``days`` days (see the module doc: Days), day ``d`` holds rows
    ``[rows*d//days, rows*(d+1)//days)``; all but the last day are train, the last day's first
    half validation and the rest test (``splits`` is for one day only). ``drift`` sets how far
    popularity and the teacher move each day. ``parameters["days"]`` records every day
    (:mod:`dlrm_app.data.days`).
    """
    cardinalities = [int(c) for c in cardinalities]
    pooling_factors = [float(p) for p in pooling_factors]
    if len(pooling_factors) != len(cardinalities) or not cardinalities:
        raise ValueError(f"need one pooling factor per sparse feature: got "
                         f"{len(cardinalities)} cardinalities, {len(pooling_factors)} factors")
    for i, (c, pf) in enumerate(zip(cardinalities, pooling_factors, strict=True)):
        if not 1 <= c <= MAX_CARDINALITY:
            raise ValueError(f"cardinality of feature cat_{i} must be in [1, 2**31], got {c}")
        if pf < 1.0:
            raise ValueError(f"pooling factor of feature cat_{i} must be >= 1 (mean ids per "
                             f"row, 1 = one-hot), got {pf}")
    if num_dense < 1 or rows_per_shard < 1 or row_group_size < 1 or zipf_alpha <= 0:
        raise ValueError("num_dense, rows_per_shard, row_group_size and zipf_alpha must be "
                         f"positive, got {num_dense}, {rows_per_shard}, {row_group_size}, "
                         f"{zipf_alpha}")
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ValueError(f"days (--days) must be a positive int, got {days!r}")
    if not 0.0 <= drift <= 1.0:
        raise ValueError(f"drift (--drift) must be in [0, 1] (a day's move, relative to the "
                         f"teacher's size and the id range), got {drift}")
    if days == 1:
        split_rows = _split_rows(rows, splits)
    else:
        if tuple(splits) != DEFAULT_SPLITS:
            raise ValueError(f"with days={days} the splits follow the days (all but the last "
                             f"train, the last day's halves validation and test): leave "
                             f"splits at its default, got {tuple(splits)}")
        day_edges = [rows * d // days for d in range(days + 1)]
        last = day_edges[-1] - day_edges[-2]
        if min(b - a for a, b in zip(day_edges[:-1], day_edges[1:], strict=True)) < 1 \
                or last < 2:
            raise ValueError(f"rows={rows} over days={days} leaves a day without rows (the "
                             f"last needs 2: validation and test); pass more rows")
        split_rows = [day_edges[-2], last // 2, last - last // 2]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    teacher_rng = np.random.default_rng([seed, 0])
    w_dense = (teacher_rng.standard_normal((num_dense, TEACHER_DIM)) / math.sqrt(num_dense))
    u = teacher_rng.standard_normal(TEACHER_DIM)
    v = teacher_rng.standard_normal(TEACHER_DIM)
    salts = [int(s) for s in teacher_rng.integers(0, 2**62, size=len(cardinalities))]
    multipliers = [_scatter_multiplier(c, s) for c, s in zip(cardinalities, salts, strict=True)]
    sparse_names = [f"cat_{i}" for i in range(len(cardinalities))]
    dense_names = [f"int_{i}" for i in range(num_dense)]
    schema = pa.schema(
        [(LABEL, pa.float32()), (DENSE_COLUMN, pa.list_(pa.float32(), num_dense))]
        + [(n, pa.list_(pa.int64())) for n in sparse_names])

    def chunk(rng: np.random.Generator, n: int, teacher: _Teacher
              ) -> tuple[pa.Table, np.ndarray, np.ndarray]:
        w_dense, u, v = teacher.w_dense, teacher.u, teacher.v
        dense = rng.standard_normal((n, num_dense), dtype=np.float32)
        z = np.zeros((n, TEACHER_DIM), dtype=np.float32)
        columns = []
        for c, pf, salt, mult in zip(cardinalities, pooling_factors, salts, multipliers,
                                     strict=True):
            if pf == 1.0:
                lengths = np.ones(n, dtype=np.int64)
            else:
                lengths = 1 + rng.poisson(pf - 1.0, size=n)
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            ranks = _zipf_ranks(rng, int(offsets[-1]), c, zipf_alpha)
            if teacher.renewed:  # the ranks renewed by this day hold new ids
                ranks = _renew(ranks, c, salt, teacher.renewed)
            ids = (ranks * mult + salt % c) % c
            emb = _teacher_embedding(ids, salt)
            if pf == 1.0:
                z += emb
            else:
                z += np.add.reduceat(emb, offsets[:-1], axis=0) / lengths[:, None]
            columns.append(pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                                    pa.array(ids)))
        z /= np.float32(math.sqrt(len(cardinalities)))
        h = dense.astype(np.float64) @ w_dense
        logit = (z * h).sum(axis=1) + z @ u + h @ v + TEACHER_BIAS
        p = 1.0 / (1.0 + np.exp(-logit / TEACHER_TEMPERATURE))
        labels = (rng.random(n) < p).astype(np.float32)
        dense_col = pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), num_dense)
        table = pa.Table.from_arrays([pa.array(labels), dense_col, *columns], schema=schema)
        return table, p, labels

    first = _Teacher(w_dense, u, v, 0.0)
    writers = [_SplitWriter(out, name, schema, rows_per_shard, row_group_size)
               for name in SPLIT_NAMES]
    probs: list[list[np.ndarray]] = [[] for _ in SPLIT_NAMES]
    labels_all: list[list[np.ndarray]] = [[] for _ in SPLIT_NAMES]

    def add(split: int, table: pa.Table, p: np.ndarray, labels: np.ndarray) -> None:
        writers[split].add(table)
        probs[split].append(p)
        labels_all[split].append(labels.astype(np.int8))

    day_records = []
    if days == 1:  # the splits' rows as ever: chunk c of split s from (seed, 1, s, c)
        for split, n_split in enumerate(split_rows):
            for index, start in enumerate(range(0, n_split, GENERATION_CHUNK)):
                rng = np.random.default_rng([seed, 1, split, index])
                add(split, *chunk(rng, min(GENERATION_CHUNK, n_split - start), first))
        day_records.append({"index": 0, "name": "day_0", "rows": rows,
                            "renewed": 0.0, "teacher": first.record()})
    else:  # chunk c of day d from (seed, 4, d, c); the last day's halves are split
        teacher = first
        scale = float(np.sqrt(sum((a ** 2).sum() for a in (w_dense, u, v))))
        for d, (a, b) in enumerate(zip(day_edges[:-1], day_edges[1:], strict=True)):
            if d:
                teacher = teacher.moved(np.random.default_rng([seed, 3, d]), drift * scale,
                                        d * drift)
            day_p, day_labels = [], []
            for index, start in enumerate(range(a, b, GENERATION_CHUNK)):
                rng = np.random.default_rng([seed, 4, d, index])
                table, p, labels = chunk(rng, min(GENERATION_CHUNK, b - start), teacher)
                day_p.append(p)
                day_labels.append(labels)
                cut = max(0, min(len(p), split_rows[0] + split_rows[1] - start))
                if d < days - 1:
                    add(0, table, p, labels)
                    continue
                for split, lo, hi in ((1, 0, cut), (2, cut, len(p))):
                    if lo < hi:
                        add(split, table.slice(lo, hi - lo), p[lo:hi], labels[lo:hi])
            day_records.append({"index": d, "name": f"day_{d}", "rows": b - a,
                                "renewed": round(d * drift, 12),
                                "teacher": teacher.record(),
                                "teacher_auc": binary_auc(np.concatenate(day_p),
                                                          np.concatenate(day_labels))})
    split_specs = []
    teacher_auc: dict[str, float | None] = {}
    for split, (name, n_split) in enumerate(zip(SPLIT_NAMES, split_rows, strict=True)):
        shards = writers[split].close()
        all_labels = np.concatenate(labels_all[split])
        teacher_auc[name] = binary_auc(np.concatenate(probs[split]), all_labels)
        split_specs.append(SplitSpec(name=name, label_rate=int(all_labels.sum()) / n_split,
                                     shards=tuple(shards)))
    day_rows = [r["rows"] for r in day_records]
    for record, pieces in zip(day_records, locate_days(split_specs, np.cumsum(
            [0, *day_rows]).tolist()), strict=True):
        record["pieces"] = pieces

    spec = DatasetSpec(
        name="synthetic",
        kind=DatasetKind.SYNTHETIC,
        dense_features=tuple(dense_names),
        sparse_features=tuple(
            SparseFeature(name=n, num_embeddings=c, multi_hot=pf != 1.0)
            for n, c, pf in zip(sparse_names, cardinalities, pooling_factors, strict=True)),
        label=LABEL,
        label_dtype="float32",
        splits=tuple(split_specs),
        parameters={
            "generator": "dlrm_app.data.synthetic",
            "rows": rows,
            "num_dense": num_dense,
            "cardinalities": cardinalities,
            "pooling_factors": pooling_factors,
            "zipf_alpha": zipf_alpha,
            "splits": list(splits),
            "rows_per_shard": rows_per_shard,
            "row_group_size": row_group_size,
            "seed": seed,
            "teacher": {"dim": TEACHER_DIM, "temperature": TEACHER_TEMPERATURE,
                        "bias": TEACHER_BIAS},
            # best achievable AUC: the teacher's own, exact on each split
            "teacher_auc": teacher_auc,
            "drift": drift,
            DAYS: day_records,
        },
        created_by=f"dlrm_app {importlib.metadata.version('recsys-dlrm')}",
    )
    spec.save(out)
    return spec
