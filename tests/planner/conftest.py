"""A fake machine for planning tests: /proc/meminfo and cgroup v2 files under tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from recsys_core.planner import MemoryReading, host_memory

GIB = 1024**3


@pytest.fixture
def host_7gib(tmp_path: Path) -> MemoryReading:
    """MemAvailable 20 GiB, bounded by a cgroup v2 limit of 8 GiB with 1 GiB used: 7 GiB."""
    (tmp_path / "meminfo").write_text(f"MemTotal: {32 * GIB // 1024} kB\n"
                                      f"MemAvailable: {20 * GIB // 1024} kB\n")
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "memory.max").write_text(f"{8 * GIB}\n")
    (root / "memory.current").write_text(f"{GIB}\n")
    (tmp_path / "self_cgroup").write_text("0::/\n")
    reading = host_memory(meminfo=tmp_path / "meminfo", cgroup_root=root,
                          proc_cgroup=tmp_path / "self_cgroup")
    assert reading.available == 7 * GIB
    return reading
