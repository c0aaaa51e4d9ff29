"""The machine a plan is for: the memory this process can really use, read from the OS.

``Topology()``'s defaults are TorchRec's constants (32 GiB of HBM and 128 GiB of host memory
per rank), not this machine's; a model that fits them may not fit here. These functions
read what is free now:

    host_memory()     MemAvailable of /proc/meminfo, bounded by the process's cgroup limit
                      (v2 ``memory.max - memory.current``, v1 ``memory.limit_in_bytes -
                      memory.usage_in_bytes``, reclaimable page cache not counted as used);
                      os.sysconf's physical memory where /proc/meminfo is missing
    device_memory()   free memory of a CUDA device (torch.cuda.mem_get_info)
    disk_space()      free space of the filesystem holding a directory (shutil.disk_usage)
    detect_topology() a Topology with those as ``ddr_cap`` and ``hbm_cap`` (per rank: a host's
                      memory is split evenly over its ranks), and on CPU, given an
                      ``offload_dir``, its free disk as ``ssd_cap`` (split the same way)
    smallest_over_ranks()  every rank reads its own machine; plan for the smallest reading

The file locations are parameters so tests (and unusual systems) can point them elsewhere.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from recsys_core.planner.topology import Topology
from recsys_core.planner.units import format_bytes

MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
_HOST_READ = "this host's available memory, read by detect_topology: "
# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 bytes on x86-64)
_UNLIMITED = 2**62


@dataclass(frozen=True, kw_only=True)
class MemoryReading:
    """Bytes of memory available to this process, and how that figure was obtained."""

    available: int
    """Bytes free for this process now."""
    source: str
    """Where the figure comes from, for messages (e.g. ``"MemAvailable 20.00 GiB in
    /proc/meminfo, bounded by the cgroup v2 limit ... to 7.00 GiB"``)."""

    def __post_init__(self) -> None:
        if self.available < 0:
            raise ValueError(f"MemoryReading: available {self.available} bytes must be >= 0")


def host_memory(
    *,
    meminfo: str | os.PathLike[str] = MEMINFO,
    cgroup_root: str | os.PathLike[str] = CGROUP_ROOT,
    proc_cgroup: str | os.PathLike[str] = PROC_CGROUP,
) -> MemoryReading:
    """Host memory this process may still use: the kernel's MemAvailable, or less where a cgroup
    (a container, a Slurm job) limits the process.

    Args:
        meminfo: the ``/proc/meminfo`` file.
        cgroup_root: where cgroups are mounted (v2: ``memory.max`` under it; v1: under
            ``memory/``).
        proc_cgroup: the ``/proc/self/cgroup`` file naming this process's cgroup.
    """
    available, source = _meminfo_available(Path(meminfo))
    room = _cgroup_room(Path(cgroup_root), _cgroup_paths(Path(proc_cgroup)))
    if room is not None and room[0] < available:
        available = room[0]
        source = f"{source}, bounded by {room[1]} to {_gib(available)}"
    return MemoryReading(available=available, source=source)


def device_memory(device: torch.device | str | int | None = None) -> MemoryReading:
    """Free memory of a CUDA device now (``torch.cuda.mem_get_info``); default: the current one."""
    if not torch.cuda.is_available():
        raise ValueError(
            "device_memory: CUDA is not available, so there is no device memory to read; plan "
            "for compute_device='cpu', or give the memory per rank explicitly (memory_per_rank)"
        )
    if isinstance(device, int):
        index = device
    else:
        chosen = torch.device("cuda" if device is None else device)
        if chosen.type != "cuda":
            raise ValueError(f"device_memory: {chosen} is not a CUDA device")
        index = torch.cuda.current_device() if chosen.index is None else chosen.index
    free, total = torch.cuda.mem_get_info(index)
    return MemoryReading(
        available=int(free),
        source=f"{_gib(free)} free of {_gib(total)} on cuda:{index} (torch.cuda.mem_get_info)",
    )


def disk_space(directory: str | os.PathLike[str]) -> MemoryReading:
    """Free bytes of the filesystem holding ``directory`` now (``shutil.disk_usage``: what an
    unprivileged process may still write there)."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(
            f"disk_space: {str(path)!r} is not an existing directory; create the directory for "
            "the offloaded tables' files first (on a local disk), or pass one that exists"
        )
    usage = shutil.disk_usage(path)
    return MemoryReading(
        available=int(usage.free),
        source=f"{_gib(usage.free)} free of {_gib(usage.total)} on the filesystem of {path} "
               "(shutil.disk_usage)",
    )


def detect_topology(
    world_size: int,
    compute_device: str | None = None,
    *,
    local_world_size: int | None = None,
    memory_per_rank: int | None = None,
    device: torch.device | str | int | None = None,
    host: MemoryReading | None = None,
    hbm: MemoryReading | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
) -> Topology:
    """A Topology whose memory is this machine's, as free now (bandwidths: Topology's defaults).

    CPU ranks: the host's available memory (:func:`host_memory`) split evenly over the host's
    ranks is ``ddr_cap`` (per rank). CUDA ranks: the device's free memory
    (:func:`device_memory`) is ``hbm_cap``; the host's, split over its ranks, ``ddr_cap`` (for
    UVM tables). Every host is assumed to look like
    this one; :func:`smallest_over_ranks` takes the smallest over all ranks' readings.

    Args:
        world_size: number of ranks.
        compute_device: "cpu" or "cuda" (default: CUDA when available).
        local_world_size: ranks per host (default: ``LOCAL_WORLD_SIZE`` as torchrun sets it,
            else all ranks on one host).
        memory_per_rank: bytes per rank of the compute device's memory (host memory on CPU,
            HBM on CUDA); given, it wins over what is read (nothing is read for it).
        device: the CUDA device to read (default: the current one).
        host: a reading to use instead of :func:`host_memory` (e.g. from other files).
        hbm: a reading to use instead of :func:`device_memory`.
        offload_dir: CPU only: the directory (on a local disk) that will hold the files of
            tables too large for memory; its filesystem's free space (:func:`disk_space`),
            split evenly over the host's ranks, is ``ssd_cap``. None: no disk tier
            (``ssd_cap`` 0), every table must fit in memory.
    """
    shape = Topology.default(world_size, compute_device)
    if local_world_size is not None:
        shape = Topology(world_size, shape.compute_device, local_world_size=local_world_size)
    local = shape.local_size
    if memory_per_rank is not None and (
        isinstance(memory_per_rank, bool) or not isinstance(memory_per_rank, int)
        or memory_per_rank <= 0
    ):
        raise ValueError(
            f"detect_topology: memory_per_rank must be a positive int (bytes per rank), got "
            f"{memory_per_rank!r}"
        )
    override = None if memory_per_rank is None else (
        f"memory_per_rank {_gib(memory_per_rank)} given explicitly (not read from the machine)"
    )
    if offload_dir is not None and shape.is_cuda:
        raise ValueError(
            f"detect_topology: offload_dir {str(offload_dir)!r} on CUDA; the disk tier is for CPU "
            "ranks (on CUDA, cached tables live in host memory, ddr_cap): leave offload_dir None "
            "or plan for compute_device='cpu'"
        )
    if not shape.is_cuda:
        if memory_per_rank is not None:
            ddr_cap, source = memory_per_rank, str(override)
        else:
            reading = host or host_memory()
            ddr_cap, source = reading.available // local, f"{_HOST_READ}{reading.source}"
            if local > 1:
                source += f", shared by {local} ranks on the host"
        ssd_cap = 0
        if offload_dir is not None:
            disk = disk_space(offload_dir)
            ssd_cap = disk.available // local
            source += f"; disk for offloaded tables: {disk.source}"
            if local > 1:
                source += f", shared by {local} ranks on the host"
        return dataclasses.replace(shape, ddr_cap=ddr_cap, ssd_cap=ssd_cap, memory_source=source)
    host_reading = host or host_memory()
    if memory_per_rank is not None:
        hbm_cap, hbm_source = memory_per_rank, override
    else:
        hbm_reading = hbm or device_memory(device)
        hbm_cap, hbm_source = hbm_reading.available, hbm_reading.source
    return dataclasses.replace(
        shape, hbm_cap=hbm_cap, ddr_cap=host_reading.available // local,
        memory_source=f"HBM: {hbm_source}; host memory: {_HOST_READ}{host_reading.source}"
        + (f", shared by {local} ranks on the host" if local > 1 else ""),
    )


def smallest_over_ranks(topology: Topology, pg: dist.ProcessGroup | None = None) -> Topology:
    """``topology`` with each rank's memory the smallest that any rank of ``pg`` read.

    Collective: every rank of ``pg`` calls it with its own reading (e.g. from
    :func:`detect_topology`); all return the same Topology. A plan must fit on every host, not
    only on the one that plans."""
    world = dist.get_world_size(pg)
    gathered: list[Topology | None] = [None] * world
    dist.all_gather_object(gathered, topology, group=pg)
    readings = [t for t in gathered if t is not None]
    if len({(t.hbm_cap, t.ddr_cap, t.ssd_cap) for t in readings}) == 1:  # e.g. explicit budgets
        first = readings[0]
        return dataclasses.replace(topology, hbm_cap=first.hbm_cap, ddr_cap=first.ddr_cap,
                                   ssd_cap=first.ssd_cap, memory_source=first.memory_source)
    if topology.is_cuda:
        rank = min(range(world), key=lambda r: readings[r].hbm_per_rank)
    else:
        rank = min(range(world), key=lambda r: readings[r].ddr_per_rank)
    ddr_rank = min(range(world), key=lambda r: readings[r].ddr_per_rank)
    chosen, least_ddr = readings[rank], readings[ddr_rank]
    ssd_rank = min(range(world), key=lambda r: readings[r].ssd_per_rank)
    least_ssd = readings[ssd_rank]
    source = f"the smallest of {world} ranks' readings, rank {rank}'s: {chosen.memory_source}"
    if least_ddr.ddr_cap < chosen.ddr_cap:
        source += f"; host memory {_gib(least_ddr.ddr_cap)} per rank as read on rank {ddr_rank}"
    if least_ssd.ssd_per_rank < chosen.ssd_per_rank:
        source += f"; disk {_gib(least_ssd.ssd_per_rank)} per rank as read on rank {ssd_rank}"
    return dataclasses.replace(topology, hbm_cap=chosen.hbm_cap, ddr_cap=least_ddr.ddr_cap,
                               ssd_cap=least_ssd.ssd_per_rank, memory_source=source)


# ---- readers ------------------------------------------------------------------------------------
def _gib(value: float) -> str:
    return format_bytes(value)


def _meminfo_available(path: Path) -> tuple[int, str]:
    try:
        for line in path.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == "MemAvailable":
                value = int(rest.split()[0]) * 1024  # the kernel writes kB (KiB)
                return value, f"MemAvailable {_gib(value)} in {path}"
    except (OSError, ValueError, IndexError):
        pass
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return physical, f"physical memory {_gib(physical)} (os.sysconf; no MemAvailable in {path})"


def _cgroup_paths(path: Path) -> dict[str, str]:
    """``{"v2": path, "memory": path}`` of this process's cgroups, from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, where = parts
        if hierarchy == "0" and not controllers:
            paths["v2"] = where
        elif "memory" in controllers.split(","):
            paths["memory"] = where
    return paths


