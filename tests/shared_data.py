"""The shared real-data samples, found relative to the repository: ``../shared/data`` from its
root (the Criteo Kaggle and 1TB samples, MovieLens 100K).

Tests that read a sample carry ``@pytest.mark.shared_data(path)``. When the path is missing the
test is skipped on a developer machine, and fails under ``CI=true``: CI must never pass by
silently not running the real-data tests.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
CRITEO = SHARED_DATA / "criteo"
KAGGLE_10K = CRITEO / "kaggle_head_10k.tsv"
ML100K = SHARED_DATA / "movielens" / "ml-100k"
