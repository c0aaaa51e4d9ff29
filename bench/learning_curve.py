"""How close the default DLRM gets to the demo's teacher as the data grows: test AUC against
rows, on the `dlrm-app demo` dataset (13 dense and 26 sparse features of 1,000 ids, labels from
a hidden teacher whose own AUC is the best achievable), trained with every default.

One JSON line per row count (test AUC, the teacher's test AUC, the gap, steps, seconds), and
``teacher_form_auc``: the teacher's own functional form fitted to the same train rows
(``bench/quality.py``'s ``teacher_form``: the generator's model with unknown weights, at most as
many epochs as the DLRM, the epoch chosen on validation), i.e. what learning from this many rows
reaches with nothing left to discover; ``dlrm_minus_teacher_form`` compares the DLRM with it.
``--epochs N`` trains both N epochs at most (e.g. 1: one pass over fresh generated rows).
With ``--run RUN`` (e.g. runs/demo/run) it also writes RUN/learning_curve.json and
RUN/plots/learning_curve.png, which ``dlrm-app report RUN`` includes.

Usage: python bench/learning_curve.py [--rows 125000 250000 500000 1000000 2000000] [--run DIR]
       [--epochs N] [--no-teacher-form]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from dlrm_app.data.schema import DatasetSpec
from dlrm_app.data.synthetic import generate
from dlrm_app.demo import DEMO_CARDINALITY
from dlrm_app.reporting.report import LEARNING_CURVE, write_report
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.evaluate import evaluate_checkpoint
from dlrm_app.training.trainer import train

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import teacher_form  # noqa: E402  (bench/ is a folder of scripts)


def point(rows: int, work: Path, epochs: int | None = None, form: bool = True) -> dict:
    data, run = work / f"data_{rows}", work / f"run_{rows}"
    generate(data, rows=rows, num_dense=13, cardinalities=[DEMO_CARDINALITY] * 26,
             pooling_factors=[1.0] * 26, zipf_alpha=1.05, seed=0)
    start = time.perf_counter()
    config = TrainConfig.from_flags(data=str(data), out=str(run)).with_epochs(time_ordered=False)
    if epochs is not None:
        config = config.replace(epochs=epochs)
    summary = train(config, progress=False)
    test = evaluate_checkpoint(run, split="test")
    spec = DatasetSpec.load(data)
    teacher = (spec.teacher_auc or {})["test"]
    line = {"rows": rows, "train_rows": spec.split("train").rows,
            "epochs": config.schedule.epochs, "test_auc": test["auc"], "teacher_auc": teacher,
            "gap": teacher - test["auc"], "steps": summary["steps"],
            "stopped": summary["stopped"], "seconds": round(time.perf_counter() - start, 1)}
    if form:
        fitted = teacher_form(data, epochs=config.schedule.epochs)
        line |= {"teacher_form_auc": fitted["auc"], "teacher_form_epochs": fitted["epochs"],
                 "dlrm_minus_teacher_form": test["auc"] - fitted["auc"]}
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+",
                        default=[125_000, 250_000, 500_000, 1_000_000, 2_000_000])
    parser.add_argument("--run", type=Path, default=None,
                        help="also store the curve in this run directory for its report")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs at most (default: dlrm-app train's)")
    parser.add_argument("--no-teacher-form", action="store_true",
                        help="skip fitting the teacher's own form to each row count")
    args = parser.parse_args()
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        for rows in args.rows:
            points.append(point(rows, Path(tmp), args.epochs, not args.no_teacher_form))
            print(json.dumps(points[-1]), flush=True)
    if args.run is not None:
        (args.run / LEARNING_CURVE).write_text(json.dumps(points, indent=1) + "\n")
        print(write_report(args.run), file=sys.stderr)


if __name__ == "__main__":
    main()
