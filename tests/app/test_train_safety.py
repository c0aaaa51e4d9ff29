"""Training keeps its best model and its run directory: early stopping with patience, the best
checkpoint used by evaluate/export by default, divergence stops with a clear error, an
existing run is never overwritten by accident, --resume continues with the saved config."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
from app_setup import SMALL_MODEL, four_feature_data

from dlrm_app.cli import build_parser, config_from_args
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.training.checkpoint import best_checkpoint, latest_checkpoint, resolve_run
from dlrm_app.training.config import DenseOptimizer, TrainConfig
from dlrm_app.training.evaluate import evaluate_checkpoint
from dlrm_app.training.trainer import TrainingDiverged, train


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return four_feature_data(tmp_path_factory.mktemp("synthetic"), rows=6_000,
                             rows_per_shard=10_000, row_group_size=256)


def _config(data: Path, out: Path, **kw: object) -> TrainConfig:
    base = dict(data=str(data), out=str(out), model=SMALL_MODEL, batch_size=64, log_every=5)
    base.update(kw)
    return TrainConfig.from_flags(**base)


def _events(run: Path, event: str) -> list[dict]:
    lines = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["event"] == event]


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_batch_size_follows_the_data() -> None:
    """The README's numbers: about 64 steps an epoch, a power of two in 32..1024 per rank."""
    config = TrainConfig.from_flags(data="d", out="o")
    assert config.with_batch_size(8_571, 1).schedule.batch_size == 128  # the Kaggle 10k sample
    assert config.with_batch_size(8_571, 2).schedule.batch_size == 64  # same global batch, 2 ranks
    assert config.with_batch_size(98_114, 1).schedule.batch_size == 1024  # MovieLens 100K
    assert config.with_batch_size(65_536, 1).schedule.batch_size == 1024
    assert config.with_batch_size(131_072, 1).schedule.batch_size == 1024  # the cap
    assert config.with_batch_size(10**9, 8).schedule.batch_size == 1024
    assert config.with_batch_size(100, 4).schedule.batch_size == 32
    given = TrainConfig.from_flags(data="d", out="o", batch_size=300)
    assert given.with_batch_size(10**6, 1) is given


def test_validation_schedule_follows_the_data() -> None:
    config = TrainConfig.from_flags(data="d", out="o")
    assert config.validation.interval(75) == 19  # about 4 validations an epoch
    assert config.validation.interval(2) == 1
    assert config.validation.interval(10**8) == 10_000  # capped for huge epochs
    assert TrainConfig.from_flags(data="d", out="o", validate_every=0).validation.interval(75) == 0


