"""``dlrm-app demo``: the quick start, end to end on generated data with no flags.

1. ``generate``: a small Criteo-shaped synthetic dataset (13 dense, 26 sparse features) whose
   labels come from a hidden teacher; its AUC is the best any model can reach.
2. ``train``: the default DLRM and training flags (fused row-wise Adagrad tables, Adagrad
   dense, early stopping on validation AUC, the best checkpoint kept).
3. ``evaluate``: AUC, NE, logloss of the best checkpoint on the test split, next to the
   teacher's AUC; the run's report (``report.md`` + plots) is written.
4. ``export``: an int8 ``.pt2`` artifact (AOTInductor-compiled), ready for
   ``dlrm-app serve``.

A rerun reuses the generated data (generated again when ``--rows`` differs) and trains the run
again from scratch.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from dlrm_app.config import DEMO_ROWS
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.data.synthetic import generate
from dlrm_app.reporting.report import human_summary
from dlrm_app.serving.export import export_model, stage_printer
from dlrm_app.training.config import TrainConfig
from dlrm_app.training.evaluate import evaluate_checkpoint
from dlrm_app.training.trainer import train

DEMO_CARDINALITY = 1_000


def demo_data(data: Path, rows: int, progress: bool = True) -> DatasetSpec:
    """The demo's generated dataset in ``data``: reused when it holds exactly these rows,
    generated (again) otherwise."""
    wanted = {"rows": rows, "cardinalities": [DEMO_CARDINALITY] * 26, "seed": 0}
    if (data / "dataset.json").is_file():
        held = DatasetSpec.load(data).parameters
        if any(held.get(k) != v for k, v in wanted.items()):
            # another --rows (or an older demo): generate this one instead of reusing it
            if progress:
                print(f"demo: {data} holds {held.get('rows'):,} generated rows, not {rows:,}; "
                      f"generating them again", file=sys.stderr)
            shutil.rmtree(data)
    if not (data / "dataset.json").is_file():
        generate(data, rows=rows, num_dense=13, cardinalities=[DEMO_CARDINALITY] * 26,
                 pooling_factors=[1.0] * 26, zipf_alpha=1.05, seed=0,
                 rows_per_shard=1_000_000)
    return DatasetSpec.load(data)


def run_demo(out: Path, rows: int = DEMO_ROWS, steps: int | None = None,
             progress: bool = True, threads: int | None = None) -> dict[str, Any]:
    data, run = out / "data", out / "run"
    spec = demo_data(data, rows, progress)
    config = TrainConfig.from_flags(data=str(data), out=str(run), max_steps=steps, log_every=20,
                                    overwrite=True, threads=threads)
    summary = train(config, progress=progress)
    test = evaluate_checkpoint(run, split="test")
    # full: a demo run again into the same folder would otherwise publish its weights alone
    artifact = export_model(run, out / "model_int8.pt2", "int8", full=True,
                            progress=stage_printer("export") if progress else None)
    print(human_summary(run), file=sys.stderr)
    return {
        "data": str(data),
        "run": str(run),
        "train_samples_per_s": round(summary["samples_per_s"]),
        "train_seconds": round(summary["seconds"], 1),
        "steps": summary["steps"],
        "stopped": summary["stopped"],
        "validation_auc": summary["validation"]["auc"],
        "test_auc": test["auc"],
        "test_ne": test["ne"],
        "test_logloss": test["logloss"],
        "best_achievable_test_auc": (spec.teacher_auc or {}).get("test"),
        "exported": artifact["path"],
        "exported_bytes": artifact["bytes"],
        "report": str(run / "report.md"),
        "serve": f"dlrm-app serve {artifact['path']}",
    }
