"""``dlrm-app report RUN``: a run's ``report.md`` with PNG plots, for people to look at.

A run directory, once trained, evaluated and reported on::

    RUN/config.json               the TrainConfig                          (train)
    RUN/plan.json                 the sharding plan                         (train)
    RUN/metrics.jsonl             one JSON event a line                     (train)
    RUN/checkpoints/step_*/                                                 (train)
    RUN/evaluations/<name>.json   metrics + ROC and calibration points      (save_evaluation)
    RUN/report.md                 summary, configuration, plots, plan       (write_report)
    RUN/plots/*.png               loss, validation AUC/NE, samples/s, ROC,  (write_report)
                                  calibration of each saved evaluation
    RUN/tensorboard/              event files                               (write_tensorboard)

The log is read leniently, so a report can be written at any time: blank or unparsable lines
(a line being written right now) are counted and skipped, unknown events and fields are
ignored, and a step logged twice (a resumed run repeats the steps after its checkpoint) keeps
its last record. Events used: ``start``, ``train`` (loss, lr, samples_per_s), ``validation``
(auc, ne, ...), ``best`` (step, auc), ``stopped`` (reason) and ``summary``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlrm_app.data.schema import DatasetSpec
from dlrm_app.inputs import check_run_to_report
from dlrm_app.reporting.curves import calibration_curve, roc_curve
from dlrm_app.reporting.plots import write_plots
from dlrm_app.reporting.values import as_float as _float
from dlrm_app.reporting.values import column as _column
from dlrm_app.reporting.values import fmt as _fmt
from dlrm_app.reporting.values import number as _number
from dlrm_app.training.config import TrainConfig, flatten

ROC_POINTS = 201
"""Most ROC points stored per evaluation (vertices of the exact curve, spread along it)."""
CALIBRATION_BINS = 10
LEARNING_CURVE = "learning_curve.json"
"""Written into a run by bench/learning_curve.py: [{rows, test_auc, teacher_auc, ...}, ...]."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_METRIC_KEYS = ("auc", "ne", "logloss", "accuracy", "calibration")


# ---- evaluations --------------------------------------------------------------------------------
def save_evaluation(run_dir: str | Path, name: str, metrics: Mapping[str, Any],
                    scores: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor, *,
                    calibration_bins: int = CALIBRATION_BINS,
                    max_roc_points: int = ROC_POINTS) -> Path:
    """Store what the report needs of one evaluation in ``RUN/evaluations/<name>.json``.

    ``scores`` are the model's logits (before the sigmoid; what ``BinaryClassificationMetrics``
    takes and ``gather_rows()`` returns), ``labels`` 0/1, all rows of the evaluation (call on
    rank 0 only). Stored: ``metrics`` (non-finite numbers as null), the ROC curve down-sampled
    to at most ``max_roc_points`` of its vertices, and the calibration curve over
    ``calibration_bins`` bins; not the predictions. Written atomically (tmp + rename); a second
    call with the same name replaces the file.
    """
    if not _NAME.fullmatch(name):
        raise ValueError(f"save_evaluation: name {name!r} must be letters, digits, '_', '.' or "
                         "'-' (it becomes a file name), e.g. 'test'")
    if max_roc_points < 2:
        raise ValueError(f"save_evaluation: max_roc_points must be >= 2, got {max_roc_points}")
    logits = torch.as_tensor(scores.detach().cpu() if isinstance(scores, torch.Tensor) else scores,
                             dtype=torch.float64)
    y = np.asarray(labels.detach().cpu() if isinstance(labels, torch.Tensor) else labels)
    record: dict[str, Any] = {"name": name, "metrics": _plain(dict(metrics)),
                              "num_rows": int(logits.numel()), "roc": None}
    if 0 < int(np.count_nonzero(y)) < y.size:  # both classes: a ROC curve exists
        fpr, tpr = roc_curve(logits, y)
        kept = _spread(fpr + tpr, max_roc_points)
        record["roc"] = {"fpr": fpr[kept].tolist(), "tpr": tpr[kept].tolist(),
                         "vertices": int(fpr.size)}
    mean_predicted, observed, counts = calibration_curve(torch.sigmoid(logits), y,
                                                         calibration_bins)
    record["calibration"] = {"bins": calibration_bins, "mean_predicted": mean_predicted.tolist(),
                             "observed_rate": observed.tolist(), "counts": counts.tolist()}
    path = Path(run_dir) / "evaluations" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, (json.dumps(record, indent=1, allow_nan=False) + "\n").encode())
    return path


