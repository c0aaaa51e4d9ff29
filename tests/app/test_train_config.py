"""TrainConfig's tree of sections and config.json's two forms: the nested one written now, and
the flat one of the releases before the sections (every section's field at the top), which
still loads, meaning what it meant, and resumes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from dlrm_app.cli import build_parser, config_from_args
from dlrm_app.config import Interaction, ModelConfig
from dlrm_app.data.synthetic import generate
from dlrm_app.training.config import (
    CheckpointConfig,
    CommPrecision,
    DaysConfig,
    DenseOptimizer,
    EmbeddingOptimizer,
    LogConfig,
    OptimizerConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
    ValidationConfig,
)
from dlrm_app.training.trainer import train

FLAT_CONFIG_JSON = """\
{
  "data": "DATA",
  "out": "OUT",
  "model": {
    "embedding_dim": 4,
    "dense_arch_layer_sizes": [
      8,
      4
    ],
    "over_arch_layer_sizes": [
      8,
      1
    ],
    "interaction": "dot",
    "dcn_num_layers": 3,
    "dcn_low_rank_dim": 512,
    "wide": true,
    "zch_rows": null
  },
  "epochs": 3,
  "max_steps": 4,
  "batch_size": 32,
  "embedding_optimizer": "rowwise_adagrad",
  "embedding_learning_rate": 0.05,
  "dense_optimizer": "adagrad",
  "learning_rate": 0.01,
  "embedding_eps": 0.01,
  "eps": 1e-08,
  "lr_warmup_steps": 0,
  "lr_decay_start": 0,
  "lr_decay_steps": 0,
  "pipelined": true,
  "amp": null,
  "comm_precision": "auto",
  "seed": 0,
  "validate_every": null,
  "val_batches": 0,
  "patience": 3,
  "target_auc": null,
  "save_every": 2,
  "keep_checkpoints": 2,
  "background_checkpoints": false,
  "grace_period": 30.0,
  "resume": false,
  "overwrite": false,
  "plan": null,
  "memory_per_rank": null,
  "offload": true,
  "offload_dir": null,
  "log_every": 50,
  "timeout": 600.0,
  "shuffle": true,
  "threads": null,
  "follow": false,
  "wait": null,
  "publish": null
}
"""
"""config.json as the release before the sections wrote it (tree 03e63cb, ``dlrm-app generate
--rows 3000 --num-dense 2 --num-sparse 2 --cardinalities 50`` then ``dlrm-app train --max-steps
4 --embedding-dim 4 --dense-arch-layer-sizes 8-4 --over-arch-layer-sizes 8-1 --save-every 2``),
with its paths replaced by DATA and OUT."""

FIXTURE_CONFIG = TrainConfig(
    data="DATA", out="OUT",
    model=ModelConfig(embedding_dim=4, dense_arch_layer_sizes=(8, 4), over_arch_layer_sizes=(8, 1),
                      interaction=Interaction.DOT, wide=True),
    schedule=ScheduleConfig(epochs=3, max_steps=4, batch_size=32),
    optimizer=OptimizerConfig(embedding_optimizer=EmbeddingOptimizer.ROWWISE_ADAGRAD,
                              embedding_learning_rate=0.05, embedding_eps=0.01,
                              dense_optimizer=DenseOptimizer.ADAGRAD, learning_rate=0.01,
                              eps=1e-8),
    parallel=ParallelConfig(comm_precision=CommPrecision.AUTO, timeout=600.0),
    validation=ValidationConfig(patience=3), checkpoint=CheckpointConfig(save_every=2),
    log=LogConfig(log_every=50), days=DaysConfig(follow=False))
"""The fixture's config written out by hand, section by section."""


def _flat(data: str = "DATA", out: str = "OUT") -> dict:
    return json.loads(FLAT_CONFIG_JSON.replace("DATA", data).replace("OUT", out))


