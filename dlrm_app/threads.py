"""How many threads torch computes with in a run: what this process may really use of the machine.

torch starts one intra-op thread per physical core of the *machine*, whatever the process may
use of it. Where that is less (a CPU affinity mask, a container's cgroup CPU quota, several
ranks on one host, the data loader's own thread), OpenMP's threads wait on each other at every
parallel op: on a 2-core machine with one other busy process, MovieLens 100K trained at 1,108
samples/s with torch's 2 threads and 12,468 with 1 (issue 28). ``train`` (and so ``demo``)
calls :func:`configure_threads` once as the run starts::

    threads: 1 intra-op, 1 inter-op (auto: 2 CPUs usable (affinity 2, no cgroup quota),
    1 rank on this host, less 1 for the data loader's thread; --threads N overrides)

What decides, first match wins (:func:`choose_threads`, pure, so tested with faked facts):

1. ``--threads N`` (``TrainConfig.threads``), capped at the usable CPUs shared by the ranks on
   this host, with a warning (more threads than CPUs only wait on each other: 999 on 2 CPUs
   trained 124x slower and loaded the host for everyone);
2. a count set in this process before the run (``torch.set_num_threads``), e.g. by a program
   that calls ``train`` or by ``recsys_core.testing.run_gloo``;
3. ``OMP_NUM_THREADS`` (then ``MKL_NUM_THREADS``) in the environment: the user's, or torchrun's
   1 per rank, which it sets when launching several ranks with the variable unset;
4. otherwise: the CPUs the process may use (affinity, capped by the cgroup quota rounded down),
   shared by the ranks on this host (``LOCAL_WORLD_SIZE``), less the loader's thread, at least 1.

The inter-op pool (``torch.jit.fork`` and the like; training does not use it) gets the same
count. Measured by ``bench/threads.py``; the numbers are in docs/benchmarks.md.

Caveat of rule 2: torch does not say whether its count was set or is its own start value, so
a count equal to one torch may start with (the machine's physical or logical CPUs, the affinity
mask's size, the environment's value) reads as "not set". Pass ``--threads N`` to be explicit.

Light module: no torch at import (the CLI's parser reads nothing from it, but keeps it cheap).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path

LOADER_THREADS = 1
"""Threads of ``ParquetLoader`` that work while training computes (its prefetch thread)."""
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
SYS_CPUS = Path("/sys/devices/system/cpu")

_applied: int | None = None
"""The intra-op count the last :func:`configure_threads` set: a later run may choose again."""


@dataclasses.dataclass(frozen=True)
class ThreadChoice:
    """Threads for torch's intra-op and inter-op pools, and why, in words."""

    intra_op: int
    inter_op: int
    reason: str
    warning: str | None = None
    """One line for the user when the request was not followed as given (capped)."""

    def describe(self) -> str:
        """The one line ``train`` prints (stderr, rank 0)."""
        return f"threads: {self.intra_op} intra-op, {self.inter_op} inter-op ({self.reason})"