def _ancestors(mount: Path, cgroup: str) -> list[Path]:
    """The cgroup's directory and its parents up to the mount, those that exist. Inside a
    container the path /proc names may not exist under the mount (the mount is the container's
    own cgroup): then only the mount's root is left."""
    parts = [p for p in cgroup.split("/") if p]
    dirs = [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_room(root: Path, paths: dict[str, str]) -> tuple[int, str] | None:
    """The least room left under any memory limit of this process's cgroup and its parents.

    Used memory counts the page cache a cgroup can drop (``inactive_file``) as free, as the
    kubelet's working set does: a cgroup full of a dataset's cached pages is not out of memory."""
    best: tuple[int, str] | None = None
    if (root / "cgroup.controllers").exists():  # v2 (unified) hierarchy mounted at the root
        layout = [(d, "memory.max", "memory.current", "inactive_file", "cgroup v2")
                  for d in _ancestors(root, paths.get("v2", "/"))]
    else:
        mount = root / "memory"
        layout = [(d, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file",
                   "cgroup v1") for d in _ancestors(mount, paths.get("memory", "/"))]
    for directory, limit_name, usage_name, cache_key, version in layout:
        limit = _read_int(directory / limit_name)
        if limit is None or limit >= _UNLIMITED:
            continue
        used = max(0, (_read_int(directory / usage_name) or 0)
                   - _stat(directory / "memory.stat", cache_key))
        room = max(0, limit - used)
        if best is None or room < best[0]:
            best = (room, f"the {version} limit {limit_name} {_gib(limit)} - {_gib(used)} used "
                          f"in {directory}")
    return best
