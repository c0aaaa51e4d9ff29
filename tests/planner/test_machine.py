"""Reading the machine: MemAvailable, cgroup v1/v2 limits, overrides, CUDA, and all ranks' minimum.

Detection reads fake /proc/meminfo and cgroup files written to tmp_path (the file locations are
parameters of host_memory), so the values are exact wherever the tests run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from recsys_core.planner import (
    MemoryReading,
    Topology,
    detect_topology,
    device_memory,
    host_memory,
    smallest_over_ranks,
)
from recsys_core.testing import run_gloo

GIB = 1024**3
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 writes for "no limit" on x86-64


def meminfo(tmp_path: Path, available: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(
        f"MemTotal:       {64 * GIB // 1024} kB\nMemFree:        {GIB // 1024} kB\n"
        f"MemAvailable:   {available // 1024} kB\nBuffers:          1024 kB\n"
    )
    return path


def cgroup_v2(tmp_path: Path, limits: dict[str, tuple[str, int]], own: str = "/") -> tuple[Path, Path]:
    """A cgroup2 mount with ``{relative dir: (memory.max, memory.current)}`` and the
    /proc/self/cgroup line naming ``own``."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    for where, (limit, current) in limits.items():
        directory = root / where
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "memory.max").write_text(f"{limit}\n")
        (directory / "memory.current").write_text(f"{current}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"0::{own}\n")
    return root, proc


def cgroup_v1(tmp_path: Path, limit: int, usage: int, own: str = "/") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    memory = root / "memory"
    memory.mkdir(parents=True)
    (memory / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (memory / "memory.usage_in_bytes").write_text(f"{usage}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"12:pids:/x\n4:memory:{own}\n1:name=systemd:/x\n")
    return root, proc


def test_meminfo_alone_gives_mem_available(tmp_path: Path) -> None:
    reading = host_memory(meminfo=meminfo(tmp_path, 20 * GIB), cgroup_root=tmp_path / "none",
                          proc_cgroup=tmp_path / "none")
    assert reading.available == 20 * GIB
    assert "MemAvailable 20.00 GiB" in reading.source


def test_cgroup_v2_limit_bounds_mem_available_and_splits_over_local_ranks(tmp_path: Path) -> None:
    root, proc = cgroup_v2(tmp_path, {"": ("8589934592", GIB)})  # 8 GiB limit, 1 GiB used
    reading = host_memory(meminfo=meminfo(tmp_path, 20 * GIB), cgroup_root=root, proc_cgroup=proc)
    assert reading.available == 7 * GIB
    assert "cgroup v2" in reading.source and "memory.max 8.00 GiB" in reading.source
    topology = detect_topology(2, "cpu", local_world_size=2, host=reading)
    assert (topology.ddr_cap, topology.ddr_per_rank, topology.hbm_per_rank) == (3.5 * GIB, 3.5 * GIB, 0)
    assert "7.00 GiB" in topology.memory_source and "shared by 2 ranks" in topology.memory_source


def test_cgroup_v2_parent_limit_and_reclaimable_page_cache(tmp_path: Path) -> None:
    # own cgroup: no limit; its parent (the job): 6 GiB of which 5 GiB used, 3 GiB of it a
    # page cache the kernel can drop (inactive_file) -> 4 GiB of room
    root, proc = cgroup_v2(tmp_path, {"job/step": ("max", 2 * GIB), "job": (str(6 * GIB), 5 * GIB)},
                           own="/job/step")
    (root / "job" / "memory.stat").write_text(f"anon 100\ninactive_file {3 * GIB}\nactive_file 7\n")
    reading = host_memory(meminfo=meminfo(tmp_path, 20 * GIB), cgroup_root=root, proc_cgroup=proc)
    assert reading.available == 4 * GIB
    assert str(root / "job") in reading.source


def test_cgroup_limit_above_mem_available_changes_nothing(tmp_path: Path) -> None:
    root, proc = cgroup_v2(tmp_path, {"": (str(64 * GIB), GIB)})
    reading = host_memory(meminfo=meminfo(tmp_path, 20 * GIB), cgroup_root=root, proc_cgroup=proc)
    assert reading.available == 20 * GIB and "bounded by" not in reading.source


@pytest.mark.parametrize(("limit", "expected"), [(8 * GIB, 7 * GIB), (V1_UNLIMITED, 20 * GIB)])
def test_cgroup_v1_limit_in_bytes(tmp_path: Path, limit: int, expected: int) -> None:
    # the container's own path is not under the mount (it is the mount's root): the root counts
    root, proc = cgroup_v1(tmp_path, limit, GIB, own="/docker/0123abcd")
    reading = host_memory(meminfo=meminfo(tmp_path, 20 * GIB), cgroup_root=root, proc_cgroup=proc)
    assert reading.available == expected


def test_without_meminfo_falls_back_to_physical_memory(tmp_path: Path) -> None:
    reading = host_memory(meminfo=tmp_path / "missing", cgroup_root=tmp_path / "none",
                          proc_cgroup=tmp_path / "none")
    assert reading.available == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert "physical memory" in reading.source


def test_memory_per_rank_override_wins(tmp_path: Path) -> None:
    reading = MemoryReading(available=7 * GIB, source="fake")
    cpu = detect_topology(4, "cpu", local_world_size=2, memory_per_rank=3 * GIB, host=reading)
    assert (cpu.ddr_per_rank, cpu.num_hosts) == (3 * GIB, 2)
    assert "given explicitly" in cpu.memory_source
    cuda = detect_topology(2, "cuda", local_world_size=2, memory_per_rank=5 * GIB, host=reading,
                           hbm=MemoryReading(available=70 * GIB, source="fake hbm"))
    assert (cuda.hbm_per_rank, cuda.ddr_cap) == (5 * GIB, 3.5 * GIB)  # the host's 7 GiB over 2 ranks


def test_cuda_topology_takes_device_and_host_readings() -> None:
    topology = detect_topology(
        8, "cuda", local_world_size=4, host=MemoryReading(available=100 * GIB, source="host"),
        hbm=MemoryReading(available=30 * GIB, source="30 GiB free on cuda:0"),
    )
    assert (topology.hbm_per_rank, topology.ddr_per_rank, topology.num_hosts) == (30 * GIB, 25 * GIB, 2)
    assert "30 GiB free on cuda:0" in topology.memory_source


@pytest.mark.parametrize("bad", [0, -GIB, 1.5 * GIB, True])
def test_bad_override_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="memory_per_rank"):
        detect_topology(1, "cpu", memory_per_rank=bad)  # type: ignore[arg-type]


def test_topology_constructor_keeps_torchrec_defaults() -> None:
    assert Topology(world_size=1, compute_device="cpu").ddr_cap == 128 * GIB
    assert Topology(world_size=1, compute_device="cuda").hbm_cap == 32 * GIB


def test_this_machine_is_read() -> None:
    topology = detect_topology(1, "cpu")
    assert 0 < topology.ddr_cap <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert topology.memory_source


@pytest.mark.gpu
def test_cuda_device_memory_is_read() -> None:
    free, total = torch.cuda.mem_get_info(0)
    reading = device_memory(0)
    assert 0 < reading.available <= total
    assert abs(reading.available - free) < GIB  # free memory moves a little between reads
    topology = detect_topology(1, "cuda", device=torch.device("cuda", 0))
    assert 0 < topology.hbm_cap <= total and "cuda:0" in topology.memory_source


def smallest_worker(rank: int, world: int) -> tuple[int, str]:
    mine = detect_topology(world, "cpu", host=MemoryReading(
        available=(8 - 2 * rank) * GIB, source=f"fake reading of rank {rank}"))
    agreed = smallest_over_ranks(mine, dist.group.WORLD)
    return agreed.ddr_cap, agreed.memory_source or ""


def test_every_rank_plans_for_the_smallest_reading() -> None:
    results = run_gloo(2, smallest_worker)
    assert results[0] == results[1]
    ddr, source = results[0]
    assert ddr == 3 * GIB and "rank 1" in source  # rank 1's 6 GiB host over its 2 ranks and "fake reading of rank 1" in source
