"""bench/offload.py's cases, run in-process on small tables: the counters it prints add up
(bytes moved = rows moved x row bytes), the cache warms to full before measuring, Zipf ids hit
more than uniform ones, and the cached case's uniform hit rate is about its load factor."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import offload  # noqa: E402  (bench/ is a folder of scripts, not a package)

from recsys_core.kernels.cached_tbe import BOOKKEEPING_BYTES_PER_ROW, BOOKKEEPING_BYTES_PER_SLOT  # noqa: E402


def args(case: str, skew: str, tmp: Path) -> argparse.Namespace:
    # 4 tables x 20k rows, dim 16 (68 bytes a row with the row-wise Adagrad state); a budget
    # of the runtime allowance, the per-row bookkeeping and a quarter of the rows as slots
    rows = 4 * 20_000
    budget = offload.RUNTIME_BYTES + rows * (BOOKKEEPING_BYTES_PER_ROW + 0.25 * (68 + BOOKKEEPING_BYTES_PER_SLOT))
    return argparse.Namespace(
        tables=4, rows=20_000, dim=16, batch=512, budget_gib=budget / 2**30,
        steps=4, warmup=2, max_warmup=60, zipf=1.05, offload_dir=str(tmp), quick=False,
        case=case, skew=skew, skip=0,
    )


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("offload")
    return {skew: offload.run_case(args("cached", skew, tmp)) for skew in ("zipf", "uniform")}


def test_cache_is_full_before_measuring_and_counters_add_up(cached: dict[str, dict]) -> None:
    for r in cached.values():
        assert r["load_factor"] == pytest.approx(0.25, abs=1e-3), r
        assert r["measured_from_step"] >= 2 and r["prefetched_share"] == 1.0, r
        row_bytes = 4 * (16 + 1)
        # every miss evicts a row that was trained (the cache is full): as many bytes back out
        assert r["read_mb_per_step"] == pytest.approx(r["written_mb_per_step"], rel=0.05), r
        misses_per_step = r["read_mb_per_step"] * 1e6 / row_bytes
        assert misses_per_step <= 4 * 512, r
        assert r["samples_per_s"] > 0 and r["peak_rss_gib"] > 0.1


def test_zipf_hits_more_than_uniform(cached: dict[str, dict]) -> None:
    uniform, zipf = cached["uniform"], cached["zipf"]
    # uniform ids over the table: a full cache of load factor f holds a row with probability f
    assert uniform["id_hit_rate"] == pytest.approx(uniform["load_factor"], abs=0.05)
    assert zipf["id_hit_rate"] > uniform["id_hit_rate"] + 0.2
    assert zipf["read_mb_per_step"] < uniform["read_mb_per_step"]
