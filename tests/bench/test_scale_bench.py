"""bench/scale.py's sizes and generated rows: the Criteo 1TB tables' bytes from their
cardinalities, and its fast TSV writer against bench/preprocess.py's ``write_tsv``."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import preprocess  # noqa: E402  (bench/ is a folder of scripts, not a package)
import scale  # noqa: E402


def test_criteo_1tb_tables_bytes() -> None:
    rows = scale.criteo_1tb_tables(None)
    assert len(rows) == 26 and sum(rows) == 177_944_275
    # dim 64: 64 fp32 weights + one fp32 row-wise Adagrad state per row = 260 bytes
    assert scale.tables_bytes(rows, 64) == 177_944_275 * 260 == 46_265_511_500
    # the reference DLRM's 40M cap binds on features 0, 19 and 21 (45.8M, 48.9M, 40.1M ids)
    capped = scale.criteo_1tb_tables(40_000_000)
    assert sum(capped) == 177_944_275 - 5_833_188 - 8_937_457 - 94_537 == 163_079_093
    assert capped.count(40_000_000) == 3


def test_write_chunk_matches_write_tsv(tmp_path: Path) -> None:
    preprocess.write_tsv(tmp_path / "slow.tsv", 3000, seed=5, ids="skewed")
    scale.write_chunk(tmp_path / "fast.tsv", 3000, seed=5)
    slow = (tmp_path / "slow.tsv").read_bytes()
    assert slow.count(b"\n") == 3000 and slow.count(b"\t") == 3000 * 39
    assert (tmp_path / "fast.tsv").read_bytes() == slow
