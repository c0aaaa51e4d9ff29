"""``dlrm-app train --follow``: each day evaluated by the model of the days before it, then
trained on; restarts continue with the first day not done (or the day in progress) without
training a day twice or logging it twice; each day published; the wait picks up an added day
(whose ids past the model's rows read row 0, counted); refusals."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from app_setup import two_feature_data

from dlrm_app.config import ModelConfig
from dlrm_app.data.criteo import preprocess_criteo
from dlrm_app.data.loader import ParquetLoader
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.data.synthetic import generate
from dlrm_app.serving import export as exporting
from dlrm_app.serving.artifact import MANIFEST_FILE, read_manifest
from dlrm_app.training import follow, resume
from dlrm_app.training.components import Preempted
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.evaluate import evaluate_checkpoint, evaluate_model, load_trained_model
from dlrm_app.training.runtime import init_distributed
from dlrm_app.training.tables import OutOfVocabulary
from dlrm_app.training.trainer import Trainer, train

SMALL = ModelConfig(embedding_dim=4, dense_arch_layer_sizes=(8, 4), over_arch_layer_sizes=(8, 1))
STEPS_A_DAY = 400 // 64  # 400 rows a day, batches of 64, the last partial one dropped


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return two_feature_data(tmp_path_factory.mktemp("days"), rows=1200, rows_per_shard=500,
                            row_group_size=100, days=3, drift=0.1)


def _config(data: Path, out: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(data=str(data), out=str(out), model=SMALL, batch_size=64,
                                follow=True, keep_checkpoints=5, log_every=2)
    base.update(kw)
    return TrainConfig.from_flags(**base)


def _log(run: Path, event: str) -> list[dict]:
    lines = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["event"] == event]


@pytest.fixture(scope="module")
def followed(days: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """One uninterrupted run over the 3 days, publishing each (export recorded, not run)."""
    run = tmp_path_factory.mktemp("follow") / "run"
    published: list[tuple[str, str]] = []
    real = exporting.export_model
    exporting.export_model = lambda r, out, **kw: published.append(  # type: ignore[assignment]
        (str(out), Path(kw["checkpoint"]).name))
    try:
        train(_config(days, run, publish=str(run.parent / "model.pt2")), progress=False)
    finally:
        exporting.export_model = real  # type: ignore[assignment]
    return run, published


def test_each_day_is_evaluated_by_the_model_of_the_days_before(days: Path,
                                                               followed: tuple) -> None:
    run, _ = followed
    lines = _log(run, "day")
    assert [d["day"] for d in lines] == [0, 1, 2]
    assert [d["rows"] for d in lines] == [400, 400, 400]
    # the model of days < d: trained on d days, STEPS_A_DAY steps each
    assert [(d["model_days"], d["model_step"]) for d in lines] == \
        [(d, d * STEPS_A_DAY) for d in range(3)]
    assert lines[0]["progressive_auc"] is None and "no model yet" in lines[0]["note"]
    assert [d["step"] for d in _log(run, "day_done")] == [6, 12, 18]
    for line in lines[1:]:  # the evaluate path: the checkpoint rebuilt, on the day's rows
        model, config, _, _ = load_trained_model(run, f"step_{line['model_step']:08d}")
        loader = ParquetLoader(days, days=line["day"], batch_size=1000, drop_last=False,
                               pad_last=True)
        expected = evaluate_model(model, loader, init_distributed(), amp=config.parallel.amp)
        assert line["progressive_auc"] == pytest.approx(expected["auc"], abs=1e-9)
        assert line["ne"] == pytest.approx(expected["ne"], abs=1e-9)
        assert line["oov_ids"] == 0
    summary = _log(run, "summary")[-1]
    assert summary["days_done"] == 3 and summary["trained_steps"] == 18
    assert [d["day"] for d in summary["days"]] == [0, 1, 2]


def test_each_day_is_published_from_its_checkpoint(followed: tuple) -> None:
    run, published = followed
    assert published == [(str(run.parent / "model.pt2"), f"step_{s:08d}") for s in (6, 12, 18)]


def test_the_report_lists_each_day_once_with_its_progressive_auc(followed: tuple) -> None:
    run, _ = followed
    report = (run / "report.md").read_text()
    assert "## Days (progressive evaluation)" in report
    rows = [line for line in report.splitlines() if line.startswith("| ") and
            line.split(" | ")[0][2:].isdigit()]
    days = _log(run, "day")
    assert [int(r.split(" | ")[0][2:]) for r in rows] == [d["day"] for d in days] == [0, 1, 2]
    assert rows[0].split(" | ")[3] == "n/a"  # day 0: no model yet
    for row, day in zip(rows[1:], days[1:], strict=True):
        assert row.split(" | ")[3] == f"{day['progressive_auc']:.4f}"


def test_a_kill_inside_day_1_continues_with_day_1(days: Path, followed: tuple,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed (no checkpoint) inside day 1, after its line: the rerun starts again from day
    0's checkpoint, evaluates day 1 again and does not log it twice."""
    run = tmp_path / "run"
    real_step = Trainer.step

    def killed_at_step_8(self: Trainer, batch: Any) -> Any:
        if self.state.step == 7:
            raise RuntimeError("killed")
        return real_step(self, batch)

    monkeypatch.setattr(Trainer, "step", killed_at_step_8)
    with pytest.raises(RuntimeError, match="killed"):
        train(_config(days, run), progress=False)
    assert [d["day"] for d in _log(run, "day")] == [0, 1]
    monkeypatch.setattr(Trainer, "step", real_step)
    summary = train(_config(days, run), progress=False)  # the same command again
    starts = _log(run, "start")
    assert starts[1]["resumed_from"].endswith("step_00000006")
    assert summary["trained_steps"] == 12 and summary["steps"] == 18
    assert [d["day"] for d in _log(run, "day")] == [0, 1, 2]
    assert [d["day"] for d in _log(run, "day_done")] == [0, 1, 2]
    # day 1 started from day 0's model: the same numbers as the uninterrupted run
    assert [d["progressive_auc"] for d in _log(run, "day")] == \
        [d["progressive_auc"] for d in _log(followed[0], "day")]


