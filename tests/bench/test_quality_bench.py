"""bench/quality.py's logistic-regression baseline is a real model: on generated data whose
labels come from a teacher it learns (AUC well above chance, below the teacher's), on labels from
a linear logit it nearly reaches that logit's own AUC, the base rate scores exactly 0.5, and the
regularization is chosen on validation, not test. The generated datasets' path prints a teacher
line whose AUC is the hidden teacher's on the same test rows, recomputed here from the rows."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import quality  # noqa: E402  (bench/ is a folder of scripts, not a package)

from dlrm_app.data import synthetic  # noqa: E402
from dlrm_app.data.schema import DENSE_COLUMN, DatasetSpec, sha256_file  # noqa: E402
from dlrm_app.data.synthetic import generate  # noqa: E402
from recsys_core.metrics import BinaryClassificationMetrics  # noqa: E402


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    metrics = BinaryClassificationMetrics()
    metrics.update(torch.from_numpy(scores), torch.from_numpy(labels.astype(np.float32)))
    return metrics.compute()["auc"]


def _split_table(data: Path, split: str) -> pa.Table:
    spec = DatasetSpec.load(data)
    return pa.concat_tables(pq.read_table(data / s.file) for s in spec.split(split).shards)


def _teacher_logits(data: Path, table: pa.Table) -> np.ndarray:
    """The hidden teacher's logits of ``table``'s rows, recomputed from the stored ids and dense
    values as dlrm_app.data.synthetic defines the teacher (its private hash embedding)."""
    params = DatasetSpec.load(data).parameters
    rng = np.random.default_rng([params["seed"], 0])
    num_dense, dim = params["num_dense"], synthetic.TEACHER_DIM
    w_dense = rng.standard_normal((num_dense, dim)) / np.sqrt(num_dense)
    u, v = rng.standard_normal(dim), rng.standard_normal(dim)
    salts = rng.integers(0, 2**62, size=len(params["cardinalities"]))
    z = np.zeros((table.num_rows, dim), dtype=np.float32)
    for i, salt in enumerate(salts):
        bags = table.column(f"cat_{i}").combine_chunks()
        emb = synthetic._teacher_embedding(bags.values.to_numpy(), int(salt))
        offsets = bags.offsets.to_numpy()
        z += np.add.reduceat(emb, offsets[:-1], axis=0) / np.diff(offsets)[:, None]
    z /= np.float32(np.sqrt(len(salts)))
    dense = table.column(DENSE_COLUMN).combine_chunks().flatten().to_numpy()
    h = dense.reshape(-1, num_dense).astype(np.float64) @ w_dense
    logit = (z * h).sum(axis=1) + z @ u + h @ v + synthetic.TEACHER_BIAS
    return logit / synthetic.TEACHER_TEMPERATURE


def _relabel_linear(data: Path, seed: int) -> dict[str, np.ndarray]:
    """Replace every split's labels by Bernoulli(sigmoid(logit)) with a purely linear logit: a
    weight per dense feature and per (feature, id), summed over a bag; the shards' checksums and
    label rates in dataset.json follow. Returns each split's logits."""
    spec = DatasetSpec.load(data)
    rng = np.random.default_rng(seed)
    w_dense = rng.standard_normal(len(spec.dense_features))
    w_ids = [1.5 * rng.standard_normal(f.num_embeddings) for f in spec.sparse_features]
    logits, splits = {}, []
    for split in spec.splits:
        shards, split_logits, positives = [], [], 0
        for shard in split.shards:
            table = pq.read_table(data / shard.file)
            dense = table.column(DENSE_COLUMN).combine_chunks().flatten().to_numpy()
            logit = dense.reshape(table.num_rows, -1) @ w_dense - 1.0
            for f, w in zip(spec.sparse_features, w_ids, strict=True):
                bags = table.column(f.name).combine_chunks()
                row = np.repeat(np.arange(table.num_rows), np.diff(bags.offsets.to_numpy()))
                np.add.at(logit, row, w[bags.values.to_numpy()])
            labels = (rng.random(table.num_rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)
            table = table.set_column(0, spec.label, pa.array(labels))
            pq.write_table(table, data / shard.file)
            shards.append(dataclasses.replace(shard, sha256=sha256_file(data / shard.file)))
            split_logits.append(logit)
            positives += int(labels.sum())
        logits[split.name] = np.concatenate(split_logits)
        splits.append(dataclasses.replace(split, shards=tuple(shards),
                                          label_rate=positives / split.rows))
    dataclasses.replace(spec, splits=tuple(splits)).save(data)
    return logits


def test_logistic_regression_learns_the_teacher_part_it_can(tmp_path: Path) -> None:
    generate(tmp_path, rows=6000, num_dense=3, cardinalities=[50, 20, 200],
             pooling_factors=[1.0, 1.0, 2.0], zipf_alpha=1.05, seed=3)
    teacher = DatasetSpec.load(tmp_path).parameters["teacher_auc"]["test"]
    result = quality.logistic_regression(tmp_path)
    lr = result["logistic_regression"]
    assert result["rows"] == {"train": 4800, "validation": 600, "test": 600}
    assert 0.6 < lr["auc"] < teacher + 0.02, (lr, teacher)
    assert lr["l2"] in quality.L2_GRID
    assert lr["ne"] < 1.0  # better than predicting the base rate
    assert result["base_rate"]["auc"] == pytest.approx(0.5)


def test_kfold_rows_partition_the_file_and_never_leak() -> None:
    lines = [f"row{i}\n" for i in range(23)]
    held = []
    for k in range(5):
        rest, fold = quality.fold_rows(lines, 5, k)
        assert not set(rest) & set(fold)  # training never reads a held-out row
        assert sorted(rest + fold) == sorted(lines)
        assert fold == [f"row{i}\n" for i in range(k, 23, 5)]
        held += fold
    assert sorted(held) == sorted(lines)  # every row held out exactly once


def test_forward_rows_hold_out_the_later_rows() -> None:
    lines = [f"row{i}\n" for i in range(10)]
    rest, later = quality.forward_rows(lines, 0.4)
    assert rest == lines[:6] and later == lines[6:]  # every held-out row after every train row
    with pytest.raises(SystemExit, match="fraction in"):
        quality.forward_rows(lines, 1.0)


def test_logistic_regression_scores_the_held_out_dataset(tmp_path: Path) -> None:
    generate(tmp_path, rows=3000, num_dense=3, cardinalities=[50, 20, 200],
             pooling_factors=[1.0, 1.0, 2.0], zipf_alpha=1.05, seed=4)
    own = quality.logistic_regression(tmp_path)
    # the dataset itself as the held-out one: the same fit scored on the same rows
    same = quality.logistic_regression(tmp_path, held_out=tmp_path)
    assert same["logistic_regression"]["auc"] == own["logistic_regression"]["auc"]
    assert same["logistic_regression"]["l2"] == own["logistic_regression"]["l2"]


def test_logistic_regression_nearly_reaches_a_linear_teacher(tmp_path: Path) -> None:
    generate(tmp_path, rows=5000, num_dense=4, cardinalities=[20, 40, 60],
             pooling_factors=[1.0, 1.0, 2.0], zipf_alpha=0.6, seed=5)
    logits = _relabel_linear(tmp_path, seed=6)
    test_labels = _split_table(tmp_path, "test").column("label").to_numpy()
    ceiling = _auc(logits["test"], test_labels)
    result = quality.logistic_regression(tmp_path)
    lr, base = result["logistic_regression"], result["base_rate"]
    assert ceiling > 0.8  # the labels carry a strong linear signal
    assert lr["auc"] > ceiling - 0.03, (lr, ceiling)  # the model class holds the teacher
    assert lr["auc"] > base["auc"] + 0.25 and lr["ne"] < 0.8 * base["ne"], (lr, base)


def test_teacher_form_is_the_generators_model(tmp_path: Path) -> None:
    # few ids and many rows: the teacher's own form, fitted, comes close to the teacher (its
    # AUC is that of the true probabilities); a logistic regression, which lacks the bilinear
    # term, stays well below both
    # (measured: teacher 0.889, fitted 0.876, logistic regression 0.852)
    spec = generate(tmp_path / "d", rows=12_000, num_dense=4, cardinalities=[8] * 3,
                    pooling_factors=[1.0] * 3, seed=3)
    teacher = spec.parameters["teacher_auc"]["test"]
    fitted = quality.teacher_form(tmp_path / "d")
    lr = quality.logistic_regression(tmp_path / "d")["logistic_regression"]
    assert teacher - 0.025 < fitted["auc"] < teacher + 0.01, (fitted, teacher)
    assert lr["auc"] < fitted["auc"] - 0.01, (lr, fitted)
    assert 1 <= fitted["epochs"] <= 3


def test_synthetic_1m_is_the_generator_with_its_defaults(tmp_path: Path) -> None:
    spec = quality.generated_data("synthetic_1m", tmp_path / "data", rows=2000)
    assert quality.GENERATED["synthetic_1m"] * 0.8 == 1_000_000  # 1M train rows by default
    assert [s.rows for s in spec.splits] == [1600, 200, 200]
    assert len(spec.dense_features) == 13
    assert [f.num_embeddings for f in spec.sparse_features] == [10_000] * 26
    assert spec.parameters["pooling_factors"] == [1.0] * 26 and spec.parameters["seed"] == 0


@pytest.mark.slow
def test_generated_path_prints_dlrm_lr_base_rate_and_teacher_lines(tmp_path: Path) -> None:
    lines = quality.run_generated("demo", tmp_path, nproc=1, seeds=[7], rows=3000,
                                  train_flags=("--max-steps", "3"))
    by_system = {line["system"]: line for line in lines}
    assert [line["system"] for line in lines] == ["dlrm_defaults", "logistic_regression",
                                                  "base_rate", "teacher", "teacher_form"]
    data = tmp_path / "demo_data"
    spec = DatasetSpec.load(data)
    assert spec.parameters["cardinalities"] == [1_000] * 26  # the demo's own data
    rows = {s.name: s.rows for s in spec.splits}
    assert rows == {"train": 2400, "validation": 300, "test": 300}
    assert all(line["dataset"] == "demo" and line["rows"] == rows for line in lines)

    test = _split_table(data, "test")
    teacher_auc = _auc(_teacher_logits(data, test), test.column("label").to_numpy())
    assert by_system["teacher"]["auc"] == pytest.approx(teacher_auc, abs=1e-12)
    dlrm = by_system["dlrm_defaults"]
    assert dlrm["seed"] == 7 and dlrm["steps"] == 3 and 0.0 < dlrm["auc"] < 1.0
    assert dlrm["config"]["max_steps"] == 3 and "seed" not in dlrm["config"]
    assert by_system["base_rate"]["auc"] == pytest.approx(0.5)
    lr = by_system["logistic_regression"]
    assert by_system["base_rate"]["auc"] + 0.1 < lr["auc"] < teacher_auc
    for line in lines:
        assert {"auc", "ne", "logloss"} <= line.keys()
