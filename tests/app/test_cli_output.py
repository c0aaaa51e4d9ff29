"""What the commands print: a one-line plan and a progress bar from ``train`` (the plan's tables
stay in the run directory), nothing but the result with ``--quiet``, a line per stage from
``export``, and no ShardedTensor deprecation notices from our checkpoints on several ranks."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from app_setup import two_feature_data

from dlrm_app.cli import main
from dlrm_app.data.synthetic import generate
from dlrm_app.training.checkpoint import (
    SHARDED_TENSOR_NOTICE,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from recsys_core.plan.types import ShardingPlan
from recsys_core.testing import run_gloo

TINY = ["--embedding-dim", "4", "--dense-arch-layer-sizes", "8-4", "--over-arch-layer-sizes",
        "8-1", "--batch-size", "64", "--max-steps", "3", "--patience", "0"]
TABLE_HEADERS = ("sharding type", "compute kernel", "shard offsets", "module: ")
"""Words of the plan's printed tables (``print(plan)``), which stay off the screen."""
BAR = re.compile(r"\d+%\|")
"""A tqdm progress bar."""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return two_feature_data(tmp_path_factory.mktemp("output") / "data", rows=2_000,
                            rows_per_shard=1_000, row_group_size=250)


def _train(dataset: Path, run: Path, capsys: pytest.CaptureFixture[str], *flags: str
           ) -> tuple[str, str]:
    assert main(["train", "--data", str(dataset), "--out", str(run), *TINY, *flags]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_train_prints_one_plan_line_and_keeps_the_tables_in_the_run(
        dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    out, err = _train(dataset, run, capsys)
    plan_lines = [line for line in err.splitlines() if line.startswith("plan: ")]
    assert len(plan_lines) == 1, err
    # the 2 features' tables and their wide part's (dim 1)
    assert re.fullmatch(r"plan: 4 tables on 1 rank: (\d+ \w+/\w+, )*\d+ \w+/\w+; per table: "
                        + re.escape(str(run / "plan.json")), plan_lines[0]), plan_lines[0]
    assert not [h for h in TABLE_HEADERS if h in err], err
    assert BAR.search(err), err  # the progress bar
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["event"] == "summary"
    # a readable ending on stderr: the kept model's validation, the stop, report and next step
    auc = summary["validation"]["auc"]
    assert f"best validation AUC {auc:.4f}" in err and f"at step {summary['best_step']}" in err
    assert f"stopped: {summary['stopped']}" in err and f"report: {run / 'report.md'}" in err
    assert f"next: dlrm-app evaluate {run}" in err
    # the tables are in the run: plan.json (what print(plan) shows) and the report's section
    plan = ShardingPlan.from_json((run / "plan.json").read_text())
    assert sorted(t for m in plan.plan.values() for t in m) == [
        "t_cat_0", "t_cat_1", "w_cat_0", "w_cat_1"]
    report = (run / "report.md").read_text()
    section = report.split("## Sharding plan", 1)[1]
    assert "| t_cat_0 |" in section and "| t_cat_1 |" in section


def test_quiet_train_prints_only_its_result(dataset: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out, err = _train(dataset, tmp_path / "run", capsys, "--quiet")
    assert "plan: " not in err and not BAR.search(err) and "step/s" not in err, err
    assert "best validation AUC" not in err and "next: " not in err, err
    assert not [h for h in TABLE_HEADERS if h in err], err
    assert [json.loads(line)["event"] for line in out.strip().splitlines()] == ["summary"]


def test_export_prints_a_line_per_stage(dataset: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    run, artifact = tmp_path / "run", tmp_path / "model.pt"
    _train(dataset, run, capsys, "--quiet")
    assert main(["export", str(run), "--out", str(artifact), "--format", "torchscript"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    result = json.loads(captured.out)
    assert all(re.match(r"dlrm-app export: \[ *\d+\.\d s\] ", line) for line in lines), lines
    stages = [line.split("] ", 1)[1] for line in lines]
    assert stages == [f"loading the best checkpoint of {run} (unsharded, CPU)",
                      f"quantizing the tables of {latest_checkpoint(run / 'checkpoints').name} "
                      "to int8",
                      "scripting the model (TorchScript)",
                      f"wrote {artifact} (sha256 {result['sha256']}, also in "
                      f"{artifact.name}.sha256)"], stages
    assert result["path"] == str(artifact)


def _checkpoint_warnings(rank: int, world_size: int, data: str, root: str) -> dict[str, list[str]]:
    """On each rank: the warnings our checkpoint save and load raise, and those the library's
    own DCP load raises on the same files (the control: it does warn)."""
    from dlrm_app.config import ModelConfig
    from dlrm_app.data.schema import DatasetSpec
    from dlrm_app.training.build import build_model
    from dlrm_app.training.config import TrainConfig
    from recsys_core.distributed import checkpoint as dcp_checkpoint

    config = TrainConfig.from_flags(data=data, out=root, batch_size=64, model=ModelConfig(
        embedding_dim=4, dense_arch_layer_sizes=(8, 4), over_arch_layer_sizes=(8, 1)))
    model = build_model(config, DatasetSpec.load(data), torch.device("cpu"))
    seen: dict[str, list[str]] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = save_checkpoint(Path(root), 1, model=model, optimizer=None, extra={"step": 1})
        load_checkpoint(path, model=model, optimizer=None, extra={"step": 0})
        seen["ours"] = [str(w.message) for w in caught]
        caught.clear()
        dcp_checkpoint.load(str(path), model=model)
        seen["library"] = [str(w.message) for w in caught]
    return seen


@pytest.mark.slow
def test_two_rank_checkpoints_print_no_sharded_tensor_notice(tmp_path: Path) -> None:
    data = tmp_path / "data"  # tables the planner shards (row-wise) over 2 ranks
    generate(data, rows=1_000, num_dense=2, cardinalities=[5000, 2000],
             pooling_factors=[1.0, 1.0], zipf_alpha=1.05, seed=0, rows_per_shard=1_000,
             row_group_size=250)
    ranks = run_gloo(2, _checkpoint_warnings, str(data), str(tmp_path / "ckpt"))
    if not any(SHARDED_TENSOR_NOTICE in m for seen in ranks for m in seen["library"]):
        pytest.skip("the library's DCP load no longer warns about ShardedTensor: "
                    "dlrm_app.training.checkpoint's filter can go")
    for seen in ranks:
        assert not [m for m in seen["ours"] if "ShardedTensor" in m], seen["ours"]


def test_a_follow_run_ends_with_its_days_and_points_to_the_next_day_not_evaluate() -> None:
    """A --follow run trained on every split's rows: its summary shows the progressive AUCs and
    tells what to do next (add a day), not `evaluate` on a split it trained on."""
    from dlrm_app.cli import train_summary

    days = [{"day": 0, "progressive_auc": None}, {"day": 1, "progressive_auc": 0.71399},
            {"day": 2, "progressive_auc": 0.74069}]
    text = train_summary({"follow": True, "days": days, "days_done": 3, "trained_steps": 93,
                          "steps": 93, "mean_progressive_auc": 0.72734, "stopped": "every day done",
                          "checkpoint": "runs/days/checkpoints/step_00000093"}, "runs/days")
    assert "days done: 3; progressive AUC day 1 0.7140, day 2 0.7407; mean 0.7273" in text
    assert "dlrm-app evaluate" not in text and "--add-day" in text.splitlines()[-1]