def test_sigterm_inside_a_day_resumes_after_its_trained_batches(
        days: Path, followed: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    real_step = Trainer.step

    def signalled_at_step_8(self: Trainer, batch: Any) -> Any:
        if self.state.step == 7:  # the 8th step: day 1's 2nd batch
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self, batch)

    monkeypatch.setattr(Trainer, "step", signalled_at_step_8)
    with pytest.raises(Preempted, match="after step 8"):
        train(_config(days, run), progress=False)
    monkeypatch.setattr(Trainer, "step", real_step)
    summary = train(_config(days, run, resume=True), progress=False)
    assert summary["trained_steps"] == 10 and summary["steps"] == 18
    assert [d["day"] for d in _log(run, "day")] == [0, 1, 2]
    # day 2 is evaluated by the same model as in the uninterrupted run: day 1 went on exactly
    assert _log(run, "day")[2]["progressive_auc"] == pytest.approx(
        _log(followed[0], "day")[2]["progressive_auc"], abs=1e-12)


def _criteo_day(path: Path, rows: list[dict[int, str]]) -> Path:
    lines = ["\t".join([str(i % 2)] + [""] * 13 + [r.get(k, "") for k in range(26)])
             for i, r in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_wait_picks_up_an_added_day_and_counts_ids_past_the_tables(tmp_path: Path) -> None:
    d0 = _criteo_day(tmp_path / "day_0", [{0: "10", 1: "1"}, {0: "10", 1: "1"},
                                          {0: "20", 1: "1"}, {0: "20", 1: "1"}])
    d1 = _criteo_day(tmp_path / "day_1", [{0: "10", 1: "1"}, {0: "20", 1: "1"}])
    data, run = tmp_path / "data", tmp_path / "run"
    preprocess_criteo([d0, d1], data, fmt="terabyte", max_embeddings_per_feature=4)
    # day 2 grows cat_0 to 4 rows (5 -> row 3) and cat_1 to 4 (3 -> row 2, 9 -> row 3): the
    # model keeps cat_0's 3 rows and cat_1's 2, so 2 + 3 of its ids read row 0
    d2 = _criteo_day(tmp_path / "day_2", [{0: "10", 1: "9"}, {0: "5", 1: "3"}, {0: "5", 1: "1"},
                                          {0: "30", 1: "9"}, {0: "40", 1: "1"}])
    done = threading.Event()

    def add_day_then_stop() -> None:
        deadline = time.monotonic() + 120
        def logged(event: str) -> bool:
            path = run / "metrics.jsonl"
            return path.is_file() and f'"event": "{event}"' in path.read_text()
        while not logged("waiting") and time.monotonic() < deadline:
            time.sleep(0.05)
        preprocess_criteo([d2], data, add_day=True)
        while '"day": 2, "step"' not in (run / "metrics.jsonl").read_text() \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        done.set()
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=add_day_then_stop, daemon=True)
    thread.start()
    summary = train(_config(data, run, batch_size=1, wait=0.2), progress=False)
    thread.join()
    assert done.is_set()
    assert summary["stopped"] == "SIGTERM while waiting for day 3"
    assert summary["days_done"] == 3 and summary["steps"] == 4 + 2 + 5
    day2 = _log(run, "day")[2]
    assert day2["oov_ids"] == 5 and day2["oov_ids_per_feature"] == {"cat_0": 2, "cat_1": 3}
    assert _log(run, "waiting")[0]["days"] == 2


