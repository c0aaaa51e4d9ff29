"""Everything a continued run decides, in one place.

A run continues (instead of starting) in three ways: ``--resume``; the same command again in a
run directory that holds a trained run of the same config (a requeued job); a torchrun restart
(``--max-restarts``), which implies ``--resume``. Then:

- its config is the saved one with the flags given on top (``resume_config``); a flag that
  would change what the checkpoint's shapes depend on (``FIXED_ON_RESUME``) is an error naming
  it. The command line starts from it (``from_command_line``) and so does the run directory's
  check (``continued``, called by ``run_dir.prepare_run_dir``);
- ``--data`` may name other data: training continues on it where the model reads it the same
  way (``previous_data`` checks that), its epochs from the start, the model, optimizer and step
  (the learning-rate schedule) as they were;
- the newest intact checkpoint is loaded into the model, the optimizer and the train state
  (``restore``).

A start that failed before its first step is no run to continue: it trained nothing
(``trained``), so the next start replaces it.

This module imports nothing heavy: the command line uses it while parsing.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlrm_app.training.config import TrainConfig, flatten, nest

if TYPE_CHECKING:
    from dlrm_app.data.schema import DatasetSpec
    from dlrm_app.training.components import Checkpointer, DataPosition, TrainState

CONFIG = "config.json"
"""The run's saved config, in its run directory."""

FIXED_ON_RESUME = ("model", "embedding_optimizer", "dense_optimizer", "follow")
"""What a resumed run cannot change: the shapes of its model and optimizer state, and whether
it follows days (its checkpoints count days, a run of epochs' do not). ``--data``
may change: training then continues on the new data if the model reads it the same way
(``check_continuation``: raw ids, or the same encoding)."""


def trained(out: Path) -> bool:
    """A checkpoint saved or a training step logged in ``out``."""
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return True
    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        return False
    with open(metrics, encoding="utf-8", errors="replace") as f:
        return any('"event": "train"' in line for line in f)


def resume_config(saved: TrainConfig, given: dict[str, Any], where: str) -> TrainConfig:
    """The config of a resumed run: ``saved`` with the flags the user ``given`` on top (same
    form as ``from_json_dict``'s input, nested or flat). A flag that would change a
    ``FIXED_ON_RESUME`` value is an error that names it."""
    merged = flatten(saved.to_json_dict())
    for key, value in flatten(given).items():
        if key == "model":
            for name, v in value.items():
                plain = list(v) if isinstance(v, tuple) else getattr(v, "value", v)
                if merged["model"][name] != plain:
                    raise ValueError(_conflict(name, plain, merged["model"][name], where))
            continue
        plain = getattr(value, "value", value)
        if key in FIXED_ON_RESUME and merged[key] != plain:
            raise ValueError(_conflict(key, plain, merged[key], where))
        merged[key] = plain
    merged["resume"], merged["overwrite"] = True, False
    return TrainConfig.from_json_dict(nest(merged), where=where)


def _conflict(name: str, given: Any, saved: Any, where: str) -> str:
    return (f"--{name.replace('_', '-')} {_flag_text(given)} conflicts with the run's saved "
            f"config ({where}: {_flag_text(saved)}); drop the flag to resume, or start a new run "
            f"in another --out")


def _flag_text(value: Any) -> str:
    return "-".join(map(str, value)) if isinstance(value, list) else str(value)


def from_command_line(given: dict[str, Any]) -> TrainConfig | None:
    """``--resume`` of a trained run: its saved config with the ``given`` flags on top; None
    where there is no such run (the flags alone make the config)."""
    saved = Path(given["out"]) / CONFIG
    if given.get("resume") and saved.is_file() and trained(saved.parent):
        return resume_config(TrainConfig.load(saved), given, where=str(saved))
    return None


def same_run(saved: TrainConfig, config: TrainConfig) -> bool:
    """``config`` is the saved run's config again (``--resume`` / ``--overwrite`` aside)."""
    def plain(c: TrainConfig) -> dict:
        d = c.to_json_dict()
        d.pop("resume", None), d.pop("overwrite", None)
        return d
    return plain(saved) == plain(config)


