"""Raw ids mapped at training time (``preprocess --id-mapping zch``): the Parquet keeps the raw
ids, the model maps them with zero-collision hashing, a run continues on a file of new ids, and
export serves the frozen mapping with the documented fallback row."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from dlrm_app.config import ModelConfig
from dlrm_app.data.criteo import preprocess_criteo
from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.movielens import preprocess_movielens
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.id_map import freeze_raw_ids
from dlrm_app.model import build_dlrm, raw_id_space, scramble_ids, zch_table_rows
from dlrm_app.serving.export import export_model, load_unsharded
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.trainer import train
from recsys_core.sparse import KeyedJaggedTensor
from tests.shared_data import KAGGLE_10K, ML100K

SMALL = ModelConfig(embedding_dim=8, dense_arch_layer_sizes=(16, 8), over_arch_layer_sizes=(16, 1),
                    zch_rows=8000)
FEATURE = "cat_2"
"""The sample's feature with the most ids per half (2,966 distinct in the first, 3,005 in the
second, 2,555 of them new: 55% of the second half's rows)."""
needs_10k = pytest.mark.shared_data(KAGGLE_10K)


def _halves(tmp: Path) -> tuple[Path, Path]:
    """The Kaggle sample's first and last 5,000 rows as two files (the second brings ids the
    first never had)."""
    lines = KAGGLE_10K.read_text().splitlines(keepends=True)
    a, b = tmp / "a.tsv", tmp / "b.tsv"
    a.write_text("".join(lines[:5000]))
    b.write_text("".join(lines[5000:10000]))
    return a, b


@pytest.fixture(scope="module")
def kaggle_zch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("zch")
    a, b = _halves(tmp)
    preprocess_criteo([a], tmp / "da", id_mapping="zch")
    preprocess_criteo([b], tmp / "db", id_mapping="zch")
    return tmp, tmp / "da", tmp / "db"


@needs_10k
def test_preprocess_keeps_the_raw_hex_ids(kaggle_zch: tuple[Path, Path, Path]) -> None:
    """Row 1 of the file is in train (kaggle split by row order): its 26 ids are its hex values
    read as integers (missing -> 0); dataset.json marks the features raw, in [0, 2^32)."""
    _, da, _ = kaggle_zch
    spec = DatasetSpec.load(da)
    assert all(f.raw_ids and f.num_embeddings == 1 << 32 for f in spec.sparse_features)
    assert spec.parameters["encoding"]["mode"] == "zch"
    assert spec.parameters["tables"]["raw_id_features"][0] == "cat_0"
    first = KAGGLE_10K.read_text().splitlines()[0].split("\t")
    expected = [int(h, 16) if h else 0 for h in first[14:40]]
    table = pq.read_table(da / spec.split("train").shards[0].file)
    got = [table.column(f"cat_{k}")[0].as_py()[0] for k in range(26)]
    assert got == expected


@needs_10k
def test_id_mapping_flags_that_contradict_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--id-mapping zch keeps raw ids.*--num-embeddings"):
        preprocess_criteo([KAGGLE_10K], tmp_path / "x", id_mapping="zch",
                          num_embeddings_per_feature=1000)
    with pytest.raises(ValueError, match="--id-mapping hash needs.*--num-embeddings-per-feature"):
        preprocess_criteo([KAGGLE_10K], tmp_path / "x", id_mapping="hash")


def _user_movie_pairs(spec: DatasetSpec, out: Path) -> set[tuple[int, int]]:
    """Every (user_id, movie_id) of the preprocessed MovieLens dataset in ``out``, all splits."""
    pairs = set()
    for split in spec.splits:
        for shard in split.shards:
            t = pq.read_table(out / shard.file, columns=["user_id", "movie_id"])
            pairs |= {(u[0], m[0]) for u, m in zip(t.column("user_id").to_pylist(),
                                                   t.column("movie_id").to_pylist(), strict=True)}
    return pairs


@pytest.mark.shared_data(ML100K)
def test_movielens_keeps_raw_user_and_movie_ids(tmp_path: Path) -> None:
    """The user and movie ids of u.data, unchanged; the small vocabularies stay encoded."""
    spec = preprocess_movielens(ML100K, tmp_path / "ml", id_mapping="zch")
    raw = {f.name: f.raw_ids for f in spec.sparse_features}
    assert raw["user_id"] and raw["movie_id"] and not raw["genres"] and not raw["age"]
    pairs = _user_movie_pairs(spec, tmp_path / "ml")
    rated = {tuple(int(x) for x in line.split("\t")[:2])
             for line in (ML100K / "u.data").read_text().splitlines()}
    assert pairs == rated