def test_a_finished_run_rerun_after_a_new_day_trains_that_day_only(tmp_path: Path) -> None:
    """The README's daily loop without --wait: the same command after --add-day. The finished
    run's summary line lists its days too; only day lines count as days done."""
    d0 = _criteo_day(tmp_path / "day_0", [{0: "10"}, {0: "20"}, {0: "10"}, {0: "20"}])
    d1 = _criteo_day(tmp_path / "day_1", [{0: "20"}, {0: "10"}])
    d2 = _criteo_day(tmp_path / "day_2", [{0: "20"}, {0: "10"}, {0: "20"}])
    data, run = tmp_path / "data", tmp_path / "run"
    preprocess_criteo([d0, d1], data, fmt="terabyte")
    first = train(_config(data, run, batch_size=1), progress=False)
    assert first["days_done"] == 2 and first["steps"] == 4 + 2
    preprocess_criteo([d2], data, add_day=True)
    second = train(_config(data, run, batch_size=1), progress=False)
    assert second["days_done"] == 3 and second["steps"] == 4 + 2 + 3  # no day trained again
    assert [r["day"] for r in _log(run, "day")] == [0, 1, 2]
    assert [r["day"] for r in _log(run, "day_done")] == [0, 1, 2]
    assert _log(run, "day")[2]["model_step"] == 6  # evaluated by the model of days 0-1


@pytest.mark.slow  # 3-9 s: a follow run, two evaluations
def test_evaluate_reads_a_followed_run_after_its_vocabulary_grew(tmp_path: Path) -> None:
    """``dlrm-app evaluate`` builds the model with the tables of the run's start, not the grown
    dataset's (it failed to load the checkpoint: "Size mismatch ... [3, 4] ... [5, 4]"), and
    scores the same rows the same before and after a day added ids."""
    d0 = _criteo_day(tmp_path / "day_0", [{0: "10", 1: "1"}, {0: "20", 1: "2"},
                                          {0: "10", 1: "2"}, {0: "20", 1: "1"}])
    d1 = _criteo_day(tmp_path / "day_1", [{0: "20", 1: "1"}, {0: "10", 1: "2"}])
    d2 = _criteo_day(tmp_path / "day_2", [{0: "5", 1: "3"}, {0: "7", 1: "4"}])
    data, run = tmp_path / "data", tmp_path / "run"
    preprocess_criteo([d0, d1], data, fmt="terabyte", max_embeddings_per_feature=5)
    train(_config(data, run, batch_size=1), progress=False)
    before = evaluate_checkpoint(run, split="train")
    preprocess_criteo([d2], data, add_day=True)
    assert DatasetSpec.load(data).sparse_features[0].num_embeddings == 5  # grown from 3
    after = evaluate_checkpoint(run, split="train")
    assert after["num_examples"] == before["num_examples"] == 4
    for key in ("auc", "logloss", "mean_prediction"):
        assert after[key] == pytest.approx(before[key], abs=1e-12), key
    # every split's rows are in some day, which the run trained on: evaluate says so
    assert "not a held-out score" in after["note"] and "progressive AUC" in after["note"]


