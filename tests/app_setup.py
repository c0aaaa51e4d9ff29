"""What the app's tests share: the two shapes of generated dataset they train on (sized per
test), the small model they train, Criteo-shaped raw lines for the preprocessing tests, and
stopping a running ``dlrm-app train`` by a signal.

``two_feature_data``: 2 dense features, categoricals of 50 and 20 ids, one id a row (the CLI,
message and preemption tests: a few steps each). ``four_feature_data``: 4 dense features,
categoricals of 500, 2000, 50 and 1000 ids, the third 3 ids a row (the training and export
tests: enough signal to learn). Both Zipf 1.05, seed 0 unless a test asks otherwise.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from dlrm_app.data.synthetic import generate
from dlrm_app.model import ModelConfig

SMALL_MODEL = ModelConfig(embedding_dim=8, dense_arch_layer_sizes=(16, 8),
                          over_arch_layer_sizes=(16, 1))


def two_feature_data(out: Path, *, rows: int, seed: int = 0, **sizes: Any) -> Path:
    """``rows`` rows of the 2-feature shape written to ``out``; ``sizes``: row_group_size,
    rows_per_shard, days, drift (``generate``'s)."""
    generate(out, rows=rows, num_dense=2, cardinalities=[50, 20], pooling_factors=[1.0, 1.0],
             zipf_alpha=1.05, seed=seed, **sizes)
    return out


def four_feature_data(out: Path, *, rows: int, seed: int = 0, **sizes: Any) -> Path:
    """``rows`` rows of the 4-feature shape written to ``out``; ``sizes`` as above."""
    generate(out, rows=rows, num_dense=4, cardinalities=[500, 2000, 50, 1000],
             pooling_factors=[1.0, 1.0, 3.0, 1.0], zipf_alpha=1.05, seed=seed, **sizes)
    return out


def criteo_lines(rows: int, seed: int, *, ids: int, lowest_dense: int = 0,
                 bad: tuple[int, ...] = ()) -> list[str]:
    """Criteo-shaped lines: label, 13 dense values (geometric, from ``lowest_dense`` up), 26
    categoricals (hex of ids below ``ids``); a tenth of the values empty and 0 to 2 trailing
    fields stripped; 0-based rows in ``bad`` get the label 2."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(rows):
        dense = [str(v) if rng.random() > 0.1 else ""
                 for v in rng.geometric(0.05, 13) - 1 + lowest_dense]
        cats = [f"{v:08x}" if rng.random() > 0.1 else "" for v in rng.integers(0, ids, 26)]
        fields = ["2" if i in bad else str(rng.integers(0, 2)), *dense, *cats]
        lines.append("\t".join(fields[:40 - int(rng.integers(0, 3))]))
    return lines


def stopped_step(proc: subprocess.Popen[str], sig: signal.Signals, run: Path,
                 exit_code: int) -> int:
    """Send ``sig`` to ``proc``, a running ``dlrm-app train --out run``: it exits with
    ``exit_code``, its last line naming the step it stopped after, that step's checkpoint and
    the command that resumes from it. Returns that step."""
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == exit_code, err[-2000:]
    line = err.strip().splitlines()[-1]
    match = re.fullmatch(
        rf"dlrm-app train: stopped by {sig.name} after step (\d+); checkpoint step_(\d{{8}}) "
        r"saved: `dlrm-app train --out (\S+) --resume` continues from it", line)
    assert match, line
    assert int(match[2]) == int(match[1]) and match[3] == str(run)
    return int(match[1])
