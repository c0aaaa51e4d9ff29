"""When a model does not fit: the early check, and errors that say what is missing and why.

A :class:`PlannerError` about memory says how much the tables need (the largest ones by name),
how much each rank has, and where that figure came from (read from this machine by
``detect_topology``, given explicitly, or TorchRec's default constants). It carries the same
facts as data (:class:`MemoryShortfall`), so an application can name its own remedies (its
flags) instead of the library's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from recsys_core.planner.errors import (
    SHOWN_TABLES,
    MemoryShortfall,
    PlannerError,
    PlannerErrorType,
    TableMemory,
)
from recsys_core.planner.search.cost import (
    CPU_CACHE_ROW_BOOKKEEPING_BYTES,
    MIN_CACHE_LOAD_FACTOR,
    least_load_factor,
    storage_bytes,
)
from recsys_core.planner.search.placement import KERNEL_TIERS, Partition, TableKey
from recsys_core.planner.search.types import Candidate, TableSpec
from recsys_core.planner.storage import Tier
from recsys_core.planner.topology import DEFAULT_DDR_CAP, DEFAULT_HBM_CAP, Topology
from recsys_core.planner.units import format_bytes

REMEDIES = (
    "To fix: use smaller tables (fewer rows, a smaller embedding_dim, FP16 weights); use more "
    "ranks (row- and column-wise shards spread a table over them); or give each rank a larger "
    "memory budget where it really has more free (detect_topology(memory_per_rank=...), "
    "Topology hbm_cap / ddr_cap, a lower storage_reservation). Constraints that allow few "
    "layouts (or, on CUDA, no UVM kernels for the largest tables) make tables harder to place."
)
DISK_HINT = (
    " On CPU, tables larger than memory can live in files on local disk behind a cache in "
    "memory (the fused_uvm_caching kernel): give the Topology an ssd_cap (bytes of disk per "
    "rank) or plan with detect_topology(offload_dir=...) on a local directory, with a sharder "
    "that runs fused_uvm_caching (EmbeddingBagCollectionSharder does)."
)
DISK_REMEDIES = (
    "To fix: give each rank more disk (a larger Topology ssd_cap, or "
    "detect_topology(offload_dir=...) on a directory of a local disk with more free space); "
    "use more ranks (row-wise shards spread a table's rows, and its disk, over them); or use "
    "smaller tables (fewer rows, a smaller embedding_dim, FP16 weights)."
)
CACHE_NOTE = (
    " Tables that do not fit in memory can live on disk, but each keeps in host memory its cache "
    f"(at least {MIN_CACHE_LOAD_FACTOR:.0%} of its rows, weights and optimizer state) and "
    f"{CPU_CACHE_ROW_BOOKKEEPING_BYTES} bytes of bookkeeping per row."
)


def remedies(kind: str, topology: Topology) -> str:
    """What a user of the library can change when ``kind`` of memory is short."""
    if kind == "disk":
        return DISK_REMEDIES
    if topology.is_cuda:
        return REMEDIES
    if topology.ssd_per_rank == 0:
        return REMEDIES + DISK_HINT
    if kind == "memory (host + disk)":
        return REMEDIES + (" Or give each rank more disk (Topology ssd_cap, "
                           "detect_topology(offload_dir=...)).")
    return REMEDIES  # host memory for the caches: more disk would not help


def check_total(
    specs: Mapping[TableKey, TableSpec], options: Mapping[TableKey, Sequence[Candidate]],
    topology: Topology, hbm_budget: float, ddr_budget: float, reservation: float,
    *, ssd_budget: float = 0.0,
) -> None:
    """Raise when no placement can work: the least each table needs (of each memory, and in
    all) summed over tables, against what all ranks have together. Caches count at the
    smallest load factor the planner gives (or the one the constraints fix). A candidate that
    alone needs more of a tier than all ranks have is not counted (a table too large for all
    ranks' memory together can only be on disk, so its least disk is its whole size); where no
    candidate of a table fits, its last-resort kernel's candidates count (the cached one on
    CPU), as the partitioner would try those last."""
    world = topology.world_size
    total = world * np.array([hbm_budget, ddr_budget, ssd_budget])
    feasible = []  # per table: the least bytes per tier of each counted candidate, [tier, option]
    for opts in options.values():
        least = np.array([_least(o).sum(axis=1) for o in opts]).T
        fits = (least <= total[:, None]).all(axis=0)
        if not fits.any():
            level = np.array([KERNEL_TIERS[o.compute_kernel] for o in opts])
            fits = level == level.max()
        feasible.append(least[:, fits])

    host = ("host memory", [Tier.DDR], ddr_budget)
    if topology.is_cuda:
        kinds = [
            ("memory (HBM + host)", [Tier.HBM, Tier.DDR], hbm_budget + ddr_budget),
            ("HBM", [Tier.HBM], hbm_budget),
            host,
        ]
    elif ssd_budget > 0:
        kinds = [
            ("memory (host + disk)", [Tier.DDR, Tier.SSD], ddr_budget + ssd_budget),
            host,
            ("disk", [Tier.SSD], ssd_budget),
        ]
    else:
        kinds = [host]
    for kind, tiers, budget in kinds:
        needed = float(sum(least[tiers].sum(axis=0).min() for least in feasible))
        if needed <= world * budget:
            continue
        tables = _tables(specs, options)
        what = ("the weights and optimizer state of the tables that do not fit in memory, in "
                "their backing files" if kind == "disk" else
                "weights, optimizer state and buffers in their most compact allowed layouts")
        summary = (
            f"the model does not fit: its tables need at least {_gib(needed)} of {kind} "
            f"({what}) but {'the' if world > 1 else 'its'} {world} "
            f"rank{'s have' if world > 1 else ' has'} {_gib(world * budget)} usable: "
            f"{_gib(budget)} per rank = {_per_rank(kind, topology, reservation)}. Source of "
            f"these figures: {memory_origin(topology)}. Largest tables: {_largest(tables)}."
        )
        if kind == "host memory" and ssd_budget > 0:
            summary += CACHE_NOTE
        raise PlannerError(
            f"{summary} {remedies(kind, topology)}", PlannerErrorType.INSUFFICIENT_STORAGE,
            MemoryShortfall(
                summary=summary, memory=kind, needed_bytes=needed, usable_bytes=world * budget,
                reservation=reservation, topology=topology, tables=tables,
            ),
        )


def no_fit_error(
    specs: Mapping[TableKey, TableSpec], options: Mapping[TableKey, Sequence[Candidate]],
    failed: TableKey, partition: Partition, topology: Topology, hbm_budget: float,
    ddr_budget: float, reservation: float, *, ssd_budget: float = 0.0,
) -> PlannerError:
    """The error when table ``failed`` fits on no rank after the tables placed before it."""
    spec = specs[failed]

    def on_one_rank(o: Candidate) -> float:
        return float(_least(o).sum(axis=0).max())

    budgets = np.array([hbm_budget, ddr_budget, ssd_budget])
    free = budgets[:, None] - np.stack([partition.rank_hbm, partition.rank_ddr, partition.rank_ssd])
    with_disk = not topology.is_cuda and ssd_budget > 0
    if with_disk:  # the candidate that comes closest to fitting, to say what it lacks
        most_free = free.max(axis=1)

        def deficit(o: Candidate) -> tuple[float, float]:
            return float(np.maximum(_least(o).max(axis=1) - most_free, 0).sum()), on_one_rank(o)

        compact = min(options[failed], key=deficit)
    else:  # the candidate asking least of any one rank
        compact = min(options[failed], key=on_one_rank)
    tables = _tables(specs, options)
    table = (f"table {_where(spec)} ({spec.config.num_embeddings} x "
             f"{spec.config.embedding_dim} {spec.config.data_type}) does not fit: its most "
             f"compact candidate ({compact.sharding_type.value}/{compact.compute_kernel.value}, "
             f"{compact.num_shards} shard(s))")
    origin = (f"Source of these figures: {memory_origin(topology)}. Largest tables: "
              f"{_largest(tables)}.")
    kind = "memory (HBM + host)" if topology.is_cuda else "host memory"
    placed = f"with {len(partition.assignments)} other table(s) placed"
    if not with_disk:
        per_shard = on_one_rank(compact)
        total = free.sum(axis=0)
        rank = int(total.argmax())  # the rank with the most memory left
        summary = (
            f"{table} needs {_gib(per_shard)} on a rank, but {placed} the most any rank has "
            f"free is {_gib(total[rank])} (rank {rank}: "
            f"{_memory(topology, free[Tier.HBM, rank], free[Tier.DDR, rank])} free; each rank "
            f"has {_memory(topology, hbm_budget, ddr_budget)} usable = "
            f"{_per_rank('memory', topology, reservation)}). {origin}"
        )
    else:
        need = _least(compact).max(axis=1)
        ddr_rank, ssd_rank = int(free[Tier.DDR].argmax()), int(free[Tier.SSD].argmax())
        short = [name for name, t, r in (("host memory", Tier.DDR, ddr_rank),
                                         ("disk", Tier.SSD, ssd_rank))
                 if need[t] > free[t, r]]
        if short == ["disk"]:
            kind = "disk"
        cache = (f" (its cache at load factor {least_load_factor(compact):g}, "
                 "row bookkeeping and buffers)" if compact.is_caching else "")
        summary = (
            f"{table} needs {_gib(need[Tier.DDR])} of host memory{cache} and "
            f"{_gib(need[Tier.SSD])} of disk on a rank, but {placed} the most any rank has "
            f"free is {_gib(free[Tier.DDR, ddr_rank])} of host memory (rank {ddr_rank}) and "
            f"{_gib(free[Tier.SSD, ssd_rank])} of disk (rank {ssd_rank}); each rank has "
            f"{_gib(ddr_budget)} usable = {_per_rank('host memory', topology, reservation)}, "
            f"and {_gib(ssd_budget)} of disk. Short: "
            f"{' and '.join(short) or 'no rank has both free at once'}. {origin}"
        )
    budget = float(budgets.sum())
    needed, usable = sum(t.needed_bytes for t in tables), topology.world_size * budget
    # As TorchRec: enough memory in all, but not in the pieces the allowed layouts make
    error_type = (PlannerErrorType.INSUFFICIENT_STORAGE if needed > usable
                  else PlannerErrorType.STRICT_CONSTRAINTS)
    if with_disk:  # what the ranks have of the tier named short, not of memory and disk together
        usable = topology.world_size * (ssd_budget if kind == "disk" else ddr_budget)
    return PlannerError(f"{summary} {remedies(kind, topology)}", error_type, MemoryShortfall(
        summary=summary, memory=kind, needed_bytes=needed, usable_bytes=usable,
        reservation=reservation, topology=topology, tables=tables,
    ))


def memory_origin(topology: Topology) -> str:
    """Where the topology's memory figures come from, in words."""
    if topology.memory_source:
        return topology.memory_source
    default = ("(Topology's default: TorchRec's constant, not this machine's memory, which "
               "detect_topology() reads)")
    parts = []
    if topology.is_cuda:
        hbm_default = topology.hbm_cap == DEFAULT_HBM_CAP
        parts.append(f"HBM {_gib(topology.hbm_per_rank)} per rank "
                     + (default if hbm_default else "(Topology hbm_cap)"))
    parts.append(f"host memory {_gib(topology.ddr_cap or 0)} per rank "
                 + (default if topology.ddr_cap == DEFAULT_DDR_CAP else "(Topology ddr_cap)"))
    if topology.ssd_per_rank:
        parts.append(f"disk {_gib(topology.ssd_per_rank)} per rank (Topology ssd_cap)")
    return "the Topology as given: " + ", ".join(parts)


