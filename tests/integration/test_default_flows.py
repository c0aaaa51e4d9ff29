"""The README's flows with default flags on the real samples, as a new user runs them:

    dlrm-app preprocess criteo|movielens SRC --out DATA
    [torchrun --standalone --nproc-per-node 2 -m] dlrm-app train --data DATA --out RUN
    [torchrun ...] dlrm-app evaluate RUN
    dlrm-app export RUN --out model.pt2
    dlrm-app serve model.pt2        (the test split's rows posted; served AUC == evaluated AUC)

on the Criteo Kaggle 10k sample and MovieLens 100K, on 1 rank and on 2 ranks. No tuning flag
anywhere: table sizes come from the data, the batch size from the row count, the kept model is
the best validation checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from shared_data import KAGGLE_10K, ML100K

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import quality  # noqa: E402  (bench/ is a folder of scripts, not a package)

from dlrm_app.data.loader import ParquetLoader  # noqa: E402
from dlrm_app.data.schema import DatasetSpec  # noqa: E402
from dlrm_app.data.synthetic import binary_auc  # noqa: E402

pytestmark = pytest.mark.slow

SOURCES = {"criteo": KAGGLE_10K, "movielens": ML100K}
AUC_FLOOR = {"criteo": 0.70, "movielens": 0.74}
"""Test AUC the defaults must reach: well above what broken defaults gave (0.48-0.57 on the
Kaggle sample with 40M-row hashed tables and 4 steps), below what they measure: on the Kaggle
sample the default DLRM (one epoch) measured 0.746-0.763 over seeds 0-2 and 1-2 ranks and a
logistic regression on the same rows 0.758; on MovieLens 100K 0.764-0.775 and 0.771
(bench/quality.py)."""


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _cli(nproc: int, *args: str, timeout: float = 600) -> dict:
    cmd = [sys.executable, "-m", "dlrm_app", *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(nproc), "-m", "dlrm_app", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=list(SOURCES))
def dataset(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[str, Path]:
    kind = request.param
    source = SOURCES[kind]
    out = tmp_path_factory.mktemp(kind) / "data"
    _cli(1, "preprocess", kind, str(source), "--out", str(out))
    return kind, out


def _served_auc(kind: str, data: Path, model: Path) -> tuple[float, int]:
    """Start `dlrm-app serve`, post every test row, return (AUC of the answers, rows)."""
    if kind == "criteo":
        # the Kaggle split is by row order: the test split is the file's last rows
        rows = DatasetSpec.load(data).split("test").rows
        lines = KAGGLE_10K.read_text().splitlines()[-rows:]
        labels = [int(line.split("\t", 1)[0]) for line in lines]
        payloads = [{"rows": lines[i:i + 256], "labeled": True} for i in range(0, rows, 256)]
    else:
        (batch,) = ParquetLoader(data, "test", batch_size=1 << 20, drop_last=False,
                                 shuffle=False, prefetch=0)
        sparse = {k: jt.to_dense() for k, jt in batch.sparse.to_dict().items()}
        instances = [{"dense": batch.dense[i].tolist(),
                      "sparse": {k: [int(v) for v in bags[i]] for k, bags in sparse.items()}}
                     for i in range(len(batch.labels))]
        labels = [int(v) for v in batch.labels.tolist()]
        payloads = [{"instances": instances[i:i + 256]} for i in range(0, len(instances), 256)]
    proc = subprocess.Popen([sys.executable, "-m", "dlrm_app", "serve", str(model), "--port", "0",
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env())
    try:
        port = json.loads(proc.stdout.readline())["port"]
        probabilities: list[float] = []
        for payload in payloads:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/predict", data=json.dumps(payload).encode(),
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                probabilities += json.loads(response.read())["probabilities"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    import numpy as np

    assert len(probabilities) == len(labels)
    return float(binary_auc(np.array(probabilities), np.array(labels))), len(labels)


@pytest.mark.shared_data(KAGGLE_10K, ML100K)
@pytest.mark.parametrize("nproc", [1, 2])
def test_default_flow(dataset: tuple[str, Path], nproc: int, tmp_path: Path) -> None:
    kind, data = dataset
    run = tmp_path / "run"
    summary = _cli(nproc, "train", "--data", str(data), "--out", str(run), "--quiet")
    assert summary["world_size"] == nproc
    assert summary["steps"] >= 20  # the batch size follows the data: enough steps to learn
    assert summary["best_step"] > 0 and Path(summary["checkpoint"]).name == \
        (run / "checkpoints" / "best").read_text().strip()
    assert (run / "report.md").is_file() and (run / "plots" / "validation.png").is_file()
    test = _cli(nproc, "evaluate", str(run))
    assert test["split"] == "test" and test["checkpoint"] == summary["checkpoint"]
    assert test["auc"] > AUC_FLOOR[kind], test
    if kind == "criteo" and nproc == 1:
        # The README's claim: with no flags, the default DLRM is level with a logistic
        # regression (L2 chosen on validation) on the same rows and split of the Kaggle sample:
        # within 0.02 AUC on its 715 test rows, about one standard error there (seeds 0-2
        # measured 0.762 / 0.757 / 0.746 against 0.758; on 10k held-out rows, 5 folds x 3 seeds,
        # bench/quality.py --kfold 5 measures the gap at 0.003)
        baseline = quality.logistic_regression(data)["logistic_regression"]
        assert test["auc"] > baseline["auc"] - 0.02, (test, baseline)
    artifact = _cli(1, "export", str(run), "--out", str(tmp_path / "model.pt2"))
    assert artifact["checkpoint"] == summary["checkpoint"]
    assert artifact["format"] == "pt2" and artifact["embedding_dtype"] == "int8"
    served, rows = _served_auc(kind, data, tmp_path / "model.pt2")
    assert rows == test["num_examples"]
    assert served == pytest.approx(test["auc"], abs=0.001)  # int8 tables
