"""The commands keep per-step buffers for reuse (``reuse_freed_memory``, set by
``init_distributed``): a 40 MB tensor allocated and freed step after step is taken again from
the heap with no page faulted in once warm, and the process's memory stays bounded; glibc's
default unmaps it at every free (above its 32 MiB limit) and faults 10,240 pages in each time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = """
import json, resource, sys, torch
from dlrm_app.training.runtime import init_distributed
if sys.argv[1] == "reuse":
    init_distributed()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
for _ in range(20):  # warm-up: the heap settles
    x = torch.ones(10 << 20)
    del x
start, base = faults(), rss_mb()
for _ in range(20):
    x = torch.ones(10 << 20)
    del x
print(json.dumps({"faults_per_step": (faults() - start) / 20,
                  "rss_growth_mb": rss_mb() - base}))
"""
PAGES = (10 << 20) * 4 // 4096  # 10,240 pages of 4 KiB per 40 MB tensor


def _run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.slow
def test_freed_step_buffers_are_reused_without_page_faults() -> None:
    from dlrm_app.training.runtime import reuse_freed_memory

    assert reuse_freed_memory() is True  # glibc here
    default, reuse = _run("default"), _run("reuse")
    assert default["faults_per_step"] > 0.9 * PAGES, default
    assert reuse["faults_per_step"] < 0.01 * PAGES, reuse
    assert abs(reuse["rss_growth_mb"]) < 50, reuse  # reused, not grown