def _least(option: Candidate) -> np.ndarray:
    """Bytes per tier and shard of ``option`` with the smallest cache the planner gives it."""
    return option.memory(least_load_factor(option))


# ---- formatting ---------------------------------------------------------------------------------
def _gib(value: float) -> str:
    return format_bytes(value)


def _where(spec: TableSpec) -> str:
    return f"{spec.name!r}" + (f" (module {spec.path!r})" if spec.path else "")


def _memory(topology: Topology, hbm: float, ddr: float) -> str:
    if not topology.is_cuda:
        return f"{_gib(ddr)} host memory"
    return f"HBM {_gib(hbm)} + host {_gib(ddr)}"


class ReservedFraction(float):
    """The fraction of memory a storage reservation kept, with how to describe it (a fixed
    absolute reservation is stated in GB per device, as TorchRec's message)."""

    text: str = ""

    def __new__(cls, value: float, text: str = "") -> ReservedFraction:
        self = super().__new__(cls, value)
        self.text = text
        return self

    def __reduce__(self) -> tuple[object, tuple[float, str]]:
        return (ReservedFraction, (float(self), self.text))


def _per_rank(kind: str, topology: Topology, reservation: float) -> str:
    """``"3.50 GiB of host memory per rank (...) less the 15% storage_reservation ..."``."""
    hbm, ddr = topology.hbm_per_rank, topology.ddr_per_rank
    shared = ""
    if topology.local_size > 1:
        host = _gib((topology.ddr_cap or 0) * topology.local_size)
        shared = f" ({host} on a host, shared by {topology.local_size} ranks)"
    reserved = getattr(reservation, "text", "") or (
        f"the {reservation:.0%} storage_reservation kept for dense parameters and activations")
    if kind == "disk":
        return f"{_gib(topology.ssd_per_rank)} of disk per rank (no storage_reservation on disk)"
    if kind == "memory (host + disk)":
        return (f"host memory {_gib(ddr)} per rank{shared} less {reserved}, plus disk "
                f"{_gib(topology.ssd_per_rank)} per rank")
    if kind == "HBM":
        total = f"{_gib(hbm)} of HBM per rank"
    elif kind == "host memory" or not topology.is_cuda:
        total = f"{_gib(ddr)} of host memory per rank{shared}"
    else:
        total = f"HBM {_gib(hbm)} + host {_gib(ddr)} per rank{shared}"
    return f"{total} less {reserved}"


def _largest(tables: Sequence[TableMemory]) -> str:
    """The largest tables, with their module where several collections have tables."""
    several = len({t.module for t in tables}) > 1
    return ", ".join(
        str(t) + (f" (module {t.module!r})" if several else "") for t in tables[:SHOWN_TABLES]
    )


def _tables(
    specs: Mapping[TableKey, TableSpec], options: Mapping[TableKey, Sequence[Candidate]]
) -> tuple[TableMemory, ...]:
    need = {key: min(storage_bytes(o) for o in opts)
            for key, opts in options.items()}
    return tuple(
        TableMemory(table=specs[key].name, module=specs[key].path,
                    num_embeddings=specs[key].config.num_embeddings,
                    embedding_dim=specs[key].config.embedding_dim,
                    data_type=specs[key].config.data_type, needed_bytes=need[key])
        for key in sorted(need, key=lambda key: (-need[key], key))
    )