def choose_threads(*, requested: int | None, preset: int | None, env: Mapping[str, str],
                   affinity: int, quota: float | None, local_world_size: int = 1,
                   loader_threads: int = LOADER_THREADS) -> ThreadChoice:
    """The threads of one rank, from the facts (see the module docstring for the order).

    ``requested``: ``--threads`` (None: not given); ``preset``: a count set in this process
    before the run (None: torch's own start value); ``affinity``: CPUs in the affinity mask;
    ``quota``: CPUs of the cgroup quota (None: no quota); ``local_world_size``: ranks on this
    host; ``loader_threads``: threads of the data loader that compute alongside.

    >>> choose_threads(requested=None, preset=None, env={}, affinity=8, quota=2.0).intra_op
    1
    """
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"--threads must be a positive int, got {requested!r}")
        cpus, ranks = usable_cpus(affinity, quota), max(1, local_world_size)
        cap = max(1, cpus // ranks)
        if requested <= cap:
            return _same(requested, f"--threads {requested}")
        where = f"{cpus} CPU{'s' if cpus > 1 else ''} usable, {ranks} rank" + (
            "s" if ranks > 1 else "") + " on this host"
        return dataclasses.replace(
            _same(cap, f"--threads {requested} capped to {cap}: {where}"),
            warning=f"warning: --threads {requested} capped to {cap} ({where}): more threads "
                    "than CPUs only wait on each other")
    if preset is not None:
        return _same(preset, f"torch.set_num_threads({preset}) was called before the run: kept")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        count = env_threads(env.get(name))
        if count is not None:
            note = "; torchrun sets 1 per rank when it is unset" if name == "OMP_NUM_THREADS" else ""
            return _same(count, f"{name}={env[name]} in the environment{note}")
    cpus = usable_cpus(affinity, quota)
    limits = f"affinity {affinity}, " + (
        "no cgroup quota" if quota is None else f"cgroup quota {quota:g} CPUs")
    ranks = max(1, local_world_size)
    per_rank = max(1, cpus // ranks)
    count = max(1, per_rank - loader_threads)
    plural = "s" if ranks > 1 else ""
    reason = (f"auto: {cpus} CPU{'s' if cpus > 1 else ''} usable ({limits}), {ranks} rank"
              f"{plural} on this host")
    if loader_threads:
        reason += (f", less {loader_threads} for the data loader's thread"
                   f"{'s' if loader_threads > 1 else ''}")
    return _same(count, reason + "; --threads N overrides")


def _same(count: int, reason: str) -> ThreadChoice:
    return ThreadChoice(intra_op=count, inter_op=count, reason=reason)


def env_threads(value: str | None) -> int | None:
    """A thread-count variable's value as OpenMP reads it (``4`` or the outer level of
    ``4,2``); None when unset, empty or not a positive int (OpenMP ignores such values)."""
    if value is None:
        return None
    try:
        count = int(value.split(",")[0].strip())
    except ValueError:
        return None
    return count if count >= 1 else None


def usable_cpus(affinity: int, quota: float | None) -> int:
    """CPUs a process may keep busy: its ``affinity`` mask's, capped by the cgroup ``quota``
    rounded down (None: no quota); at least 1."""
    cpus = max(1, affinity)
    return cpus if quota is None else min(cpus, max(1, math.floor(quota)))


def allowed_cpus() -> int:
    """CPUs this process may run on (its affinity mask; all CPUs where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> float | None:
    """CPUs the process's cgroup quota allows (``quota / period``; the smallest over its
    cgroup and the parents visible here), None without a quota. cgroup v2 ``cpu.max``
    (``200000 100000``; ``max 100000`` is none), v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
    (a quota of -1 is none)."""
    quotas = [q for d in _cgroup_dirs(root, self_cgroup) if (q := _quota(d)) is not None]
    return min(quotas) if quotas else None


def _cgroup_dirs(root: Path, self_cgroup: Path) -> list[Path]:
    """The cgroup folders that may limit this process's CPU time: its own and their parents,
    for v2 (``0::/path``) and for v1's ``cpu`` controller (``4:cpu,cpuacct:/path``)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    found: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2].strip()
        if controllers == "":  # v2: the root, or root/unified beside v1 controllers (hybrid)
            mounts = [root if (root / "cgroup.controllers").exists() else root / "unified"]
        elif "cpu" in controllers.split(","):
            mounts = [root / controllers, root / "cpu"]
        else:
            continue
        for mount in mounts:
            if mount.is_dir():
                found += _self_and_parents(mount, path)
                break
    return found or [root]


def _self_and_parents(mount: Path, path: str) -> list[Path]:
    # in a container the path may name the host's hierarchy, absent here: the mount's root is
    # then the container's own cgroup
    folder = mount / path.lstrip("/")
    chain = [folder, *folder.parents]
    inside = chain[:chain.index(mount) + 1] if mount in chain else [mount]
    return [f for f in inside if f.is_dir()]


def _quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return int(quota) / int(period) if quota != "max" and int(period) > 0 else None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((folder / "cpu.cfs_quota_us").read_text())
        period_us = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def local_world_size(env: Mapping[str, str] = os.environ) -> int:
    """Ranks on this host (``LOCAL_WORLD_SIZE``, set by torchrun and ``run_gloo``; 1 without)."""
    try:
        return max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def torch_start_counts(env: Mapping[str, str] = os.environ, sys_cpus: Path = SYS_CPUS) -> set[int]:
    """The intra-op counts torch may start with in this process: the environment's value
    where set, else the machine's physical cores (torch's rule), its logical CPUs or the
    affinity mask (MKL's). A current count outside these was set by someone."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        count = env_threads(env.get(name))
        if count is not None:
            return {count}
    return {n for n in (physical_cores(sys_cpus), os.cpu_count(), allowed_cpus()) if n}


def physical_cores(sys_cpus: Path = SYS_CPUS) -> int | None:
    """Distinct (package, core) pairs of the machine's CPUs; None where sysfs does not say."""
    cores = set()
    for topology in sys_cpus.glob("cpu[0-9]*/topology"):
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            continue
    return len(cores) or None


def configure_threads(requested: int | None = None,
                      loader_threads: int = LOADER_THREADS) -> ThreadChoice:
    """Choose this rank's threads (:func:`choose_threads` on this machine's facts) and set
    torch's pools to them, process-wide. The inter-op pool can be sized only before it first
    runs work; where it already has, it keeps its size and the reason says so."""
    global _applied
    import torch

    current = torch.get_num_threads()
    untouched = current == _applied or current in torch_start_counts()
    choice = choose_threads(
        requested=requested, preset=None if untouched else current, env=os.environ,
        affinity=allowed_cpus(), quota=cgroup_cpu_quota(),
        local_world_size=local_world_size(), loader_threads=loader_threads)
    if choice.intra_op != current:
        torch.set_num_threads(choice.intra_op)
    _applied = choice.intra_op
    if torch.get_num_interop_threads() != choice.inter_op:
        try:
            torch.set_num_interop_threads(choice.inter_op)
        except RuntimeError:  # the pool has run work (or was sized) already in this process
            kept = torch.get_num_interop_threads()
            choice = dataclasses.replace(
                choice, inter_op=kept, reason=f"{choice.reason}; inter-op pool already "
                f"started in this process, kept at {kept}")
    return choice