def test_a_flat_config_json_of_the_release_before_loads_into_its_sections(
        tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(FLAT_CONFIG_JSON)
    loaded = TrainConfig.load(tmp_path / "config.json")
    assert loaded == FIXTURE_CONFIG
    # saved again in the nested form: one object per section, nothing at the top but the run's
    loaded.save(tmp_path / "nested.json")
    nested = json.loads((tmp_path / "nested.json").read_text())
    assert set(nested) == {"data", "out", "seed", "resume", "overwrite", "model", "optimizer",
                           "schedule", "parallel", "validation", "checkpoint", "log", "days"}
    assert nested["schedule"] == {"epochs": 3, "max_steps": 4, "batch_size": 32,
                                  "lr_warmup_steps": 0, "lr_decay_start": 0, "lr_decay_steps": 0,
                                  "shuffle": True}
    assert nested["checkpoint"]["save_every"] == 2 and nested["days"]["follow"] is False
    assert nested["optimizer"]["embedding_optimizer"] == "rowwise_adagrad"
    assert TrainConfig.load(tmp_path / "nested.json") == FIXTURE_CONFIG
    # every key of the flat file is in the nested one, once, with its value
    leaves = {k: v for name, section in nested.items() if isinstance(section, dict)
              and name != "model" for k, v in section.items()}
    top = {k: v for k, v in nested.items() if not isinstance(v, dict) or k == "model"}
    assert not set(leaves) & set(top)
    assert {**leaves, **top} == _flat()


def test_the_flat_forms_renames_and_strict_keys(tmp_path: Path) -> None:
    # before --embedding-eps the tables took --eps; before the wide part the model had none
    older = _flat()
    del older["embedding_eps"], older["model"]["wide"]
    older["eps"] = 1e-6
    (tmp_path / "config.json").write_text(json.dumps(older))
    loaded = TrainConfig.load(tmp_path / "config.json")
    assert loaded.optimizer.embedding_eps == loaded.optimizer.eps == 1e-6
    assert loaded.model.wide is False
    # the nested form takes no such defaults: a key it lacks is today's default
    nested = FIXTURE_CONFIG.to_json_dict()
    del nested["optimizer"]["embedding_eps"], nested["model"]["wide"]
    again = TrainConfig.from_json_dict(nested)
    assert again.optimizer.embedding_eps == 1e-2 and again.model.wide is True
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['batch_sise'\]"):
        TrainConfig.from_json_dict({**_flat(), "batch_sise": 3})
    with pytest.raises(ValueError, match=r"unknown schedule key\(s\) \['batch_sise'\]"):
        TrainConfig.from_json_dict({**nested, "schedule": {"batch_sise": 3}})
    with pytest.raises(ValueError, match="--batch-size must be a positive int"):
        TrainConfig.from_json_dict({**_flat(), "batch_size": 0})


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_a_run_saved_with_a_flat_config_json_resumes(tmp_path: Path) -> None:
    data, run = tmp_path / "data", tmp_path / "run"
    generate(data, rows=3000, num_dense=2, cardinalities=[50, 50], pooling_factors=[1.0, 1.0],
             zipf_alpha=1.05, seed=0)
    (tmp_path / "flat.json").write_text(FLAT_CONFIG_JSON.replace("DATA", str(data))
                                        .replace("OUT", str(run)))
    first = train(TrainConfig.load(tmp_path / "flat.json"), progress=False)
    assert first["steps"] == 4
    # the run as the release before left it: its config.json in the flat form
    (run / "config.json").write_text((tmp_path / "flat.json").read_text())
    resumed = config_from_args(_parse("train", "--out", str(run), "--resume", "--max-steps", "8"))
    assert resumed.schedule.max_steps == 8 and resumed.resume
    assert resumed.schedule.batch_size == 32 and resumed.checkpoint.save_every == 2
    summary = train(resumed, progress=False)
    assert summary["steps"] == 8 and summary["trained_steps"] == 4  # from step 4, not 0
    saved = json.loads((run / "config.json").read_text())
    assert saved["schedule"]["max_steps"] == 8 and saved["resume"] is True
    assert saved["model"] == _flat()["model"]
    # a flag that would change the model still names itself against the flat file's value
    (run / "config.json").write_text((tmp_path / "flat.json").read_text())
    with pytest.raises(ValueError, match=r"--embedding-dim 8 conflicts with the run's saved "
                                         r"config \(.*config.json: 4\)"):
        config_from_args(_parse("train", "--out", str(run), "--resume", "--embedding-dim", "8"))


@pytest.mark.parametrize(("build", "message"), [
    (lambda: ModelConfig(interaction="dot"),
     "ModelConfig.interaction must be an Interaction, got 'dot'"),
    (lambda: OptimizerConfig(embedding_optimizer="sgd"),
     "embedding_optimizer must be an EmbeddingOptimizer, got 'sgd'"),
    (lambda: OptimizerConfig(dense_optimizer="adam"),
     "dense_optimizer must be a DenseOptimizer, got 'adam'"),
    (lambda: ParallelConfig(comm_precision="bf16"),
     "comm_precision must be a CommPrecision, got 'bf16'"),
    (lambda: TrainConfig(data="d", out="o", optimizer={"lr": 1.0}),
     "TrainConfig.optimizer must be an OptimizerConfig, got {'lr': 1.0}"),
])
def test_a_config_built_in_code_with_plain_values_is_refused_naming_the_field(
        build: Any, message: str) -> None:
    """Flags parse into enums and sections; code that builds a config with a plain string or a
    dict where one belongs is told which field and what it must be."""
    with pytest.raises(ValueError) as refused:
        build()
    assert str(refused.value) == message