def _spread(position: np.ndarray, count: int) -> np.ndarray:
    """At most ``count`` indices of the increasing ``position``, evenly spread along it, the
    first and last included (for a ROC curve ``fpr + tpr`` rises from 0 to 2)."""
    if position.size <= count:
        return np.arange(position.size)
    targets = np.linspace(position[0], position[-1], count)
    return np.unique(np.minimum(np.searchsorted(position, targets), position.size - 1))


def _plain(value: Any) -> Any:
    """``value`` as strict JSON data: NaN/inf -> None, tensors and numpy numbers -> Python."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        return _plain(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)


# ---- reading a run ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """What a run directory says about itself; every part may be missing."""

    path: Path
    config: dict[str, Any]
    train: list[dict[str, Any]]
    """``train`` events by step (one per step: the last logged)."""
    validation: list[dict[str, Any]]
    """``validation`` events by step."""
    events: dict[str, list[dict[str, Any]]]
    """Every record by its ``event`` (start, best, stopped, summary, unknown ones...)."""
    lines: int
    skipped_lines: int
    evaluations: dict[str, dict[str, Any]]
    dataset: DatasetSpec | None
    notes: list[str]
    """What could not be read, for the report's last section."""
    learning_curve: list[dict[str, Any]] | None
    """The points bench/learning_curve.py stored in the run (``LEARNING_CURVE``), or None."""

    def last(self, event: str) -> dict[str, Any] | None:
        records = self.events.get(event)
        return records[-1] if records else None

    def best(self) -> tuple[int, float, str] | None:
        """(step, validation AUC, where from): the last ``best`` event, else the highest AUC."""
        marked = self.last("best")
        if marked is not None and _number(marked.get("step")) is not None:
            return int(marked["step"]), _float(marked.get("auc")), "best event"
        scored = [(v["step"], _float(v.get("auc"))) for v in self.validation]
        scored = [(s, a) for s, a in scored if not math.isnan(a)]
        if not scored:
            return None
        step, auc = max(scored, key=lambda sa: (sa[1], -sa[0]))
        return step, auc, "highest validation AUC"

    def teacher_auc(self, split: str) -> float | None:
        """The dataset's best achievable AUC on ``split`` (synthetic data records it)."""
        teacher = self.dataset.teacher_auc if self.dataset else None
        if teacher is None:
            teacher = (self.last("summary") or {}).get("teacher_auc")
        value = teacher.get(split) if isinstance(teacher, Mapping) else None
        return float(value) if _number(value) is not None else None


def read_run(run_dir: str | Path) -> Run:
    """Read config.json, metrics.jsonl, evaluations/ and the dataset's dataset.json."""
    path = Path(run_dir)
    check_run_to_report(path)
    notes: list[str] = []
    # keyed as the flags are, whichever form the run saved (nested, or an earlier release's flat)
    config = flatten(_read_json(path / "config.json", notes))
    events: dict[str, list[dict[str, Any]]] = {}
    lines = skipped = 0
    log = path / "metrics.jsonl"
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        lines += 1
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("event"), str):
            skipped += line.strip() != ""
            continue
        events.setdefault(record["event"], []).append(record)
    if skipped:
        notes.append(f"metrics.jsonl: {skipped} line(s) were not JSON events and were skipped "
                     "(a line being written, or a damaged log)")
    evaluations = {}
    for file in sorted((path / "evaluations").glob("*.json")):
        record = _read_json(file, notes)
        if record:
            evaluations[file.stem] = record
    dataset = None
    if isinstance(config.get("data"), str):
        try:
            dataset = DatasetSpec.load(config["data"])
        except (ValueError, OSError) as e:
            notes.append(f"dataset {config['data']!r} not readable from here ({e}); rows and "
                         "teacher AUC come from the log only")
    return Run(path=path, config=config, train=_by_step(events.get("train", [])),
               validation=_by_step(events.get("validation", [])), events=events, lines=lines,
               skipped_lines=skipped, evaluations=evaluations, dataset=dataset, notes=notes,
               learning_curve=_read_learning_curve(path))


