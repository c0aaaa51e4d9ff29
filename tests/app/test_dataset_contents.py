"""Dataset contents checked as shards are read: a dataset.json rewritten consistently (every
checksum matching) around bad contents still stops the loader, naming the file and the row,
instead of training on labels that are not 0/1, non-finite dense values, ids outside their
tables, or a damaged file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.schema import DatasetSpec, sha256_file
from dlrm_app.data.synthetic import generate


@pytest.fixture
def data(tmp_path: Path) -> Path:
    out = tmp_path / "data"
    generate(out, rows=2_000, num_dense=3, cardinalities=[50, 20], pooling_factors=[1.0, 2.0],
             zipf_alpha=1.05, seed=0, rows_per_shard=1_000, row_group_size=200)
    return out


def _rewrite(data: Path, change) -> Path:  # noqa: ANN001
    """Apply ``change(table) -> table`` to the first train shard, keep its row groups, and
    record the new file's checksum in dataset.json (a consistent, wrong dataset)."""
    spec = DatasetSpec.load(data)
    shard = spec.split("train").shards[0]
    path = data / shard.file
    pq.write_table(change(pq.read_table(path)), path, row_group_size=shard.row_group_size)
    _record_checksum(data, spec)
    return path


def _record_checksum(data: Path, spec: DatasetSpec) -> None:
    splits = tuple(dataclasses.replace(s, shards=tuple(
        dataclasses.replace(sh, sha256=sha256_file(data / sh.file)) for sh in s.shards))
        for s in spec.splits)
    dataclasses.replace(spec, splits=splits).save(data)


def _read_all(data: Path) -> None:
    for _ in ParquetLoader(data, "train", batch_size=256, rank=0, world_size=1,
                           drop_last=False):
        pass


def _set(table: pa.Table, name: str, column: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, column)


def test_labels_that_are_not_0_or_1_are_refused(data: Path) -> None:
    def seven(t: pa.Table) -> pa.Table:
        labels = t.column("label").to_numpy().copy()
        labels[450] = 7.0
        return _set(t, "label", pa.array(labels, pa.float32()))

    path = _rewrite(data, seven)
    with pytest.raises(ValueError, match=rf"{path.name}: row 450: label 7\.0 is not 0 or 1"):
        _read_all(data)


def test_non_finite_dense_values_are_refused_before_training_diverges(data: Path) -> None:
    def nan(t: pa.Table) -> pa.Table:
        dense = t.column("dense").combine_chunks()
        values = dense.flatten().to_numpy().copy()
        values[:] = np.nan  # every dense value NaN
        return _set(t, "dense", pa.FixedSizeListArray.from_arrays(pa.array(values), 3))

    path = _rewrite(data, nan)
    with pytest.raises(ValueError, match=rf"{path.name}: row 0: dense feature '.*' is nan, "
                                         r"not a finite number"):
        _read_all(data)


def test_ids_outside_their_table_are_refused(data: Path) -> None:
    def big(t: pa.Table) -> pa.Table:
        col = t.column("cat_1").combine_chunks()
        values = col.values.to_numpy().copy()
        row = 321
        values[col.offsets.to_numpy()[row]] = 20  # cat_1 has 20 rows: ids 0..19
        return _set(t, "cat_1", pa.ListArray.from_arrays(col.offsets, pa.array(values)))

    path = _rewrite(data, big)
    with pytest.raises(ValueError, match=rf"{path.name}: row 321: id 20 of sparse feature "
                                         r"'cat_1' is outside \[0, 20\)"):
        _read_all(data)


def test_a_damaged_shard_whose_checksum_matches_names_the_file(data: Path) -> None:
    spec = DatasetSpec.load(data)
    path = data / spec.split("train").shards[0].file
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(0)  # the labels' pages
    start = chunk.data_page_offset + 16  # past the page header, into the compressed values
    raw = bytearray(path.read_bytes())
    raw[start:start + 64] = bytes(b ^ 0xFF for b in raw[start:start + 64])
    path.write_bytes(bytes(raw))
    _record_checksum(data, spec)
    with pytest.raises(ValueError, match=rf"{path.name}: cannot read row group 0 .* the file is "
                                         r"damaged: run the preprocessing again"):
        _read_all(data)
