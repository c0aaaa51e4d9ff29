"""The ranks a plan is for (:class:`Topology`): how many, their memory, their links' bandwidth.

Units, as TorchRec's: bytes for memory (per rank), bytes per millisecond for bandwidths.
"""

from __future__ import annotations

import os
from dataclasses import KW_ONLY, dataclass, field

import torch

from recsys_core.planner.comms import (
    BasicCommsBandwidths,
    CustomTopologyData,
    GeneralizedCommsBandwidth,
)
from recsys_core.planner.constants import (
    CROSS_NODE_BANDWIDTH,
    DDR_MEM_BW,
    HBM_MEM_BW,
    HBM_TO_DDR_MEM_BW,
    INTRA_NODE_BANDWIDTH,
    SSD_MEM_BW,
    WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER,
)
from recsys_core.planner.context_hash import hash_sha256_to_int
from recsys_core.planner.storage import DeviceHardware, Perf, Storage, Tier

GIB = 1024**3
GB = 1000**3


# Defaults of a Topology, per rank. Bandwidths are in bytes per MILLISECOND, as TorchRec's
# (torchrec/distributed/planner/constants.py); sources there and vendor data sheets, rounded.
DEFAULT_HBM_CAP = 32 * GIB  # TorchRec's HBM_CAP
DEFAULT_DDR_CAP = 128 * GIB  # TorchRec's DDR_CAP (per rank)
MS = 1000  # bytes/s -> bytes/ms
DEFAULT_HBM_MEM_BW = 897 * GB / MS  # HBM_MEM_BW (in GB): effective for random row gathers
# DDR_MEM_BW (in GB): host-memory row reads by a CPU kernel or over UVM. With
# NS_PER_UPDATED_ROW it matches FBGEMM-CPU step times within ~30% on the development VM
# (bench/planner.py).
DEFAULT_DDR_MEM_BW = 51 * GB / MS
DEFAULT_CUDA_INTRA_HOST_BW = 600 * GB / MS  # INTRA_NODE_BANDWIDTH (NVLink)
# gloo over loopback TCP between the processes of one host: 0.97 GB/s per rank measured for a
# 64 MiB all-to-all between 2 ranks on the 2-vCPU development VM (bigger hosts do better).
DEFAULT_CPU_INTRA_HOST_BW = 1 * GB / MS
DEFAULT_INTER_HOST_BW = 12.5 * GB / MS  # CROSS_NODE_BANDWIDTH (a 100 Gb/s NIC per rank)
# Local disk under the backing files of cached tables on CPU (TorchRec's SSD_MEM_BW is 100 MiB/s):
# the bytes of missed rows read plus evicted rows written back, per second of step time they
# add. bench/offload.py on the 2-vCPU development VM (rows of 260 bytes, pread/pwrite, files
# served by the page cache): 8.9 MB per step added 53 ms (Zipf ids), 15.9 MB added 99 ms
# (uniform), 0.16-0.17 GB/s. Random small rows make this a latency figure, not a bandwidth one.
DEFAULT_SSD_MEM_BW = 0.16 * GB / MS
# TorchRec's BWD_COMPUTE_MULTIPLIER: backward scatters gradients and the fused optimizer
# read-modify-writes every touched row, about twice the forward's memory traffic.
DEFAULT_BWD_COMPUTE_MULTIPLIER = 2.0

# TorchRec's constant for each bandwidth field (GiB-based, bytes/ms): what TorchRec's estimators
# and its TopologyFactory use where a bandwidth is left out.
TORCHREC_BANDWIDTHS: dict[str, float] = {
    "hbm_mem_bw": HBM_MEM_BW,
    "ddr_mem_bw": DDR_MEM_BW,
    "ssd_mem_bw": SSD_MEM_BW,
    "hbm_to_ddr_mem_bw": HBM_TO_DDR_MEM_BW,
    "intra_host_bw": INTRA_NODE_BANDWIDTH,
    "inter_host_bw": CROSS_NODE_BANDWIDTH,
}