def test_patience_stops_and_the_best_checkpoint_is_kept_and_used(data: Path, tmp_path: Path
                                                                 ) -> None:
    # rates far too high for 4.8k rows: validation AUC peaks early, then falls
    run = tmp_path / "run"
    summary = train(_config(data, run, epochs=20, validate_every=15, patience=2,
                            embedding_learning_rate=1.0, learning_rate=0.3), progress=False)
    validations = _events(run, "validation")
    aucs = [v["auc"] for v in validations]
    best = max(range(len(aucs)), key=lambda i: (aucs[i], -i))  # the first maximum
    assert summary["stopped_early"] and "--patience" in summary["stopped"]
    assert summary["steps"] < 20 * (4800 // 64)
    # it stopped at the first validation that made `patience` in a row without a better AUC
    assert len(validations) == best + 1 + 2
    assert summary["best_step"] == validations[best]["step"]
    assert [e["step"] for e in _events(run, "best")][-1] == validations[best]["step"]
    path = best_checkpoint(run / "checkpoints")
    assert path is not None and path.name == f"step_{validations[best]['step']:08d}"
    assert latest_checkpoint(run / "checkpoints").name == f"step_{summary['steps']:08d}"
    # the model returned and evaluated by default is the best one, not the last one
    assert summary["validation"]["auc"] == pytest.approx(aucs[best], abs=1e-9)
    assert resolve_run(run)[1] == path
    again = evaluate_checkpoint(run, split="validation")
    assert again["auc"] == pytest.approx(aucs[best], abs=1e-9)
    last = evaluate_checkpoint(run, split="validation", checkpoint="latest")
    assert last["auc"] == pytest.approx(aucs[-1], abs=1e-9) and last["auc"] < again["auc"]


def test_divergence_stops_with_a_clear_error(data: Path, tmp_path: Path) -> None:
    with pytest.raises(TrainingDiverged, match=r"not finite|train loss is (nan|inf).*lower "
                       r"--learning-rate .*--embedding-learning-rate"):
        train(_config(data, tmp_path / "run", learning_rate=1e12, embedding_learning_rate=1e12,
                      dense_optimizer=DenseOptimizer.SGD,
                      epochs=2, validate_every=5), progress=False)


def test_an_existing_run_is_continued_refused_or_overwritten(data: Path, tmp_path: Path,
                                                            capsys) -> None:
    run = tmp_path / "run"
    train(_config(data, run, max_steps=10), progress=False)
    # the same config again (a requeued job's command): continued from its newest checkpoint
    capsys.readouterr()
    again = train(_config(data, run, max_steps=10), progress=False)
    assert "holds a run of this same config: continuing it" in capsys.readouterr().err
    starts = _events(run, "start")
    assert len(starts) == 2 and starts[1]["start_step"] == 10
    assert starts[1]["resumed_from"].endswith("step_00000010") and again["steps"] == 10
    steps = [e["step"] for e in _events(run, "train")]
    assert steps == sorted(set(steps)) and steps[-1] == 10  # nothing trained twice
    # any other config is refused, naming both ways on; nothing is touched
    with pytest.raises(ValueError, match=r"already holds a training run of another config; "
                                         r"pass --resume .* --overwrite"):
        train(_config(data, run, max_steps=12), progress=False)
    assert len(_events(run, "start")) == 2
    longer = train(_config(data, run, max_steps=12, resume=True), progress=False)
    assert longer["steps"] == 12 and _events(run, "start")[-1]["start_step"] == 10
    again = train(_config(data, run, max_steps=10, overwrite=True), progress=False)
    assert again["steps"] == 10 and len(_events(run, "summary")) == 1  # the log started over
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        train(_config(data, tmp_path / "file"), progress=False)


def test_resume_reads_the_saved_config(data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = _parse("train", "--data", str(data), "--out", str(run), "--embedding-dim", "8",
                  "--over-arch-layer-sizes", "16-1", "--batch-size", "64", "--max-steps", "10")
    first = config_from_args(args)
    assert first.model.dense_arch_layer_sizes == (512, 256, 64, 8)  # default bottom, dim 8
    train(first, progress=False)
    # --resume without --data or model flags continues with the saved config
    resumed = config_from_args(_parse("train", "--out", str(run), "--resume", "--max-steps",
                                      "20"))
    assert resumed.model == first.model and resumed.data == first.data
    assert resumed.schedule.batch_size == 64 and resumed.schedule.max_steps == 20 and resumed.resume
    summary = train(resumed, progress=False)
    assert summary["steps"] == 20 and summary["trained_steps"] == 10
    # a flag that changes the model is an error naming it
    with pytest.raises(ValueError, match=r"--embedding-dim 16 conflicts with the run's saved "
                                         r"config \(.*config.json: 8\)"):
        config_from_args(_parse("train", "--out", str(run), "--resume", "--embedding-dim", "16"))
    with pytest.raises(ValueError, match="--data is required"):
        config_from_args(_parse("train", "--out", str(tmp_path / "new")))


def test_every_option_has_help_and_shows_its_default() -> None:
    stack = [("", build_parser())]
    checked = 0
    while stack:
        name, parser = stack.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack += [(f"{name} {n}".strip(), sub) for n, sub in action.choices.items()]
            elif action.option_strings and not isinstance(
                    action, argparse._HelpAction | argparse._VersionAction):
                flag = f"dlrm-app {name} {action.option_strings[0]}"
                text = parser._get_formatter()._expand_help(action)
                assert action.help and len(action.help) > 5, f"{flag} has no help line"
                assert action.required or "(default:" in text or "required" in text, \
                    f"{flag} hides its default"
                checked += 1
    assert checked > 60


def test_a_model_that_does_not_fit_fails_at_planning_with_the_flags(data: Path, tmp_path: Path
                                                                    ) -> None:
    # 3,550 rows of dim 8 need ~0.1 MiB with their optimizer state: give each rank 10 KiB
    with pytest.raises(ValueError, match=r"(?s)does not fit.*--max-embeddings-per-feature.*"
                                         r"--embedding-dim.*--memory-per-rank"):
        train(_config(data, tmp_path / "run", memory_per_rank=1e-5), progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained


def test_a_start_that_failed_before_its_first_step_is_not_a_run(
        data: Path, tmp_path: Path) -> None:
    """What a failed start leaves (config.json, plan.json, its start event; here a batch size
    larger than the train split) does not block the retry, with or without --resume, and the
    retry's flags are used, not the failed start's config."""
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="fewer than --batch-size"):
        train(_config(data, run, batch_size=100_000), progress=False)
    assert (run / "config.json").is_file()  # what the failed start left
    assert json.loads((run / "config.json").read_text())["schedule"]["batch_size"] == 100_000
    # the same command with a fixed flag: no --overwrite needed
    summary = train(_config(data, run, max_steps=4), progress=False)
    saved = json.loads((run / "config.json").read_text())
    assert summary["steps"] == 4 and saved["schedule"]["batch_size"] == 64
    assert len(_events(run, "start")) == 1  # the failed start's log went with it
    # --resume after a failed start: the given flags, not the failed config
    other = tmp_path / "other"
    with pytest.raises(ValueError, match="fewer than --batch-size"):
        train(_config(data, other, batch_size=100_000), progress=False)
    resumed = config_from_args(_parse("train", "--data", str(data), "--out", str(other),
                                      "--resume", "--max-steps", "3"))
    assert resumed.schedule.batch_size != 100_000
    # a run that trained a step is still refused without --resume / --overwrite (another config)
    with pytest.raises(ValueError, match="already holds a training run"):
        train(_config(data, run, max_steps=5), progress=False)


def test_a_best_chosen_before_a_continuation_on_new_data_is_not_kept(tmp_path: Path) -> None:
    """Checkpointer.keep_best(chosen_from=N): a best of step < N (the earlier data's) gives
    way to the newest checkpoint; one of step >= N is kept (and loaded)."""
    from dlrm_app.training.components import Checkpointer

    root = tmp_path / "checkpoints"
    for step in (10, 20):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / ".metadata").write_text("")
    (root / "best").write_text("step_00000010")
    (root / "latest").write_text("step_00000020")
    keeper = Checkpointer.__new__(Checkpointer)
    keeper.directory, keeper._background = root, None  # no model: only the pointers
    assert keeper.keep_best(chosen_from=15) == root / "step_00000020"  # not the old best
    (root / "step_00000030").mkdir()
    (root / "step_00000030" / ".metadata").write_text("")
    (root / "best").write_text("step_00000030")
    (root / "latest").write_text("step_00000030")
    assert keeper.keep_best(chosen_from=15) == root / "step_00000030"  # chosen on new data


def test_epochs_default_to_one_pass_over_a_click_log_in_time_order() -> None:
    """docs/training.md "Quality forward in time": a second and third pass over a Criteo log
    memorize its rows and score its later rows worse, so Criteo data trains one pass by default;
    other data three; a given --epochs always wins."""
    config = TrainConfig.from_flags(data="d", out="o")
    assert config.schedule.epochs is None
    assert config.with_epochs(time_ordered=True).schedule.epochs == 1
    assert config.with_epochs(time_ordered=False).schedule.epochs == 3
    given = TrainConfig.from_flags(data="d", out="o", epochs=2)
    assert given.with_epochs(True) is given and given.with_epochs(False).schedule.epochs == 2
    with pytest.raises(ValueError, match="--epochs must be a positive int"):
        TrainConfig.from_flags(data="d", out="o", epochs=0)


@pytest.mark.parametrize("kind, epochs", [("synthetic", 3), ("criteo", 1)])
def test_a_run_records_the_epochs_its_data_decided(data: Path, tmp_path: Path, kind: str,
                                                   epochs: int) -> None:
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    meta = json.loads((copy / "dataset.json").read_text())
    meta["kind"] = kind
    (copy / "dataset.json").write_text(json.dumps(meta))
    run = tmp_path / "run"
    summary = train(_config(copy, run, batch_size=512, max_steps=None, validate_every=0,
                            patience=0), progress=False)
    saved = json.loads((run / "config.json").read_text())
    assert saved["schedule"]["epochs"] == epochs  # a resume reads the number decided at the start
    steps_per_epoch = -(-DatasetSpec.load(copy).split("train").rows // 512)
    assert summary["steps"] in (epochs * steps_per_epoch, epochs * (steps_per_epoch - 1))
