"""The DLRM training benchmark runs its torchrun jobs and reports well-formed, consistent lines;
its instrumented (phase-split) step trains exactly like the real step it stands for.

No timing thresholds: only structure, non-negative times, and sums and ratios that must hold
by construction.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import train as bench  # noqa: E402  (bench/ is a folder of scripts, not a package)

from dlrm_app.data.schema import DatasetSpec  # noqa: E402
from dlrm_app.data.synthetic import generate  # noqa: E402
from dlrm_app.training.config import TrainConfig  # noqa: E402
from recsys_core.testing import run_gloo  # noqa: E402

# every test here reads torchrun runs of the benchmark (minutes on a 2-core machine)
pytestmark = pytest.mark.slow

WORLDS = (1, 2)
PRECISIONS = ("fp32",)
"""The precisions the smoke run asks for (bf16 is the same jobs with --amp: left out to keep
CI's time)."""
OURS_PHASES = {"data", "input_dist", "lookup", "output_dist", "dense_forward", "dense_backward",
               "embedding_backward", "grad_allreduce", "optimizer"}
BASELINE_PHASES = OURS_PHASES - {"input_dist", "output_dist"}


@pytest.fixture(scope="module")
def output() -> list[dict]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "train.py"), "--quick", "--tables", "4",
         "--precisions", ",".join(PRECISIONS)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def lines(output: list[dict]) -> dict[tuple[str, int, str], dict]:
    runs = [line for line in output if line["bench"] == "dlrm_train"]
    assert len(runs) == 2 * len(WORLDS) * len(PRECISIONS), output
    return {(line["impl"], line["world_size"], line["precision"]): line for line in runs}


def test_floor_lines(output: list[dict]) -> None:
    floors = {line["precision"]: line for line in output if line["bench"] == "dlrm_train_floor"}
    assert set(floors) == set(PRECISIONS)
    quick, tables = bench.QUICK, 4
    # the quick model's products by hand: bottom 13-32-16, top (16 + 4*5/2)-64-32-1, batch 128,
    # each as forward + two gradients (3 GEMMs of 2*B*k*n flops) but the first layer's (no
    # input gradient: 2), and Z Z^T of [B, 5, 16] + its one-product gradient
    widths = [(13, 32), (32, 16), (16 + 10, 64), (64, 32), (32, 1)]
    flops = 3 * sum(2 * quick["batch_size"] * k * n for k, n in widths)
    flops -= 2 * quick["batch_size"] * 13 * 32
    flops += 2 * 2 * quick["batch_size"] * (tables + 1) ** 2 * 16
    for line in floors.values():
        assert line["gflop_per_step"] == pytest.approx(flops / 1e9, abs=1e-4)
        assert line["floor_ms"] > 0 and line["floor_cpu_ms"] > 0 and line["threads"] == 1
        assert line["gflop_per_s"] == pytest.approx(flops / 1e6 / line["floor_ms"], rel=0.02)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("impl", [bench.OURS, bench.BASELINE])
def test_line(lines: dict[tuple[str, int, str], dict], impl: str, world: int,
              precision: str) -> None:
    line = lines[(impl, world, precision)]
    quick = bench.QUICK
    assert line["bench"] == "dlrm_train" and line["device"] == "cpu" and line["backend"] == "gloo"
    assert line["step_over_floor"] == pytest.approx(line["step_ms"] / line["floor_ms"], abs=0.01)
    assert line["cpu_over_floor"] == pytest.approx(
        line["cpu_ms_per_step"] / line["floor_cpu_ms"], abs=0.01)
    assert line["tables"] == 4 and line["rows_per_table"] == quick["rows_per_table"]
    assert line["batch_size_per_rank"] == quick["batch_size"]
    assert line["global_batch"] == world * quick["batch_size"]
    assert line["steps"] == quick["steps"] and line["threads_per_rank"] == 1
    assert line["step_ms"] > 0 and line["samples_per_s"] > 0
    assert line["samples_per_s"] == pytest.approx(
        line["global_batch"] / line["step_ms"] * 1e3, rel=0.01)
    phases = line["phase_ms"]
    assert set(phases) == (OURS_PHASES if impl == bench.OURS else BASELINE_PHASES)
    assert all(v >= 0 for v in phases.values())
    # each phase is rounded to 0.01 ms
    assert sum(phases.values()) == pytest.approx(line["phased_step_ms"], abs=0.01 * len(phases))
    assert line["phased_step_ms"] > 0
    peaks = line["peak_memory_mb_per_rank"]
    assert len(peaks) == world and all(p > 0 for p in peaks) and line["peak_memory_mb"] == peaks[0]
    assert line["first_step_loss"] > 0 and line["mean_loss"] > 0
    assert ("ratio_to_baseline" in line) == (impl == bench.OURS)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("world", WORLDS)
