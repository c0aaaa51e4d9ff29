"""Thread counts follow what the process may use: the choice from faked facts (affinity, cgroup
quota files, ranks per host, the environment, a count already set), hand-computed; torch set
to it; and ``dlrm-app train`` saying what it chose and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dlrm_app import threads as app_threads
from dlrm_app.data.synthetic import generate
from dlrm_app.threads import (
    ThreadChoice,
    cgroup_cpu_quota,
    choose_threads,
    env_threads,
    physical_cores,
    torch_start_counts,
)


def _choose(**facts: object) -> ThreadChoice:
    given = dict(requested=None, preset=None, env={}, affinity=8, quota=None,
                 local_world_size=1, loader_threads=0)
    given.update(facts)
    return choose_threads(**given)  # type: ignore[arg-type]


@pytest.mark.parametrize(("facts", "expected"), [
    (dict(affinity=8), 8),
    (dict(affinity=8, quota=2.0), 2),  # cpu.max 200000 100000
    (dict(affinity=8, quota=2.5), 2),  # a fraction of a CPU is not a thread's worth: floor
    (dict(affinity=8, quota=0.5), 1),
    (dict(affinity=2, quota=6.0), 2),  # the quota does not add CPUs beyond the affinity mask
    (dict(affinity=4, local_world_size=2), 2),  # 2 ranks on 4 CPUs: 2 each
    (dict(affinity=2, local_world_size=4), 1),  # more ranks than CPUs: still 1
    (dict(affinity=16, local_world_size=3, loader_threads=1), 4),  # 16 // 3 = 5, less 1
    (dict(affinity=2, loader_threads=1), 1),  # this project's 2-core machine, one rank
    (dict(affinity=1, loader_threads=1), 1),
    (dict(affinity=8, quota=2.0, loader_threads=1), 1),
])
def test_auto_choice_from_the_cpus_the_process_may_use(facts: dict, expected: int) -> None:
    choice = _choose(**facts)
    assert (choice.intra_op, choice.inter_op) == (expected, expected)
    assert choice.reason.startswith("auto: ") and "--threads N overrides" in choice.reason


def test_auto_reason_names_the_facts() -> None:
    reason = _choose(affinity=8, quota=2.0, local_world_size=2, loader_threads=1).reason
    assert reason == ("auto: 2 CPUs usable (affinity 8, cgroup quota 2 CPUs), 2 ranks on this "
                      "host, less 1 for the data loader's thread; --threads N overrides")
    assert "no cgroup quota" in _choose(affinity=8).reason


@pytest.mark.parametrize(("env", "expected"), [
    ({"OMP_NUM_THREADS": "3"}, 3),
    ({"OMP_NUM_THREADS": "4,2"}, 4),  # nested levels: the outer one
    ({"MKL_NUM_THREADS": "5"}, 5),
    ({"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "5"}, 3),
    ({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}, 1),  # torchrun's value per rank
])
def test_the_environment_wins_over_auto(env: dict[str, str], expected: int) -> None:
    choice = _choose(env=env, affinity=8)
    assert choice.intra_op == choice.inter_op == expected
    name = "OMP_NUM_THREADS" if "OMP_NUM_THREADS" in env else "MKL_NUM_THREADS"
    assert choice.reason.startswith(f"{name}={env[name]} in the environment")


@pytest.mark.parametrize("value", ["", "abc", "0", "-2", " "])
def test_unusable_environment_values_are_ignored(value: str) -> None:
    assert env_threads(value) is None
    assert _choose(env={"OMP_NUM_THREADS": value}, affinity=6).intra_op == 6


def test_the_flag_wins_then_a_count_set_before_the_run() -> None:
    env = {"OMP_NUM_THREADS": "3"}
    flag = _choose(requested=6, preset=2, env=env)
    assert (flag.intra_op, flag.reason) == (6, "--threads 6")
    preset = _choose(preset=2, env=env)
    assert preset.intra_op == 2
    assert preset.reason == "torch.set_num_threads(2) was called before the run: kept"


@pytest.mark.parametrize(("facts", "expected"), [
    (dict(requested=999, affinity=2), 2),
    (dict(requested=3, affinity=8, quota=2.5), 2),  # the quota rounded down
    (dict(requested=4, affinity=8, local_world_size=4), 2),  # 8 CPUs shared by 4 ranks
    (dict(requested=5, affinity=1), 1),
])
def test_a_flag_above_the_usable_cpus_is_capped_with_a_warning(
        facts: dict, expected: int) -> None:
    choice = _choose(**facts)
    assert (choice.intra_op, choice.inter_op) == (expected, expected)
    requested = facts["requested"]
    assert choice.reason.startswith(f"--threads {requested} capped to {expected}: ")
    assert choice.warning is not None and choice.warning.startswith(
        f"warning: --threads {requested} capped to {expected} (")
    assert "\n" not in choice.warning


def test_a_flag_within_the_usable_cpus_is_kept_without_a_warning() -> None:
    choice = _choose(requested=4, affinity=8, local_world_size=2)
    assert (choice.intra_op, choice.reason, choice.warning) == (4, "--threads 4", None)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_a_bad_flag_is_an_error(bad: object) -> None:
    with pytest.raises(ValueError, match="--threads must be a positive int"):
        _choose(requested=bad)


def test_describe_is_one_line() -> None:
    line = ThreadChoice(1, 1, "--threads 1").describe()
    assert line == "threads: 1 intra-op, 1 inter-op (--threads 1)"


# ---- the cgroup CPU quota, from faked /proc/self/cgroup and /sys/fs/cgroup -------------------
def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self_cgroup"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(self_cgroup, "0::/\n")
    _write(root / "cpu.max", "200000 100000\n")
    assert cgroup_cpu_quota(root, self_cgroup) == 2.0
    _write(root / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(root, self_cgroup) is None


def test_cgroup_v2_nested_limits_take_the_smallest(tmp_path: Path) -> None:
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self_cgroup"
    _write(root / "cgroup.controllers", "cpu\n")
    _write(self_cgroup, "0::/job/step\n")
    _write(root / "job" / "step" / "cpu.max", "150000 100000\n")
    _write(root / "job" / "cpu.max", "100000 100000\n")
    assert cgroup_cpu_quota(root, self_cgroup) == 1.0


def test_cgroup_v2_in_a_container_reads_its_root(tmp_path: Path) -> None:
    """The path names the host's hierarchy, not mounted here: the mount's root is the
    container's own cgroup."""
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self_cgroup"
    _write(root / "cgroup.controllers", "cpu\n")
    _write(self_cgroup, "0::/kubepods/pod1/abc\n")
    _write(root / "cpu.max", "300000 100000\n")
    assert cgroup_cpu_quota(root, self_cgroup) == 3.0


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self_cgroup"
    _write(self_cgroup, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    folder = root / "cpu,cpuacct" / "docker" / "abc"
    _write(folder / "cpu.cfs_quota_us", "150000\n")
    _write(folder / "cpu.cfs_period_us", "100000\n")
    (root / "unified").mkdir()
    assert cgroup_cpu_quota(root, self_cgroup) == 1.5
    _write(folder / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(root, self_cgroup) is None


def test_no_cgroup_files_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path / "none", tmp_path / "missing") is None


def test_physical_cores_count_distinct_cores(tmp_path: Path) -> None:
    for cpu, (package, core) in enumerate([(0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 0)]):
        _write(tmp_path / f"cpu{cpu}" / "topology" / "physical_package_id", f"{package}\n")
        _write(tmp_path / f"cpu{cpu}" / "topology" / "core_id", f"{core}\n")
    (tmp_path / "cpufreq").mkdir()
    assert physical_cores(tmp_path) == 3
    assert physical_cores(tmp_path / "none") is None
    assert torch_start_counts({"OMP_NUM_THREADS": "3"}, tmp_path) == {3}


# ---- torch set to the choice, in this process ------------------------------------------------
@pytest.fixture
def torch_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Facts of a 4-CPU machine without a quota, one rank, no thread variables; torch's count
    restored afterwards."""
    before = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(app_threads, "allowed_cpus", lambda: 4)
    monkeypatch.setattr(app_threads, "cgroup_cpu_quota", lambda: None)
    monkeypatch.setattr(app_threads, "torch_start_counts", lambda: {4})
    monkeypatch.setattr(app_threads, "_applied", None)
    yield
    torch.set_num_threads(before)


def test_configure_sets_torch_and_respects_a_count_set_before(torch_threads: None) -> None:
    torch.set_num_threads(4)  # torch's start value on this faked machine
    assert app_threads.configure_threads().intra_op == 3 == torch.get_num_threads()
    # its own earlier choice is not "set by the user": the next run chooses again
    assert app_threads.configure_threads(2).intra_op == 2 == torch.get_num_threads()
    assert app_threads.configure_threads().intra_op == 3 == torch.get_num_threads()
    torch.set_num_threads(1)  # by the program that calls train
    kept = app_threads.configure_threads()
    assert kept.intra_op == 1 == torch.get_num_threads()
    assert kept.reason.startswith("torch.set_num_threads(1) was called before the run")


# ---- dlrm-app train reports its choice -------------------------------------------------------
@pytest.mark.slow
def test_train_prints_and_logs_its_thread_choice(tmp_path: Path) -> None:
    data, run = tmp_path / "data", tmp_path / "run"
    generate(data, rows=1_000, num_dense=2, cardinalities=[20, 10], pooling_factors=[1.0, 1.0],
             zipf_alpha=1.05, seed=0, rows_per_shard=1_000, row_group_size=250)
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-m", "dlrm_app", "train", "--data", str(data), "--out", str(run),
         "--embedding-dim", "4", "--dense-arch-layer-sizes", "8-4", "--over-arch-layer-sizes",
         "8-1", "--batch-size", "64", "--max-steps", "2", "--patience", "0"],
        capture_output=True, text=True, env={**env, "PYTHONWARNINGS": "ignore"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    expected = choose_threads(requested=None, preset=None, env={},
                              affinity=app_threads.allowed_cpus(),
                              quota=app_threads.cgroup_cpu_quota())
    lines = [line for line in proc.stderr.splitlines() if line.startswith("threads: ")]
    assert lines == [expected.describe()], proc.stderr
    start = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert (start["threads"], start["threads_reason"]) == (expected.intra_op, expected.reason)
