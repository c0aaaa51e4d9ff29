"""An installed FBGEMM that fails to import (built for another torch: an undefined symbol) is a
notice, not a crash: one warning line saying why and which FBGEMM matches this torch, every
path on the pure-torch kernels, and ``dlrm-app info`` reporting the same reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SYMBOL = "_ZN3c1010TensorImpl17set_autograd_metaESt10unique_ptr"
PROGRAM = """
import pytest
import torch
from recsys_core import EmbeddingBagConfig, KeyedJaggedTensor
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from recsys_core.kernels import fbgemm_available, fbgemm_status
from recsys_core.kernels.config import EmbOptimType
ebc = FusedEmbeddingBagCollection(
    [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
    optimizer_type=EmbOptimType.EXACT_SGD, optimizer_kwargs={"learning_rate": 0.1})
out = ebc(KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([2])))
out.values().sum().backward()
print(fbgemm_available(), tuple(out.values().shape), fbgemm_status())
"""


def _broken_fbgemm(tmp: Path) -> dict[str, str]:
    package = tmp / "fbgemm_gpu"
    package.mkdir()
    (package / "__init__.py").write_text(
        f"raise ImportError('/site-packages/fbgemm_gpu/fbgemm_gpu_py.so: undefined symbol: {SYMBOL}')\n")
    env = {k: v for k, v in os.environ.items() if k != "RECSYS_CORE_DISABLE_FBGEMM"}
    return {**env, "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT)]), "PYTHONWARNINGS": "default"}


def test_a_broken_fbgemm_is_one_warning_and_the_torch_kernels_run(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                          env=_broken_fbgemm(tmp_path), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    available, shape, status = proc.stdout.strip().split(" ", 2)
    assert (available, shape) == ("False", "(1,")  # the tuple prints as "(1, 4)"
    assert f"undefined symbol: {SYMBOL}" in status and "pure-torch kernels" in status
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if release == "2.13":
        assert "fbgemm-gpu-cpu==1.8.0" in status
    notices = [line for line in proc.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(notices) == 1 and "fbgemm_gpu is installed but failed to import" in notices[0]


def test_info_reports_why_fbgemm_is_not_used(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dlrm_app", "info", "--json"],
                          capture_output=True, text=True, env=_broken_fbgemm(tmp_path),
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["fbgemm_gpu"] is None
    assert "undefined symbol" in report["fbgemm_status"]
    assert all(v.startswith("torch") for v in report["fused_kernels"].values())


def test_the_extras_install_the_fbgemm_of_the_torch_the_notice_names() -> None:
    """pyproject's extras and the notice's table agree: [cpu]/[cuda] (and the -torch214 names)
    for torch 2.14, the newest supported, which a machine without torch gets; the -torch213
    ones for torch 2.13; each pinning the FBGEMM release built for that torch, and the notice
    names the CPU extra of the running torch."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from recsys_core.kernels._fbgemm import CPU_EXTRA, MATCHING_FBGEMM, _how_to_get

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {"2.13": [("cpu-torch213", "cuda-torch213")],
             "2.14": [("cpu", "cuda"), ("cpu-torch214", "cuda-torch214")]}
    assert set(names) == set(MATCHING_FBGEMM) == set(CPU_EXTRA)
    for release, pairs in names.items():
        assert CPU_EXTRA[release] == pairs[0][0]
        assert f'pip install -e ".[{pairs[0][0]}]"' in _how_to_get(release)
        for cpu, cuda in pairs:
            assert extras[cpu] == [f"fbgemm-gpu-cpu=={MATCHING_FBGEMM[release]}"]
            assert extras[cuda] == [f"fbgemm-gpu=={MATCHING_FBGEMM[release]}"]
    assert "no FBGEMM release here is built for torch 2.15" in _how_to_get("2.15")