def test_table_rows_from_memory_and_the_scramble_is_a_bijection() -> None:
    """Default rows: 256 MiB over the raw-id tables at (dim*4 + 4 + 32) bytes per row; the
    scramble permutes [0, 2^k) (no two raw ids share a key) and refuses ids outside it."""
    spec = dataclasses.replace(_tiny_spec(), sparse_features=tuple(
        dataclasses.replace(f, raw_ids=True, num_embeddings=1 << 32)
        for f in _tiny_spec().sparse_features))
    rows = zch_table_rows(spec, ModelConfig(embedding_dim=16))
    assert rows == (256 << 20) // (2 * (16 * 4 + 4 + 32))
    assert zch_table_rows(spec, ModelConfig(embedding_dim=16, zch_rows=77)) == 77
    ids = torch.arange(1 << 12)
    assert torch.equal(torch.sort(scramble_ids(ids, 1 << 12)).values, ids)
    with pytest.raises(ValueError, match="raw id -1 is outside"):
        scramble_ids(torch.tensor([-1, 3]), 1 << 12)
    with pytest.raises(ValueError, match="--zch-rows must be an int >= 2"):
        ModelConfig(zch_rows=0)
    assert raw_id_space(spec.sparse_features[0]) == 1 << 32


def _tiny_spec() -> DatasetSpec:
    from dlrm_app.data.schema import DatasetKind, SparseFeature, SplitSpec

    return DatasetSpec(
        name="tiny", kind=DatasetKind.SYNTHETIC, dense_features=("d0",),
        sparse_features=(SparseFeature(name="a", num_embeddings=10, multi_hot=False),
                         SparseFeature(name="b", num_embeddings=10, multi_hot=False)),
        label="label", label_dtype="float32",
        splits=tuple(SplitSpec(name=n, label_rate=0.5, shards=()) for n in
                     ("train", "validation", "test")),
        parameters={}, created_by="test")


def test_frozen_mapping_equals_the_trained_remapping_and_falls_back_to_the_last_row() -> None:
    """After training steps admit raw ids, the exported mapping (FrozenIdMap) gives every id
    the row the model's own eval-mode remapping gives it, and the plain model fed those rows
    predicts exactly what the model predicts; an id never seen maps to the last row."""
    spec = dataclasses.replace(_tiny_spec(), sparse_features=(
        _tiny_spec().sparse_features[0],
        dataclasses.replace(_tiny_spec().sparse_features[1], raw_ids=True,
                            num_embeddings=1 << 31)))
    config = ModelConfig(embedding_dim=4, dense_arch_layer_sizes=(4,),
                         over_arch_layer_sizes=(4, 1), zch_rows=6)
    torch.manual_seed(0)
    model = build_dlrm(spec, config, device="cpu")
    from dlrm_app.model import init_embedding_tables

    init_embedding_tables(model, 0)
    raw_b = torch.tensor([7, 2**30 + 5, 123456, 7, 99, 2**30 + 5])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.cat([torch.tensor([1, 2, 3, 4, 5, 6]), raw_b]), torch.ones(12, dtype=torch.int64))
    dense = torch.randn(6, 1)
    model.train()
    for _ in range(20):  # eviction_interval steps: the ids get rows
        model(dense, kjt)
    model.eval()
    remap = model.sparse_arch.managed_collision_collection._managed_collision_collection
    rows = remap(kjt)["b"].values()
    plain, id_map = freeze_raw_ids(model, spec, config)
    unseen = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor([1, 31337]), torch.ones(2, dtype=torch.int64))
    mapped = id_map(kjt.values(), kjt.offsets(), 6)
    assert torch.equal(mapped[6:], rows) and torch.equal(mapped[:6], kjt.values()[:6])
    assert len(set(rows.tolist())) == 4 and int(rows.max()) < 5  # 4 ids, own rows, not row 5
    assert id_map(unseen.values(), unseen.offsets(), 1).tolist() == [1, 5]
    with torch.no_grad():
        expected = model(dense, kjt)
        frozen = plain(dense, KeyedJaggedTensor(["a", "b"], mapped, offsets=kjt.offsets()))
    assert torch.equal(frozen, expected)
    negative = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor([1, -3]), torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"'t_b'.*raw id -3 is outside \[0, 2147483648\)"):
        model(dense[:1], negative)