@dataclass(frozen=True)
class Topology:
    """The ranks a model is planned for: how many, what memory each has, how fast links are.

    Positional arguments follow TorchRec's order: ``Topology(8, "cuda", 40 * GIB)`` is 8 GPUs
    of 40 GiB on one host; ``Topology(world_size=8, compute_device="cuda")`` has 32 GiB each
    (TorchRec's default). On a CPU topology memory is DDR, ``ddr_cap`` per rank, and ``hbm_cap``
    is 0. A CPU topology may also have local disk, ``ssd_cap`` per rank: tables that do not fit
    in memory then live in files there behind a cache in RAM (the FUSED_UVM_CACHING kernel);
    ``detect_topology(offload_dir=...)`` reads a directory's free space for it.
    The defaults are TorchRec's constants, not this machine's memory:
    ``recsys_core.planner.detect_topology`` reads what this machine has free.
    """

    world_size: int
    """Number of ranks."""
    compute_device: str = "cuda"
    """Where lookups run, "cuda" or "cpu" (this also decides which kernels exist)."""
    hbm_cap: int | None = None
    """HBM bytes per rank (None: 32 GiB on CUDA, TorchRec's HBM_CAP; 0 on CPU)."""
    ddr_cap: int | None = None
    """Host memory bytes per rank (None: 128 GiB, TorchRec's DDR_CAP)."""
    ssd_cap: int | None = None
    """Local disk bytes per rank for the backing files of cached tables (TorchRec's SSD tier).
    On CPU (None: 0, no disk tier: every table must fit in ddr_cap). On CUDA the cached
    kernel's slower tier is host memory (ddr_cap): a value there is only reported in
    ``devices`` (TorchRec's key-value tables), this planner's search uses no disk."""
    local_world_size: int | None = None
    """Ranks per host (None: all ranks on one host). As TorchRec, any int >= 1 is accepted;
    this planner's own search needs it to divide world_size (or to be at least world_size: one
    host)."""
    pod_size: int | None = None
    """TorchRec's hosts per NVLink domain (at most world_size): sets ``intra_group_size`` for
    TorchRec's estimators and partitioners; this planner's own search models hosts only."""
    hbm_mem_bw: float = None  # type: ignore[assignment]
    """Bytes per ms a rank's lookups read from HBM (None: 897 GB/s)."""
    ddr_mem_bw: float = None  # type: ignore[assignment]
    """Bytes per ms a rank's lookups read from host memory, CPU kernels and UVM (None: 51 GB/s).
    """
    ssd_mem_bw: float | None = None
    """Bytes per ms a rank moves between its cache and the disk tier (None: on CPU 0.16 GB/s,
    ``DEFAULT_SSD_MEM_BW``; on CUDA TorchRec's SSD_MEM_BW, read by its estimators only)."""
    hbm_to_ddr_mem_bw: float | None = None
    """TorchRec's HBM <-> host copy bandwidth, bytes/ms (None: its HBM_TO_DDR_MEM_BW); read by
    TorchRec's estimators (UVM kernels), not by this planner's own search."""
    intra_host_bw: float | None = None
    """Bytes per ms a rank sends to ranks of its host (None: 600 GB/s NVLink on CUDA, 1 GB/s
    over gloo on CPU)."""
    inter_host_bw: float = None  # type: ignore[assignment]
    """Bytes per ms a rank sends to other hosts (None: 12.5 GB/s)."""
    bwd_compute_multiplier: float = DEFAULT_BWD_COMPUTE_MULTIPLIER
    """Backward lookup traffic as a multiple of the forward's (TorchRec's default 2)."""
    custom_topology_data: CustomTopologyData | None = field(default=None, compare=False)
    """TorchRec's per-rank capacities (``hbm_cap``/``ddr_cap``/``ssd_cap`` lists): ``devices``
    takes them; this planner's own search plans for the smallest rank."""
    weighted_feature_bwd_compute_multiplier: float = WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER
    """TorchRec's extra backward work of weighted features (its perf estimator)."""
    uneven_sharding_perf_multiplier: float = 1.0
    """TorchRec's perf estimator's penalty for uneven shards."""
    generalized_comms_bandwidths: GeneralizedCommsBandwidth | None = field(
        default=None, compare=False
    )
    """TorchRec's collective bandwidth model; when given, intra_host_bw and inter_host_bw are
    its values."""
    created_by_factory: bool = field(default=False, compare=False)
    """TorchRec's TopologyFactory flag (no warning is logged either way)."""
    _: KW_ONLY
    memory_source: str | None = field(default=None, compare=False)
    """Where hbm_cap, ddr_cap and ssd_cap come from, for messages (``detect_topology`` fills it in;
    None: given to this constructor, or its TorchRec defaults)."""

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"Topology: world_size must be an int >= 1, got {self.world_size!r}")
        device = getattr(self.compute_device, "type", self.compute_device)
        if device not in ("cuda", "cpu", "mtia"):
            raise ValueError(
                f"Topology: compute_device must be 'cuda', 'cpu' or 'mtia', got {self.compute_device!r}"
            )
        object.__setattr__(self, "compute_device", device)
        local = self.world_size if self.local_world_size is None else self.local_world_size
        if isinstance(local, bool) or not isinstance(local, int) or local < 1:
            raise ValueError(
                f"Topology: local_world_size {self.local_world_size!r} must be an int >= 1 (the "
                "number of ranks per host)"
            )
        object.__setattr__(self, "local_world_size", local)
        if self.pod_size is not None and self.pod_size > self.world_size:
            raise ValueError(
                f"Topology: pod_size={self.pod_size} cannot be greater than world_size="
                f"{self.world_size}"
            )
        # TorchRec's estimators read TorchRec's constants where a bandwidth was left out (they
        # are in GiB/s, this planner's calibrated defaults in GB/s, and gloo's 1 GB/s on CPU).
        # A value equal to this planner's default counts as left out (dataclasses.replace
        # passes the resolved defaults back in).
        torchrec_bw = {
            name: TORCHREC_BANDWIDTHS[name]
            for name in ("hbm_mem_bw", "ddr_mem_bw", "intra_host_bw", "inter_host_bw")
        }
        for name, ours in (("hbm_mem_bw", DEFAULT_HBM_MEM_BW), ("ddr_mem_bw", DEFAULT_DDR_MEM_BW),
                           ("inter_host_bw", DEFAULT_INTER_HOST_BW)):
            if getattr(self, name) is None or getattr(self, name) == ours:
                object.__setattr__(self, name, ours)
            else:
                torchrec_bw[name] = getattr(self, name)
        if self.intra_host_bw not in (None, DEFAULT_CUDA_INTRA_HOST_BW, DEFAULT_CPU_INTRA_HOST_BW):
            torchrec_bw["intra_host_bw"] = self.intra_host_bw
        object.__setattr__(self, "_torchrec_bw", torchrec_bw)
        if self.hbm_to_ddr_mem_bw is None:
            object.__setattr__(self, "hbm_to_ddr_mem_bw", HBM_TO_DDR_MEM_BW)
        if self.generalized_comms_bandwidths is not None:
            object.__setattr__(self, "intra_host_bw", self.generalized_comms_bandwidths.intra_host_bw)
            object.__setattr__(self, "inter_host_bw", self.generalized_comms_bandwidths.inter_host_bw)
            self._torchrec_bw.update(intra_host_bw=self.intra_host_bw,
                                     inter_host_bw=self.inter_host_bw)
        if device != "cpu" and self.ssd_mem_bw is None:
            # Read by TorchRec's key-value estimators only: on CUDA this planner's cached tables
            # live in host memory (ddr_cap), so its own search ignores the disk tier there.
            object.__setattr__(self, "ssd_mem_bw", SSD_MEM_BW)
        ssd = 0 if self.ssd_cap is None else self.ssd_cap
        if isinstance(ssd, bool) or not isinstance(ssd, int | float) or not ssd >= 0:
            raise ValueError(
                f"Topology: ssd_cap must be a number >= 0 (bytes of local disk per rank), got "
                f"{self.ssd_cap!r}"
            )
        object.__setattr__(self, "ssd_cap", int(ssd))
        if device == "cpu":
            bw = DEFAULT_SSD_MEM_BW if self.ssd_mem_bw is None else self.ssd_mem_bw
            if isinstance(bw, bool) or not bw > 0:
                raise ValueError(f"Topology: ssd_mem_bw must be > 0 bytes/ms, got {bw!r}")
            object.__setattr__(self, "ssd_mem_bw", float(bw))
        if device == "cpu" and self.hbm_cap:
            raise ValueError(
                f"Topology: hbm_cap {self.hbm_cap} on a CPU topology; CPU ranks have no HBM, "
                "so size their memory with ddr_cap (bytes per rank)"
            )
        hbm = (DEFAULT_HBM_CAP if device != "cpu" else 0) if self.hbm_cap is None else self.hbm_cap
        ddr = DEFAULT_DDR_CAP if self.ddr_cap is None else self.ddr_cap
        for name, value in (("hbm_cap", hbm), ("ddr_cap", ddr)):
            if not value >= 0:
                raise ValueError(f"Topology: {name} must be >= 0 bytes, got {value!r}")
        object.__setattr__(self, "hbm_cap", int(hbm))
        object.__setattr__(self, "ddr_cap", int(ddr))
        if self.intra_host_bw is None:
            default = DEFAULT_CUDA_INTRA_HOST_BW if device != "cpu" else DEFAULT_CPU_INTRA_HOST_BW
            object.__setattr__(self, "intra_host_bw", default)
        for name in ("hbm_mem_bw", "ddr_mem_bw", "intra_host_bw", "inter_host_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Topology: {name} must be > 0 bytes/ms, got {getattr(self, name)!r}")
        if not self.bwd_compute_multiplier >= 0:
            raise ValueError(
                f"Topology: bwd_compute_multiplier must be >= 0, got {self.bwd_compute_multiplier!r}"
            )

    @property
    def local_size(self) -> int:
        """Ranks per host as this planner's search sees them (at most world_size)."""
        assert self.local_world_size is not None  # resolved in __post_init__
        return min(self.local_world_size, self.world_size)

    @property
    def intra_group_size(self) -> int:
        """TorchRec's largest group of ranks on fast links: pod_size hosts, else one host."""
        assert self.local_world_size is not None
        return self.local_world_size * (self.pod_size or 1)

    @property
    def comms_bandwidths(self) -> GeneralizedCommsBandwidth:
        if self.generalized_comms_bandwidths is not None:
            return self.generalized_comms_bandwidths
        return BasicCommsBandwidths(inter_host_bw=self.inter_host_bw,
                                    intra_host_bw=float(self.intra_host_bw or 0))

    def torchrec_bw(self, name: str) -> float:
        """The bandwidth ``name`` (hbm_mem_bw, ddr_mem_bw, intra_host_bw, inter_host_bw) that
        TorchRec's estimators read: the value given, else TorchRec's constant."""
        return float(self._torchrec_bw[name])  # type: ignore[attr-defined]

    @property
    def torchrec_comms_bandwidths(self) -> GeneralizedCommsBandwidth:
        """The collective bandwidth model of TorchRec's estimators (TorchRec's constants for
        the bandwidths left out)."""
        if self.generalized_comms_bandwidths is not None:
            return self.generalized_comms_bandwidths
        return BasicCommsBandwidths(inter_host_bw=self.torchrec_bw("inter_host_bw"),
                                    intra_host_bw=self.torchrec_bw("intra_host_bw"))

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_size

    @property
    def is_cuda(self) -> bool:
        return self.compute_device == "cuda"

    @property
    def hbm_per_rank(self) -> int:
        return int(self.hbm_cap or 0)

    @property
    def ddr_per_rank(self) -> int:
        return int(self.ddr_cap or 0)

    @property
    def ssd_per_rank(self) -> int:
        """Disk bytes per rank this planner's search may use: ``ssd_cap`` on CPU, 0 on CUDA."""
        return int(self.ssd_cap or 0) if self.compute_device == "cpu" else 0

    @property
    def _created_by_factory(self) -> bool:
        return self.created_by_factory

    @property
    def cache_tier(self) -> Tier:
        """The fast tier of a FUSED_UVM_CACHING table, holding its cache: HBM on CUDA, host
        memory (DDR) on CPU."""
        return Tier.HBM if self.is_cuda else Tier.DDR

    @property
    def backing_tier(self) -> Tier:
        """The slow tier of a FUSED_UVM_CACHING table, holding all its rows: host memory (DDR)
        on CUDA, local disk (SSD) on CPU."""
        return Tier.DDR if self.is_cuda else Tier.SSD

    def tier_bw(self, tier: Tier) -> float:
        """Bytes per ms a rank's lookups move from ``tier``."""
        return {Tier.HBM: self.hbm_mem_bw, Tier.DDR: self.ddr_mem_bw,
                Tier.SSD: float(self.ssd_mem_bw or DEFAULT_SSD_MEM_BW)}[tier]

    @property
    def devices(self) -> list[DeviceHardware]:
        """TorchRec's per-rank view: each rank's usable memory (``custom_topology_data``'s
        per-rank figures where given) and no load yet. One list per Topology, as TorchRec's
        (code that edits a rank's storage in place sees its edit here)."""
        devices = self.__dict__.get("_devices")
        if devices is None:
            caps = {"hbm_cap": self.hbm_per_rank, "ddr_cap": self.ddr_per_rank,
                    "ssd_cap": int(self.ssd_cap or 0)}
            per_rank = {k: [v] * self.world_size for k, v in caps.items()}
            custom = self.custom_topology_data
            for key in per_rank:
                if custom is not None and custom.has_data(key):
                    per_rank[key] = list(custom.get_data(key))
            devices = [
                DeviceHardware(rank, Storage(per_rank["hbm_cap"][rank], per_rank["ddr_cap"][rank],
                                             per_rank["ssd_cap"][rank]), Perf(0, 0, 0, 0))
                for rank in range(self.world_size)
            ]
            self.__dict__["_devices"] = devices
        return devices

    def _hash(self) -> int:
        """A hash of everything that sets a plan (TorchRec's ``Topology._hash``)."""
        return hash_sha256_to_int([
            self.world_size, self.compute_device,
            [d.storage.hbm for d in self.devices], [d.storage.ddr for d in self.devices],
            [d.storage.ssd for d in self.devices], self.local_world_size, self.intra_group_size,
            self.hbm_mem_bw, self.ddr_mem_bw, self.ssd_mem_bw, self.hbm_to_ddr_mem_bw,
            self.intra_host_bw, self.inter_host_bw, self.bwd_compute_multiplier,
            self.weighted_feature_bwd_compute_multiplier, self.uneven_sharding_perf_multiplier,
        ])

    @classmethod
    def default(cls, world_size: int, compute_device: str | None = None) -> Topology:
        """As TorchRec when no topology is given: ranks per host from ``LOCAL_WORLD_SIZE``
        (torchrun sets it), CUDA when available."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if local < 1 or world_size % local:
            local = world_size
        device = compute_device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(world_size=world_size, compute_device=device, local_world_size=local)
