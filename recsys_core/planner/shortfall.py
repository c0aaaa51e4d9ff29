"""When a model does not fit: the early check, and errors that say what is missing and why.

A :class:`PlannerError` about memory says how much the tables need (the largest ones by name),
how much each rank has, and where that figure came from (read from this machine by
``detect_topology``, given explicitly, or TorchRec's default constants). It carries the same
facts as data (:class:`MemoryShortfall`), so an application can name its own remedies (its
flags) instead of the library's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from recsys_core.planner.errors import (
    SHOWN_TABLES,
    MemoryShortfall,
    PlannerError,
    PlannerErrorType,
    TableMemory,
)
from recsys_core.planner.estimators import MIN_CACHE_LOAD_FACTOR, storage_bytes
from recsys_core.planner.partitioners import Partition, TableKey
from recsys_core.planner.topology import DEFAULT_DDR_CAP, DEFAULT_HBM_CAP, GIB, Topology
from recsys_core.planner.types import Candidate, TableSpec

REMEDIES = (
    "To fix: use smaller tables (fewer rows, a smaller embedding_dim, FP16 weights); use more "
    "ranks (row- and column-wise shards spread a table over them); or give each rank a larger "
    "memory budget where it really has more free (detect_topology(memory_per_rank=...), "
    "Topology hbm_cap / ddr_cap, a lower storage_reservation). Constraints that allow few "
    "layouts (or, on CUDA, no UVM kernels for the largest tables) make tables harder to place."
)


def check_total(
    specs: Mapping[TableKey, TableSpec], options: Mapping[TableKey, Sequence[Candidate]],
    topology: Topology, hbm_budget: float, ddr_budget: float, reservation: float,
) -> None:
    """Raise when no placement can work: the least each table needs (of each memory, and in
    all) summed over tables, against what all ranks have together."""
    world = topology.world_size
    host = ("host memory", lambda o: float(o.ddr.sum()), ddr_budget)
    kinds = [host] if not topology.is_cuda else [
        ("memory (HBM + host)", lambda o: storage_bytes(o, MIN_CACHE_LOAD_FACTOR),
         hbm_budget + ddr_budget),
        ("HBM", lambda o: float(o.hbm.sum() + MIN_CACHE_LOAD_FACTOR * o.cache_hbm.sum() * o.is_caching),
         hbm_budget),
        host,
    ]
    for kind, size, budget in kinds:
        needed = sum(min(size(o) for o in opts) for opts in options.values())
        if needed <= world * budget:
            continue
        tables = _tables(specs, options)
        summary = (
            f"the model does not fit: its tables need at least {_gib(needed)} of {kind} "
            f"(weights, optimizer state and buffers in their most compact allowed layouts) but "
            f"the {world} ranks have {_gib(world * budget)} usable: {_gib(budget)} per rank = "
            f"{_per_rank(kind, topology, reservation)}. Source of these figures: "
            f"{memory_origin(topology)}. Largest tables: "
            f"{_largest(tables)}."
        )
        raise PlannerError(f"{summary} {REMEDIES}", PlannerErrorType.INSUFFICIENT_STORAGE, MemoryShortfall(
            summary=summary, memory=kind, needed_bytes=needed, usable_bytes=world * budget,
            reservation=reservation, topology=topology, tables=tables,
        ))


def no_fit_error(
    specs: Mapping[TableKey, TableSpec], options: Mapping[TableKey, Sequence[Candidate]],
    failed: TableKey, partition: Partition, topology: Topology, hbm_budget: float,
    ddr_budget: float, reservation: float,
) -> PlannerError:
    """The error when table ``failed`` fits on no rank after the tables placed before it."""
    spec = specs[failed]

    def on_one_rank(o: Candidate) -> float:
        return float((o.hbm + o.ddr + MIN_CACHE_LOAD_FACTOR * o.cache_hbm * o.is_caching).max())

    # the candidate asking least of any one rank, and the rank with the most memory left
    compact = min(options[failed], key=on_one_rank)
    per_shard = on_one_rank(compact)
    hbm_free = hbm_budget - partition.rank_hbm
    ddr_free = ddr_budget - partition.rank_ddr
    free = hbm_free + ddr_free
    rank = int(free.argmax())
    tables = _tables(specs, options)
    summary = (
        f"table {_where(spec)} ({spec.config.num_embeddings} x {spec.config.embedding_dim} "
        f"{spec.config.data_type}) does not fit: its most compact candidate "
        f"({compact.sharding_type.value}/{compact.compute_kernel.value}, {compact.num_shards} "
        f"shard(s)) needs {_gib(per_shard)} on a rank, but with {len(partition.assignments)} "
        f"other table(s) placed the most any rank has free is {_gib(free[rank])} (rank {rank}: "
        f"{_memory(topology, hbm_free[rank], ddr_free[rank])} free; each rank has "
        f"{_memory(topology, hbm_budget, ddr_budget)} usable = "
        f"{_per_rank('memory', topology, reservation)}). Source of these figures: "
        f"{memory_origin(topology)}. Largest tables: "
        f"{_largest(tables)}."
    )
    budget = ddr_budget + (hbm_budget if topology.is_cuda else 0.0)
    needed, usable = sum(t.needed_bytes for t in tables), topology.world_size * budget
    # As TorchRec: enough memory in all, but not in the pieces the allowed layouts make
    kind = (PlannerErrorType.INSUFFICIENT_STORAGE if needed > usable
            else PlannerErrorType.STRICT_CONSTRAINTS)
    return PlannerError(f"{summary} {REMEDIES}", kind, MemoryShortfall(
        summary=summary, memory="memory (HBM + host)" if topology.is_cuda else "host memory",
        needed_bytes=needed, usable_bytes=usable, reservation=reservation, topology=topology,
        tables=tables,
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
    return "the Topology as given: " + ", ".join(parts)


# ---- formatting ---------------------------------------------------------------------------------
def _gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def _where(spec: TableSpec) -> str:
    return f"{spec.name!r}" + (f" (module {spec.path!r})" if spec.path else "")


def _memory(topology: Topology, hbm: float, ddr: float) -> str:
    if not topology.is_cuda:
        return f"{_gib(ddr)} host memory"
    return f"HBM {_gib(hbm)} + host {_gib(ddr)}"


def _per_rank(kind: str, topology: Topology, reservation: float) -> str:
    """``"3.50 GiB of host memory per rank (...) less the 15% storage_reservation ..."``."""
    hbm, ddr = topology.hbm_per_rank, topology.ddr_per_rank
    shared = ""
    if topology.local_size > 1:
        host = _gib((topology.ddr_cap or 0) * topology.local_size)
        shared = f" ({host} on a host, shared by {topology.local_size} ranks)"
    if kind == "HBM":
        total = f"{_gib(hbm)} of HBM per rank"
    elif kind == "host memory" or not topology.is_cuda:
        total = f"{_gib(ddr)} of host memory per rank{shared}"
    else:
        total = f"HBM {_gib(hbm)} + host {_gib(ddr)} per rank{shared}"
    return (f"{total} less the {reservation:.0%} storage_reservation kept for dense parameters "
            "and activations")


def _largest(tables: Sequence[TableMemory]) -> str:
    """The largest tables, with their module where several collections have tables."""
    several = len({t.module for t in tables}) > 1
    return ", ".join(
        str(t) + (f" (module {t.module!r})" if several else "") for t in tables[:SHOWN_TABLES]
    )


def _tables(
    specs: Mapping[TableKey, TableSpec], options: Mapping[TableKey, Sequence[Candidate]]
) -> tuple[TableMemory, ...]:
    need = {key: min(storage_bytes(o, MIN_CACHE_LOAD_FACTOR) for o in opts)
            for key, opts in options.items()}
    return tuple(
        TableMemory(table=specs[key].name, module=specs[key].path,
                    num_embeddings=specs[key].config.num_embeddings,
                    embedding_dim=specs[key].config.embedding_dim,
                    data_type=specs[key].config.data_type, needed_bytes=need[key])
        for key in sorted(need, key=lambda key: (-need[key], key))
    )