def continued(config: TrainConfig, existing: bool, rank: int) -> TrainConfig:
    """The config of the run in ``config.out`` (``existing``: it holds a trained run): the
    saved one with ``config``'s flags on top where the run continues (``--resume``, or the same
    config again), ``config`` where it starts (nothing there, or ``--overwrite``); an error
    where another config would start over a run without being told."""
    saved_path = Path(config.out) / CONFIG
    saved = TrainConfig.load(saved_path) if existing and saved_path.is_file() else None
    again = (saved is not None and not (config.resume or config.overwrite)
             and same_run(saved, config))
    if again and rank == 0:
        print(f"--out {config.out} holds a run of this same config: continuing it from its "
              "newest checkpoint (--overwrite starts over)", file=sys.stderr)
    if saved is not None and (config.resume or again):
        given = {k: v for k, v in config.to_json_dict().items() if k not in ("resume", "overwrite")}
        return resume_config(saved, given, where=str(saved_path))
    if existing and not (config.resume or config.overwrite):
        raise ValueError(f"--out {config.out} already holds a training run of another config; "
                         "pass --resume to continue it (with the flags given here on top), "
                         "--overwrite to start over (deletes its checkpoints and logs), or "
                         "another --out")
    return config


def restarted(config: TrainConfig, rank: int) -> TrainConfig:
    """Under a torchrun restart (``--max-restarts``) the run goes on from its newest checkpoint:
    ``--resume`` is implied (and ``--overwrite`` dropped: it would erase the run being
    continued)."""
    from dlrm_app.training.runtime import restart_count

    restarts = restart_count()
    if restarts == 0 or (config.resume and not config.overwrite):
        return config
    if rank == 0:
        print(f"torchrun restart {restarts}: resuming the run in {config.out} from its newest "
              "checkpoint", file=sys.stderr)
    return dataclasses.replace(config, resume=True, overwrite=False)


def previous_data(config: TrainConfig, spec: DatasetSpec) -> str | None:
    """The data of the run ``--resume`` continues where ``config.data`` (read as ``spec``) is
    other data, after checking that the model reads it the same way; None: the same data, or
    no run to continue."""
    saved = Path(config.out) / CONFIG
    if not (config.resume and saved.is_file()):
        return None
    previous = TrainConfig.load(saved).data
    if Path(previous).resolve() == Path(config.data).resolve():
        return None
    check_continuation(previous, spec, config.data)
    return previous


def check_continuation(previous: str, spec: DatasetSpec, data: str) -> None:
    """``--resume --data NEW`` continues a run on other data only where the model reads it the
    same way: the same features and table sizes, and ids that mean the same rows (raw ids, whose
    rows the model's zero-collision hashing assigns, or the same encoding / id map)."""
    from dlrm_app.data.schema import DatasetSpec

    try:
        before = DatasetSpec.load(previous)
    except ValueError:
        return  # gone: the checkpoint's shapes are the remaining check

    def shape(s: DatasetSpec) -> list[Any]:
        return [list(s.dense_features), [(f.name, f.num_embeddings, f.raw_ids, f.multi_hot)
                                         for f in s.sparse_features]]

    fix = (f"resume with the run's data ({previous}), or preprocess the new files with "
           f"--id-mapping zch (raw ids) or --like {previous}")
    if shape(before) != shape(spec):
        raise ValueError(f"--data {data}: its features or table sizes differ from those of the "
                         f"run's data {previous}, so the model cannot continue on it; {fix}")
    encoded = [f.name for f in spec.sparse_features if not f.raw_ids]
    for key in ("encoding", "id_map_sha256"):
        if encoded and getattr(before, key) != getattr(spec, key):
            raise ValueError(f"--data {data}: the ids of {encoded[:3]}... were encoded with "
                             f"another {key.replace('_', ' ')} than the run's data {previous}, "
                             f"so the same id would mean another row; {fix}")


@dataclasses.dataclass(frozen=True)
class Resumed:
    """Where a run continued from (all None: it started afresh)."""

    checkpoint: Path | None = None
    previous_data: str | None = None
    """The data trained on before, where this run continues on other data."""


def restore(checkpointer: Checkpointer, state: TrainState, data: DataPosition,
            resume: bool, previous: str | None) -> Resumed:
    """``--resume`` (``resume``): the newest intact checkpoint into the model, the optimizer,
    ``state`` and the data position. On other data (``previous``: the data before) its epochs start from
    the beginning, with the step (the learning-rate schedule) as it was; the best AUC and
    early stopping start over (its validation split is another yardstick)."""
    path = checkpointer.restore() if resume else None
    if path is None:
        return Resumed()
    if previous is not None:
        step = state.step
        state.load_state_dict(type(state)().state_dict())
        state.step = step
        data.start_epoch(0)
    return Resumed(checkpoint=path, previous_data=previous)