@pytest.mark.slow  # 4-8 s: a plain run, three evaluations, a resume
def test_a_plain_run_keeps_its_tables_after_its_dataset_grew(tmp_path: Path) -> None:
    """A day added to a plain run's dataset grows its vocabulary; the run's model keeps the
    tables of its start (``tables.json``, now written by every run): ``evaluate`` and
    ``--resume`` load its checkpoint (they failed: "Size mismatch ... [4, 4] ... [6, 4]") and the
    same rows score the same."""
    rows = [{0: str(10 * (i % 3 + 1)), 1: str(i % 2 + 1)} for i in range(40)]
    d0, d1 = _criteo_day(tmp_path / "day_0", rows), _criteo_day(tmp_path / "day_1", rows[:20])
    d2 = _criteo_day(tmp_path / "day_2", [{0: "5", 1: "3"}, {0: "7", 1: "4"}] * 10)
    data, run = tmp_path / "data", tmp_path / "run"
    preprocess_criteo([d0, d1], data, fmt="terabyte", max_embeddings_per_feature=8)
    train(_config(data, run, batch_size=4, follow=False, max_steps=6), progress=False)
    assert json.loads((run / "tables.json").read_text())["num_embeddings"]["cat_0"] == 4
    before = evaluate_checkpoint(run, split="test", checkpoint="latest")
    preprocess_criteo([d2], data, add_day=True)
    assert DatasetSpec.load(data).sparse_features[0].num_embeddings == 6  # grown from 4
    after = evaluate_checkpoint(run, split="test", checkpoint="latest")
    for key in ("auc", "logloss", "mean_prediction", "num_examples"):
        assert after[key] == pytest.approx(before[key], abs=1e-12), key
    train(_config(data, run, batch_size=4, follow=False, resume=True, max_steps=8),
          progress=False)
    assert [r["steps"] for r in _log(run, "summary")] == [6, 8]


