"""The planner's per-rank summary: estimated memory, estimated cost, share of the total.

Printed after a plan (``print(planner)`` or ``planner.stats_str()``)::

    planner: 8 ranks (1 host x 8), cuda, batch 512 per rank; usable per rank: HBM 68.00 GiB, ...
    rank | HBM (GiB) | DDR (GiB) | est. cost (ms) | share of total
    ---- | --------- | --------- | -------------- | --------------
    0    | 20.61     | 0.00      | 0.412          | 12.6%
    ...
    max/mean cost 1.01 (1.000 is perfect balance); layouts: table_wise 24, column_wise 2
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from recsys_core.planner.partitioners import Partition
from recsys_core.planner.topology import GIB, Topology


@dataclass(frozen=True, kw_only=True)
class RankStats:
    """Estimates for one rank."""

    rank: int
    """The rank."""
    hbm_bytes: float
    """Estimated HBM used by embedding shards (weights, state, buffers, caches)."""
    ddr_bytes: float
    """Estimated host memory used by embedding shards."""
    cost_ms: float
    """Estimated embedding time per training step (lookups, all-to-alls, backward)."""


@dataclass(frozen=True, kw_only=True)
class PlanStats:
    """Per-rank estimates of a plan and what it was planned for."""

    ranks: tuple[RankStats, ...]
    """One entry per rank, in rank order."""
    topology: str
    """One line describing the topology and batch size."""
    hbm_budget: float
    """Usable HBM bytes per rank (cap minus the storage reservation)."""
    ddr_budget: float
    """Usable host-memory bytes per rank (cap minus the storage reservation)."""
    layouts: Mapping[str, int]
    """Number of tables per "sharding type/compute kernel"."""
    planning_s: float
    """Wall time the plan took."""

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("PlanStats needs at least one rank")

    @classmethod
    def from_partition(
        cls, partition: Partition, topology: Topology, hbm_budget: float, ddr_budget: float,
        batch_size: int, planning_s: float,
    ) -> PlanStats:
        return cls(
            ranks=tuple(
                RankStats(rank=r, hbm_bytes=float(partition.rank_hbm[r]),
                          ddr_bytes=float(partition.rank_ddr[r]),
                          cost_ms=float(partition.rank_cost[r]))
                for r in range(topology.world_size)
            ),
            topology=(
                f"{topology.world_size} ranks ({topology.num_hosts} host(s) x "
                f"{topology.local_size}), {topology.compute_device}, batch {batch_size} per rank"
            ),
            hbm_budget=hbm_budget,
            ddr_budget=ddr_budget,
            layouts=dict(Counter(
                f"{a.option.sharding_type.value}/{a.option.compute_kernel.value}"
                for a in partition.assignments.values()
            )),
            planning_s=planning_s,
        )

    @property
    def total_cost_ms(self) -> float:
        return sum(r.cost_ms for r in self.ranks)

    @property
    def max_cost_ms(self) -> float:
        return max(r.cost_ms for r in self.ranks)

    @property
    def imbalance(self) -> float:
        """Max rank cost over mean rank cost (1.0: perfectly balanced)."""
        mean = self.total_cost_ms / len(self.ranks)
        return self.max_cost_ms / mean if mean > 0 else 1.0

    def __str__(self) -> str:
        total = self.total_cost_ms
        rows = [
            [
                str(r.rank),
                f"{r.hbm_bytes / GIB:.2f}",
                f"{r.ddr_bytes / GIB:.2f}",
                f"{r.cost_ms:.3f}",
                f"{100 * r.cost_ms / total:.1f}%" if total > 0 else "-",
            ]
            for r in self.ranks
        ]
        headers = ["rank", "HBM (GiB)", "DDR (GiB)", "est. cost (ms)", "share of total"]
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
        layouts = ", ".join(f"{name} {count}" for name, count in sorted(self.layouts.items()))
        lines = [
            f"planner: {self.topology}; usable per rank: HBM {self.hbm_budget / GIB:.2f} GiB, "
            f"DDR {self.ddr_budget / GIB:.2f} GiB; planned in {self.planning_s:.3f} s",
            " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)),
            " | ".join("-" * w for w in widths),
            *(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows),
            f"max/mean cost {self.imbalance:.3f} (1.000 is perfect balance); max "
            f"{self.max_cost_ms:.3f} ms, total {total:.3f} ms; tables: {layouts}",
        ]
        return "\n".join(lines)
