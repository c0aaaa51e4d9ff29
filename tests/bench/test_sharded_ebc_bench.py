"""The sharded EBC benchmark runs under torchrun (2 gloo ranks) and reports what it should.

A tiny one-hot configuration makes every byte count hand-computable: 4 tables of
[1000, 583, 1000, 1000] rows, dim 8, 64 samples per rank, one int64 id and one int64 length per
(feature, sample), fp32 pooled rows. Only row-wise input traffic depends on the ids (which row
block each id falls in); it is counted from the same seeded batches the benchmark uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from ebc import make_batch  # noqa: E402  (bench/ is a folder of scripts, not a package)

ROWS, BATCH, DIM, WORLD = [1000, 583, 1000, 1000], 64, 8, 2
ID, LEN, F32 = 8, 8, 4  # bytes of an int64 id, an int64 length, an fp32 value
ARGS = ["--max-rows", "1000", "--batch-size", "64", "--dim", "8", "--tables", "4",
        "--iters", "1", "--warmup", "1", "--pooling", "1", "--seed", "0"]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # torchrun
    proc = subprocess.run(
        ["bash", str(ROOT / "launch" / "bench_sharded_ebc.sh"), *ARGS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {line["impl"]: line for line in lines}


def rw_remote_ids(rank: int) -> int:
    """Ids of ``rank``'s batch that live in the other rank's row block (blocks of ceil(rows/2))."""
    kjt = make_batch(ROWS, BATCH, 1, seed=rank)
    remote = 0
    for jt, rows in zip(kjt.to_dict().values(), ROWS, strict=True):
        ids, block = jt.values(), -(-rows // WORLD)
        remote += int((ids >= block).sum()) if rank == 0 else int((ids < block).sum())
    return remote


def expected_bytes(kind: str) -> dict[str, tuple[list[int], list[int] | None]]:
    """(per-rank send buffer, per-rank remote part) of each collective, by hand."""
    feature = BATCH * (LEN + ID)  # one feature's lengths + ids of one rank's batch
    zero = ([0, 0], [0, 0])
    if kind == "tw":  # 2 tables per rank; each feature goes to one rank
        return {
            "input_dist": ([4 * feature] * 2, [2 * feature] * 2),
            # pooled [2 * 64, 2 tables * 8] sent half to each rank; reverse: [64, 4 * 8]
            "output_dist": ([2 * BATCH * 16 * F32] * 2, [BATCH * 16 * F32] * 2),
            "backward": ([BATCH * 32 * F32] * 2, [BATCH * 16 * F32] * 2),
            "dp_allreduce": ([0, 0], None),
        }
    if kind == "cw":  # every feature to both ranks; 4 column blocks of 4 per rank
        return {
            "input_dist": ([8 * feature] * 2, [4 * feature] * 2),
            "output_dist": ([2 * BATCH * 16 * F32] * 2, [BATCH * 16 * F32] * 2),
            "backward": ([BATCH * 32 * F32] * 2, [BATCH * 16 * F32] * 2),
            "dp_allreduce": ([0, 0], None),
        }
    if kind == "rw":  # lengths to both ranks, each id to its row's rank
        lengths = 4 * BATCH * LEN
        return {
            "input_dist": (
                [2 * lengths + 4 * BATCH * ID] * 2,
                [lengths + rw_remote_ids(r) * ID for r in range(WORLD)],
            ),
            # reduce-scatter input [2 * 64, 32]; all-gather input [64, 32] to the other rank
            "output_dist": ([2 * BATCH * 32 * F32] * 2, [BATCH * 32 * F32] * 2),
            "backward": ([BATCH * 32 * F32] * 2, [BATCH * 32 * F32] * 2),
            "dp_allreduce": ([0, 0], None),
        }
    # dp: per table, the most rows any rank touched (one feature per table here), gathered as
    # int64 id + fp32 row when 2 * that < rows, else a dense [rows, dim + 1] fp32 all-reduce
    batches = [make_batch(ROWS, BATCH, 1, seed=r).to_dict() for r in range(WORLD)]
    dp = 0
    for i, rows in enumerate(ROWS):
        most = max(int(torch.unique(list(b.values())[i].values()).numel()) for b in batches)
        dp += most * (8 + DIM * F32) if WORLD * most < rows else rows * (DIM + 1) * F32
    return {
        "input_dist": zero, "output_dist": zero, "backward": zero,
        "dp_allreduce": ([dp] * 2, None),
    }


LOCAL_PARAMS = {  # rows * cols held by each rank
    "tw": [(1000 + 583) * DIM, 2000 * DIM],  # snake placement: t0, t1 on rank 0; t2, t3 on 1
    "rw": [(500 + 292 + 500 + 500) * DIM, (500 + 291 + 500 + 500) * DIM],
    "cw": [sum(ROWS) * DIM // 2] * 2,
    "dp": [sum(ROWS) * DIM] * 2,
}


@pytest.mark.slow
def test_unsharded_baseline_line(results: dict[str, dict]) -> None:
    base = results["unsharded_fused"]
    assert base["world_size"] == 1 and base["batch_size_per_rank"] == BATCH
    assert base["step_ms"] > 0 and base["samples_per_s"] > 0
    assert base["tables"] == 4 and base["total_rows"] == sum(ROWS) and base["dim"] == DIM


@pytest.mark.parametrize("kind", ["tw", "rw", "cw", "dp"])
@pytest.mark.slow
def test_sharded_line(results: dict[str, dict], kind: str) -> None:
    line = results[f"sharded_{kind}"]
    assert line["world_size"] == WORLD and line["backend"] == "gloo"
    assert line["step_ms"] > 0 and line["speedup_vs_unsharded"] > 0
    assert line["samples_per_s"] == pytest.approx(WORLD * BATCH / line["step_ms"] * 1e3, rel=0.02)
    phases = line["phases_ms"]
    assert set(phases) == {"input_dist", "lookup", "output_dist", "backward"}
    assert all(v > 0 for v in phases.values())
    assert "serialized" in line["phases_measured"]
    assert line["ids_per_rank"] == [4 * BATCH] * WORLD
    assert line["local_params_per_rank"] == LOCAL_PARAMS[kind]
    if kind == "dp":
        assert line["kernel_backends_per_rank"] == [["torch"]] * WORLD
    got = line["bytes_per_step"]
    for name, (per_rank, remote) in expected_bytes(kind).items():
        assert got[name]["per_rank"] == per_rank, name
        assert got[name]["total"] == sum(per_rank), name
        assert got[name]["remote_per_rank"] == remote, name
        assert got[name]["remote_total"] == (None if remote is None else sum(remote)), name