@pytest.mark.parametrize(("flags", "message"), [
    ({"follow": False, "wait": 5.0}, "--wait goes with --follow"),
    ({"follow": False, "publish": "m.pt2"}, "--publish goes with --follow"),
    ({"publish": "model.onnx"}, "must end in .pt2"),
    ({"wait": 0.0}, "--wait must be a number of seconds > 0"),
    ({"max_steps": 10}, "--max-steps would stop --follow inside a day"),
])
def test_flags_that_do_not_go_together_are_refused(flags: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_flags(**{"data": "d", "out": "o", "follow": True, **flags})


def test_follow_is_fixed_on_resume_and_other_data_refused(tmp_path: Path) -> None:
    saved = TrainConfig.from_flags(data="d", out="o")
    with pytest.raises(ValueError, match="--follow True conflicts with the run's saved config"):
        resume.resume_config(saved, {"follow": True}, where="o/config.json")
    with pytest.raises(ValueError, match="follows the days of d; resume it without --data"):
        follow.refuse_other_data(TrainConfig.from_flags(data="e", out="o", follow=True),
                                 previous="d")


def test_a_dataset_without_days_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    generate(data, rows=300, num_dense=2, cardinalities=[10], pooling_factors=[1.0],
             zipf_alpha=1.05, seed=0, rows_per_shard=300, row_group_size=100)
    spec = json.loads((data / "dataset.json").read_text())
    spec["parameters"].pop("days", None)
    (data / "dataset.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="--follow needs a dataset that records its days"):
        train(_config(data, tmp_path / "run"), progress=False)


def test_a_failed_publish_names_the_checkpoint_and_how_to_go_on(
        days: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(run: Path, out: str, **kw: Any) -> None:
        raise ValueError("the vocabulary grew")

    monkeypatch.setattr(exporting, "export_model", refuse)
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"--publish .*model.pt2: exporting .*step_00000006 "
                       r"failed \(the vocabulary grew\); its day is trained and checkpointed"):
        train(_config(days, run, publish=str(tmp_path / "model.pt2")), progress=False)
    assert [d["day"] for d in _log(run, "day_done")] == [0]


def _manifest_only(programs: Any, meta: dict, out: Path, progress: Any) -> None:
    """Stands in for the AOTInductor compile (about a minute here): the .pt2 holds only its
    manifest, what the next publish compares its program fingerprint with."""
    with zipfile.ZipFile(out, "w") as z:
        z.writestr(f"archive/extra/{MANIFEST_FILE}", json.dumps(meta))


def _served(run: Path, checkpoint: str, cat_raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The checkpoint's serving programs as the export builds them (fp32 tables: exact), run
    eagerly on raw rows: (the ids the encode program gives, the probabilities)."""
    model, config, spec, _ = exporting.load_unsharded(run, checkpoint)
    model, id_map = exporting.freeze_raw_ids(model, spec, config.model)
    exporting.serving_form(model, spec)
    exporting.quantize_inference_model(model, exporting.DTYPES["fp32"])
    prep = exporting.dataset_preprocessing(spec, Path(config.data))
    programs = exporting.serving_programs(model, spec, prep, "torch", id_map)
    with torch.no_grad():
        dense, values, offsets = programs["encode"][0](
            torch.zeros(len(cat_raw), len(spec.dense_features)), cat_raw)
        return values, programs["model"][0](dense, values, offsets)


@pytest.mark.slow  # 12 s: 4 publishes (torch.export, no compile), 2 runs
def test_a_grown_vocabulary_publishes_weights_and_serves_ids_as_training_read_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that starts on a dataset grown by --add-day (its tables hold rows not in raw-id
    order) and follows another grown day: each day is published (the program once, then its
    weights: the served id map stays that of the run's tables), and the served programs map
    raw ids to the rows training read (rows past the model's tables and ids without a row to
    row 0), answering as the checkpoint's model on the preprocessed rows."""
    d0 = _criteo_day(tmp_path / "day_0", [{0: "10", 1: "1"}, {0: "20", 1: "2"},
                                          {0: "10", 1: "2"}, {0: "20", 1: "1"}])
    d1 = _criteo_day(tmp_path / "day_1", [{0: "20", 1: "1"}, {0: "10", 1: "2"}])
    # cat_0: 10 -> 1, 20 -> 2, then day 2's 5 -> 3 (the run's tables: 4 rows); day 3's 7 gets
    # row 4 (past the run's tables), 30 none (the budget of 5 rows is spent)
    d2 = _criteo_day(tmp_path / "day_2", [{0: "5", 1: "3"}, {0: "10", 1: "3"}])
    d3 = _criteo_day(tmp_path / "day_3", [{0: "7", 1: "3"}, {0: "5", 1: "1"}, {0: "7", 1: "9"},
                                          {0: "30", 1: "2"}, {0: "20", 1: "3"}])
    data, run, pt2 = tmp_path / "data", tmp_path / "run", tmp_path / "model.pt2"
    preprocess_criteo([d0, d1], data, fmt="terabyte", max_embeddings_per_feature=5)
    preprocess_criteo([d2], data, add_day=True)
    monkeypatch.setattr(exporting, "_write_pt2", _manifest_only)
    config = _config(data, run, batch_size=1, publish=str(pt2), embedding_learning_rate=0.5)
    train(config, progress=False)
    preprocess_criteo([d3], data, add_day=True)
    train(config, progress=False)
    exports = _log(run, "export")
    assert [e["published"] for e in exports] == ["program", "weights", "weights", "weights"]
    assert [e["checkpoint"].split("/")[-1] for e in exports] == [
        f"step_{s:08d}" for s in (4, 6, 8, 13)]
    manifest = read_manifest(pt2)
    assert manifest["preprocessing"]["encoding"]["num_embeddings"][:2] == [4, 4]
    assert manifest["vocabulary"]["file"] == "vocabulary-day-00002.parquet"
    assert json.loads((data / "dataset.json").read_text())["parameters"]["encoding"][
        "num_embeddings"][:2] == [5, 5]

    cat_raw = torch.zeros(5, 26, dtype=torch.int64)
    cat_raw[:, 0] = torch.tensor([0x7, 0x5, 0x7, 0x30, 0x20])
    cat_raw[:, 1] = torch.tensor([0x3, 0x1, 0x9, 0x2, 0x3])
    ids, probabilities = _served(run, "step_00000013", cat_raw)
    assert ids.view(26, 5)[0].tolist() == [0, 3, 0, 0, 2]  # 7: row 4, past the 4-row table
    model, _, spec, _ = exporting.load_unsharded(run, "step_00000013")
    assert [f.num_embeddings for f in spec.sparse_features][:2] == [4, 4]
    loader = ParquetLoader(data, days=3, batch_size=5, drop_last=False)
    batch = next(iter(OutOfVocabulary(loader, [f.num_embeddings
                                                      for f in spec.sparse_features])))
    assert torch.equal(ids, batch.sparse.values())
    with torch.no_grad():
        expected = torch.sigmoid(model(batch.dense, batch.sparse).squeeze(1))
    torch.testing.assert_close(probabilities, expected, rtol=1e-5, atol=1e-6)
    assert len({round(p, 4) for p in probabilities.tolist()}) == 5  # the rows do differ