def _read_json(file: Path, notes: list[str]) -> dict[str, Any]:
    if not file.is_file():
        notes.append(f"{file.name}: not found")
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        notes.append(f"{file.name}: unreadable ({e})")
        return {}
    return data if isinstance(data, dict) else {}


def _by_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    latest = {int(r["step"]): r for r in records if _number(r.get("step")) is not None}
    return [latest[s] for s in sorted(latest)]


def _read_learning_curve(run_dir: Path) -> list[dict[str, Any]] | None:
    try:
        curve = json.loads((run_dir / LEARNING_CURVE).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(curve, list) and curve and all(
        isinstance(p, dict) and "rows" in p and "test_auc" in p and "teacher_auc" in p
        for p in curve)
    return curve if ok else None


def _curve_section(curve: list[dict[str, Any]]) -> list[str]:
    """The report's Learning curve section: a sentence and a table, a row per row count."""
    form = any("teacher_form_auc" in p for p in curve)
    intro = "Test AUC of the defaults on more rows of this data's generator " \
        "(`bench/learning_curve.py`)."
    if form:
        intro += " The teacher's form, fitted: the generator's own model fitted to the same " \
            "rows, what that many rows allow."
    head = ["generated rows", "train rows", "epochs", "default DLRM"] \
        + (["teacher's form, fitted"] if form else []) + ["teacher", "gap"]
    lines = ["## Learning curve", "", intro, "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for p in curve:
        cells = [_count(p["rows"]), _count(p.get("train_rows")), _count(p.get("epochs")),
                 _fmt(p["test_auc"])] + ([_fmt(p.get("teacher_form_auc"))] if form else []) \
            + [_fmt(p["teacher_auc"]), _fmt(_float(p["teacher_auc"]) - _float(p["test_auc"]))]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


# ---- report.md ----------------------------------------------------------------------------------
def write_report(run_dir: str | Path) -> Path:
    """(Re)write RUN/report.md and RUN/plots/*.png from what the run holds now; the md path."""
    run = read_run(run_dir)
    plots = write_plots(run)
    lines = [f"# Run report: {run.path.name}", "",
             f"Written {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z} by "
             f"`dlrm-app report` from {run.lines} lines of `metrics.jsonl`.", "",
             "## Summary", "", *[f"- {fact}" for fact in _facts(run)], ""]
    if run.evaluations:
        lines += ["## Evaluations", "", "| name | rows | " + " | ".join(_METRIC_KEYS) + " |",
                  "|---" * (len(_METRIC_KEYS) + 2) + "|"]
        for name, evaluation in run.evaluations.items():
            m = evaluation.get("metrics") or {}
            rows = m.get("num_examples", evaluation.get("num_rows"))
            lines.append(f"| {name} | {_count(rows)} | "
                         + " | ".join(_fmt(m.get(k)) for k in _METRIC_KEYS) + " |")
        lines.append("")
    lines += _days_section(run)
    if run.learning_curve is not None:
        lines += _curve_section(run.learning_curve)
    lines += ["## Plots", ""]
    lines += [f"![{title}](plots/{path.name})\n" for title, path in plots.items()] or [
        "Nothing logged to plot yet.", ""]
    lines += ["## Configuration (differences from the defaults)", "", *_config_table(run), ""]
    lines += ["## Sharding plan", "", *_plan_table(run.path / "plan.json"), ""]
    if run.notes:
        lines += ["## Notes", "", *[f"- {note}" for note in run.notes], ""]
    path = run.path / "report.md"
    _write_atomic(path, "\n".join(lines).encode())
    return path


def _days_section(run: Run) -> list[str]:
    """``train --follow``'s days: each day scored by the model of the days before it (the
    progressive evaluation), one row a day (a day evaluated again after a restart is logged
    once)."""
    days: dict[int, dict[str, Any]] = {}
    for record in run.events.get("day", []):
        if _number(record.get("day")) is not None:
            days.setdefault(int(record["day"]), record)
    if not days:
        return []
    lines = ["## Days (progressive evaluation)", "",
             "Each day scored by the model of the days before it, then trained on.", "",
             "| day | name | rows | progressive AUC | NE | logloss | ids past the tables |",
             "|---|---|---|---|---|---|---|"]
    for day, r in sorted(days.items()):
        lines.append(f"| {day} | {r.get('name', '')} | {_count(r.get('rows'))} | "
                     f"{_fmt(r.get('progressive_auc'))} | {_fmt(r.get('ne'))} | "
                     f"{_fmt(r.get('logloss'))} | "
                     f"{'-' if r.get('oov_ids') is None else _count(r.get('oov_ids'))} |")
    return [*lines, ""]


def _facts(run: Run) -> list[str]:
    facts = []
    start, summary = run.last("start") or {}, run.last("summary")
    data = run.config.get("data", "?")
    if run.dataset is not None:
        rows = ", ".join(f"{s.rows:,} {s.name}" for s in run.dataset.splits)
        facts.append(f"**Dataset**: {run.dataset.name} ({run.dataset.kind.value}, `{data}`): "
                     f"{rows} rows")
    else:
        facts.append(f"**Dataset**: `{data}`")
    world = (summary or {}).get("world_size", start.get("world_size"))
    if world is not None:
        batch = run.config.get("batch_size")
        facts.append(f"**World size**: {world} rank(s) on {start.get('device', '?')}, global batch "
                     f"{_count(batch * world if isinstance(batch, int) else None)}")
    step = summary.get("steps") if summary else (run.train[-1]["step"] if run.train else 0)
    per_epoch = _number(start.get("steps_per_epoch"))
    epochs = _number((summary or {}).get("epochs"))
    if epochs is None and per_epoch and isinstance(step, int):
        epochs = step / per_epoch
    epochs_text = "" if epochs is None else f" = {epochs:.2f} epochs"
    facts.append(f"**Steps**: {_count(step)} of {_count(start.get('total_steps'))}{epochs_text}"
                 + (f" (resumed {len(run.events['start']) - 1}x)"
                    if len(run.events.get("start", [])) > 1 else ""))
    facts.append(f"**Stopped**: {_stop_reason(run)}")
    best = run.best()
    if best is not None:
        step_at = {v["step"]: v for v in run.validation}.get(best[0], {})
        facts.append(f"**Best validation AUC**: {_fmt(best[1])} at step {best[0]:,} "
                     f"(NE {_fmt(step_at.get('ne'))}; {best[2]})")
    else:
        facts.append("**Best validation AUC**: no validation logged yet")
    for name, evaluation in run.evaluations.items():
        m = evaluation.get("metrics") or {}
        facts.append(f"**{name.capitalize()} metrics**: AUC {_fmt(m.get('auc'))}, NE "
                     f"{_fmt(m.get('ne'))}, logloss {_fmt(m.get('logloss'))} over "
                     f"{_count(m.get('num_examples'))} rows")
    teacher = {s: run.teacher_auc(s) for s in ("validation", "test")}
    if any(v is not None for v in teacher.values()):
        facts.append("**Teacher AUC** (the best achievable on this data): " + ", ".join(
            f"{s} {v:.4f}" for s, v in teacher.items() if v is not None))
    rates = _column(run.train, "samples_per_s")[1]
    if summary and _number(summary.get("samples_per_s")):
        facts.append(f"**Throughput**: {summary['samples_per_s']:,.0f} samples/s over "
                     f"{_float(summary.get('seconds')):,.1f} s")
    elif np.isfinite(rates).any():
        facts.append(f"**Throughput**: median {np.nanmedian(rates):,.0f} samples/s (so far)")
    memory = (summary or {}).get("peak_memory_mb_per_rank")
    if isinstance(memory, list) and memory:
        kind = "CUDA memory allocated" if "cuda" in str(start.get("device")) else "process RSS"
        facts.append(f"**Peak memory** ({kind}): {max(memory):,.0f} MB "
                     f"(per rank: {', '.join(f'{m:,.0f}' for m in memory)})")
    return facts


def _stop_reason(run: Run) -> str:
    stopped, summary = run.last("stopped"), run.last("summary")
    if stopped is not None:
        return str(stopped.get("reason", "a `stopped` event without a reason"))
    if summary is not None and isinstance(summary.get("stopped"), str):
        return summary["stopped"]
    if summary is None:
        return "no summary logged: training is in progress, or was interrupted (`--resume`)"
    if summary.get("stopped_early"):
        return f"reached --target-auc {run.config.get('target_auc')}"
    limit = run.config.get("max_steps")
    return f"finished ({f'--max-steps {limit}' if limit else 'all epochs'})"


def _config_table(run: Run) -> list[str]:
    if not run.config:
        return ["config.json is missing."]
    defaults = _flat(flatten(TrainConfig(data="-", out="-").to_json_dict()))
    rows = [(k, v, defaults.get(k, "(not a field of this version)"))
            for k, v in _flat(run.config).items()
            if k not in ("data", "out") and (k not in defaults or defaults[k] != v)]
    if not rows:
        return ["Every option is at its default."]
    return ["| option | value | default |", "|---|---|---|",
            *[f"| {k} | {_cell(v)} | {_cell(d)} |" for k, v, d in rows]]


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _plan_table(path: Path) -> list[str]:
    if not path.is_file():
        return ["plan.json is missing."]
    try:
        plan = json.loads(path.read_text())
        rows = [f"| {module or '(top)'} | {table} | {p['sharding_type']} | "
                f"{p['compute_kernel']} | {p.get('ranks')} | {len(p.get('sharding_spec') or [])} |"
                for module, tables in plan.items() for table, p in tables.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"plan.json is not a readable sharding plan ({e})."]
    return ["| module | table | sharding type | kernel | ranks | shards |",
            "|---|---|---|---|---|---|", *rows]


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else "?"


def _cell(value: Any) -> str:
    return json.dumps(value).replace("|", "\\|")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def human_summary(run_dir: str | Path, evaluation: str = "test") -> str:
    """A few lines for the console: the evaluation's AUC against the teacher's, the best
    validation AUC, why training stopped, and where the report is."""
    run = read_run(run_dir)
    lines = []
    metrics = (run.evaluations.get(evaluation) or {}).get("metrics") or {}
    if metrics:
        line = f"{evaluation} AUC {_fmt(metrics.get('auc'))}, NE {_fmt(metrics.get('ne'))}"
        split = metrics.get("split")
        teacher = run.teacher_auc(split if isinstance(split, str) else evaluation)
        if teacher is not None:
            line += f"; the teacher's (best achievable) AUC {teacher:.4f}"
            auc = _number(metrics.get("auc"))
            if auc is not None and teacher > 0.5:
                line += f": {(auc - 0.5) / (teacher - 0.5):.0%} of the way from chance"
        lines.append(line)
    else:
        lines.append(f"no saved '{evaluation}' evaluation in {run.path / 'evaluations'}")
    best = run.best()
    lines.append((f"best validation AUC {_fmt(best[1])} at step {best[0]:,}" if best else
                  "no validation yet") + f"; stopped: {_stop_reason(run)}")
    report = run.path / "report.md"
    lines.append(f"report: {report} (plots in {run.path / 'plots'})" if report.is_file() else
                 f"no report yet: dlrm-app report {run.path}")
    return "\n".join(lines)


# ---- TensorBoard and the command ----------------------------------------------------------------
def write_tensorboard(run_dir: str | Path) -> Path:
    """Event files of the run's scalars under RUN/tensorboard/ (replacing earlier ones).

    Scalars: ``train/loss``, ``train/lr``, ``train/samples_per_s`` and ``validation/<key>``
    for every number of each validation event, by step. Needs the ``tensorboard`` extra.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError('write_tensorboard needs the tensorboard package: pip install -e '
                          '".[tensorboard]" (or pip install tensorboard)') from e
    run = read_run(run_dir)
    logdir = run.path / "tensorboard"
    logdir.mkdir(exist_ok=True)
    for old in logdir.glob("events.out.tfevents.*"):
        old.unlink()
    writer = SummaryWriter(log_dir=str(logdir))
    for tag, records in (("train", run.train), ("validation", run.validation)):
        for record in records:
            for key, value in record.items():
                if key not in ("step", "epoch") and _number(value) is not None:
                    writer.add_scalar(f"{tag}/{key}", value, record["step"])
    writer.close()
    return logdir