def test_same_model_and_ratio(lines: dict[tuple[str, int, str], dict], world: int,
                              precision: str) -> None:
    ours, base = lines[(bench.OURS, world, precision)], lines[(bench.BASELINE, world, precision)]
    # same initial weights, same first batch: the same loss before any update (bf16 rounds
    # the products of both alike)
    assert ours["first_step_loss"] == pytest.approx(base["first_step_loss"], abs=1e-5)
    assert ours["ratio_to_baseline"] == pytest.approx(
        ours["samples_per_s"] / base["samples_per_s"], rel=0.01)
    fp32_base = lines[(bench.BASELINE, world, "fp32")]
    assert ours["ratio_to_fp32_baseline"] == pytest.approx(
        ours["samples_per_s"] / fp32_base["samples_per_s"], rel=0.01)
    assert sum(ours["plan"].values()) == 4
    # bf16 rounds the dense products: another first loss than fp32, but close to it
    fp32 = lines[(bench.OURS, world, "fp32")]["first_step_loss"]
    assert ours["first_step_loss"] == pytest.approx(fp32, rel=0.02)
    assert (ours["first_step_loss"] == fp32) == (precision == "fp32")


# ---- the instrumented step is the real step ------------------------------------------------------
def _train(rank: int, world_size: int, data: str) -> dict[tuple[str, bool, bool], dict]:
    """Parameters after 3 real / 3 instrumented steps of each implementation, same start, in
    fp32 and with bf16 autocast."""
    args = bench.parse_args(["--quick", "--data", data])
    spec = DatasetSpec.load(data)
    out = {}
    for (impl, cls), amp, phased in itertools.product(bench.IMPLS.items(), (False, True),
                                                      (False, True)):
        config = TrainConfig.from_flags(data=data, out="/dev/null", model=bench.model_config(args),
                                        batch_size=args.batch_size, amp=amp)
        model = cls(config, spec, torch.device("cpu"))
        loader = bench.ParquetLoader(data, "train", batch_size=args.batch_size, rank=rank,
                                     world_size=world_size, shuffle=True, prefetch=0)
        if phased:
            batches = bench.forever(loader)
            clock = bench.PhaseClock(torch.device("cpu"))
            for _ in range(3):
                model.phased_step(batches, clock)
        else:
            model.run(loader, 3)
        if isinstance(model, bench.Ours):  # dense; step 3's depend on steps 1-2's tables
            params = dict(model.dmp.named_parameters())
        else:
            params = model.model.state_dict()
        out[(impl, amp, phased)] = {k: v.detach().clone() for k, v in params.items()}
        del model
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict[tuple[str, bool], dict]]:
    data = tmp_path_factory.mktemp("data")
    generate(data, rows=2000, cardinalities=[50] * 3, pooling_factors=[1.0] * 3,
             row_group_size=128)
    return run_gloo(2, _train, str(data))


@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("impl", [bench.OURS, bench.BASELINE])
def test_phased_step_trains_like_the_real_step(trained: list[dict], impl: str, amp: bool) -> None:
    for rank, result in enumerate(trained):
        real, phased = result[(impl, amp, False)], result[(impl, amp, True)]
        assert amp or all((real[k] != result[(impl, True, False)][k]).any() for k in real
                          if "embedding" not in k and "weight" in k), "bf16 trained alike"
        assert real.keys() == phased.keys() and real
        for name, value in real.items():
            torch.testing.assert_close(phased[name], value, rtol=1e-5, atol=1e-6,
                                       msg=f"{impl} rank {rank} {name}")