def _run(data: Path, out: Path, **kw: object) -> TrainConfig:
    base = dict(data=str(data), out=str(out), model=SMALL, batch_size=128, validate_every=0,
                patience=0, epochs=1, embedding_learning_rate=0.1, learning_rate=0.05)
    base.update(kw)
    return TrainConfig.from_flags(**base)


def _rows_of(run: Path, data: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows the run's newest checkpoint gives ``data``'s ids of FEATURE, and the fallback
    row."""
    model, _, _, _ = load_unsharded(run, "latest")
    remap = model.sparse_arch.managed_collision_collection._managed_collision_collection
    loader = ParquetLoader(data, split, batch_size=4096, rank=0, world_size=1, drop_last=False)
    values = torch.cat([remap(b.sparse)[FEATURE].values() for b in loader])
    return values, torch.tensor(SMALL.zch_rows - 1)


@needs_10k
@pytest.mark.slow
def test_resume_on_a_file_of_new_ids_gives_them_rows(kaggle_zch: tuple[Path, Path, Path]
                                                     ) -> None:
    """Train on the first half, then ``--resume`` on the second half: the run continues from
    its step on the new data, and the new file's ids, which had only the shared last row after
    the first run (the 55% of rows whose id is new), have rows of their own after the second
    (the table holds 8,000 rows for 5,521 distinct ids; ids first seen after the last update of
    the remapping still share the last row)."""
    tmp, da, db = kaggle_zch
    run = tmp / "run"
    first = train(_run(da, run), progress=False)
    before, fallback = _rows_of(run, db, "train")
    second = train(_run(db, run, resume=True), progress=False)
    after, _ = _rows_of(run, db, "train")
    start = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()
             if '"start"' in s][-1]
    assert start["start_step"] == first["steps"]
    assert (start["continued_on_new_data"], start["previous_data"]) == (str(db), str(da))
    assert second["steps"] == first["steps"] + second["trained_steps"] > first["steps"]
    # the model kept is one of the new data (not the first run's best)
    assert int(Path(second["checkpoint"]).name.removeprefix("step_")) > first["steps"]
    assert 0.5 < (before == fallback).float().mean() < 0.6  # unseen by the first run
    assert (after == fallback).float().mean() < 0.1
    assert second["validation"]["auc"] > 0.6


@needs_10k
def test_resume_on_data_encoded_another_way_is_refused(kaggle_zch: tuple[Path, Path, Path]
                                                       ) -> None:
    tmp, da, _ = kaggle_zch
    run = tmp / "refused"
    train(_run(da, run, max_steps=2), progress=False)
    vocab = tmp / "vocab"
    preprocess_criteo([tmp / "b.tsv"], vocab)
    with pytest.raises(ValueError, match="features or table sizes differ.*--id-mapping zch"):
        train(_run(vocab, run, resume=True), progress=False)


@pytest.fixture(scope="module")
def zch_run(kaggle_zch: tuple[Path, Path, Path]) -> Path:
    tmp, da, _ = kaggle_zch
    run = tmp / "export_run"
    train(_run(da, run, max_steps=20), progress=False)
    return run


def _test_batch(run: Path) -> tuple[object, torch.Tensor]:
    """The run's first 300 test rows and the trained (unsharded, eval-mode) model's
    probabilities on them."""
    model, config, _, _ = load_unsharded(run, "latest")
    loader = ParquetLoader(config.data, "test", batch_size=300, rank=0, world_size=1,
                           drop_last=False)
    batch = next(iter(loader))
    with torch.no_grad():
        return batch, torch.sigmoid(model(batch.dense, batch.sparse)).squeeze(1)


@needs_10k
@pytest.mark.slow
def test_pt2_loads_with_torch_alone_and_serves_the_frozen_mapping(zch_run: Path,
                                                                   tmp_path: Path) -> None:
    """The .pt2 of a zch run (torch lookup), loaded by the documented loader in a process that
    cannot import this project or fbgemm_gpu, predicts what the trained model predicts on the
    test rows' raw ids, and on the raw rows through its encoder (int8 tables: within 0.01)."""
    from tests.app.test_export import _predict_isolated

    out = tmp_path / "model.pt2"
    meta = export_model(zch_run, out, checkpoint="latest", lookup="torch")
    assert not meta["needs_fbgemm"] and meta["sparse_features"][2]["raw_ids"]
    batch, expected = _test_batch(zch_run)
    rows = batch.dense.size(0)
    got = _predict_isolated(out, {
        "dense": batch.dense, "values": batch.sparse.values(),
        "offsets": batch.sparse.offsets().to(torch.int64),
        # the same rows raw: dense before log(x + 1), the hex ids' values (one-hot, key-major)
        "dense_raw": torch.expm1(batch.dense),
        "cat_raw": batch.sparse.values().view(-1, rows).t().contiguous(),  # AOTI: contiguous
    }, tmp_path)
    assert (got["forward"] - expected).abs().max() < 0.01
    assert (got["raw"] - expected).abs().max() < 0.01  # through the package's own encoder


@needs_10k
def test_export_serves_the_frozen_mapping(kaggle_zch: tuple[Path, Path, Path],
                                          zch_run: Path) -> None:
    """The TorchScript artifact of a zch run predicts what the trained model predicts (int8
    tables: within 0.01) on the test rows' raw ids."""
    tmp, da, _ = kaggle_zch
    run = zch_run
    out = tmp / "model.pt"
    export_model(run, out, fmt="torchscript", checkpoint="latest")
    scripted = torch.jit.load(str(out))
    model, _, _, _ = load_unsharded(run, "latest")
    loader = ParquetLoader(da, "test", batch_size=300, rank=0, world_size=1, drop_last=False)
    batch = next(iter(loader))
    with torch.no_grad():
        expected = torch.sigmoid(model(batch.dense, batch.sparse)).squeeze(1)
        got = scripted(batch.dense, batch.sparse.values(), batch.sparse.offsets())
    assert (got - expected).abs().max() < 0.01
    # an id no training step saw: the last row, as for any id without a row of its own. Row 0
    # alone (one id per feature), with its cat_0 replaced by ids not in the data; an FP32
    # artifact, so that one row's difference shows (int8 rounding hides it)
    fp32 = tmp / "model_fp32.pt"
    export_model(run, fp32, dtype="fp32", fmt="torchscript", checkpoint="latest")
    scripted = torch.jit.load(str(fp32))
    size = batch.dense.size(0)
    row0 = batch.sparse.values()[::size].clone()
    offsets = torch.arange(row0.numel() + 1)

    def predict(cat_0: int) -> tuple[float, float]:
        ids = row0.clone()
        ids[0] = cat_0
        kjt = KeyedJaggedTensor.from_offsets_sync(keys=batch.sparse.keys(), values=ids,
                                                  offsets=offsets)
        with torch.no_grad():
            trained = float(torch.sigmoid(model(batch.dense[:1], kjt)).squeeze())
        return float(scripted(batch.dense[:1], ids, offsets)[0]), trained

    seen, seen_trained = predict(int(row0[0]))
    assert abs(seen - seen_trained) < 1e-5
    fallback, fallback_trained = predict(4_000_000_000)  # in [0, 2^32), not in the data
    assert abs(fallback - fallback_trained) < 1e-5  # the trained model's fallback row
    assert predict(4_000_000_001)[0] == fallback  # every unseen id: the same row
    assert abs(fallback - seen) > 1e-4  # ... which is not the seen id's row


@pytest.mark.shared_data(ML100K)
def test_movielens_hash_mapping_is_the_raw_id_modulo_the_rows(tmp_path: Path) -> None:
    spec = preprocess_movielens(ML100K, tmp_path / "mh", id_mapping="hash",
                                num_embeddings_per_feature=100)
    sizes = {f.name: (f.num_embeddings, f.raw_ids) for f in spec.sparse_features}
    assert sizes["user_id"] == (100, False) and sizes["movie_id"] == (100, False)
    got = _user_movie_pairs(spec, tmp_path / "mh")
    rated = {(int(u) % 100, int(m) % 100) for u, m, *_ in
             (line.split("\t") for line in (ML100K / "u.data").read_text().splitlines())}
    assert got == rated
    with pytest.raises(ValueError, match="--num-embeddings-per-feature N .* goes with "
                                         "--id-mapping hash"):
        preprocess_movielens(ML100K, tmp_path / "x", id_mapping="hash")
