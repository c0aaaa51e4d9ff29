"""``dlrm-app demo``: the quick start, end to end on generated data with no flags.

1. ``generate``: a small Criteo-shaped synthetic dataset (13 dense, 26 sparse features) whose
   labels come from a hidden teacher; its AUC is the best any model can reach.
2. ``train``: a small DLRM (fused row-wise Adagrad tables, Adagrad dense) for one epoch.
3. ``evaluate``: AUC, NE, logloss on the test split, printed next to the teacher's AUC.
4. ``export``: an int8 TorchScript artifact, ready for ``dlrm-app serve``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlrm_app.config import TrainConfig
from dlrm_app.data.schema import DatasetSpec
from dlrm_app.data.synthetic import generate
from dlrm_app.evaluate import evaluate_checkpoint
from dlrm_app.export import export_model
from dlrm_app.model import ModelConfig
from dlrm_app.train import train

DEMO_MODEL = ModelConfig(embedding_dim=16, dense_arch_layer_sizes=(64, 16),
                         over_arch_layer_sizes=(128, 64, 1))
DEMO_CARDINALITY = 1_000
DEMO_BATCH = 1024
DEMO_ROWS = 500_000


def run_demo(out: Path, rows: int = DEMO_ROWS, steps: int | None = None,
             progress: bool = True) -> dict[str, Any]:
    data, run = out / "data", out / "run"
    if not (data / "dataset.json").is_file():
        generate(data, rows=rows, num_dense=13, cardinalities=[DEMO_CARDINALITY] * 26,
                 pooling_factors=[1.0] * 26, zipf_alpha=1.05, seed=0,
                 rows_per_shard=1_000_000, row_group_size=DEMO_BATCH * 8)
    spec = DatasetSpec.load(data)
    config = TrainConfig(data=str(data), out=str(run), model=DEMO_MODEL, batch_size=DEMO_BATCH,
                         max_steps=steps, embedding_learning_rate=0.05, learning_rate=0.02,
                         log_every=20)
    summary = train(config, progress=progress)
    test = evaluate_checkpoint(run, split="test")
    artifact = export_model(run, out / "model_int8.pt", "int8")
    return {
        "data": str(data),
        "run": str(run),
        "train_samples_per_s": round(summary["samples_per_s"]),
        "train_seconds": round(summary["seconds"], 1),
        "validation_auc": summary["validation"]["auc"],
        "test_auc": test["auc"],
        "test_ne": test["ne"],
        "test_logloss": test["logloss"],
        "best_achievable_test_auc": spec.parameters["teacher_auc"]["test"],
        "exported": artifact["path"],
        "exported_bytes": artifact["bytes"],
        "serve": f"dlrm-app serve {artifact['path']}",
    }
