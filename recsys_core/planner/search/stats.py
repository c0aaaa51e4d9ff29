"""The planner's per-rank summary: estimated memory per tier, estimated cost, share of the total,
and each cached table's load factor and expected traffic from its slow tier.

Printed after a plan (``print(planner)`` or ``planner.stats_str()``): per rank the GiB used in
each tier, then the cost, then each tier's use of its usable capacity::

    planner: 2 ranks (1 host(s) x 2), cpu, batch 512 per rank; usable per rank: DDR 0.85 GiB, ...
    rank | DDR (GiB) | disk (GiB) | est. cost (ms) | share of total | DDR used        | disk used
    ---- | --------- | ---------- | -------------- | -------------- | --------------- | ---------...
    0    | 0.84      | 2.98       | 0.412          | 50.6%          | 99% of 0.85 GiB | 19% of 16...
    ...
    max/mean cost 1.01 (1.000 is perfect balance); max 0.412 ms, total 0.815 ms; tables: ...
    cached tables (fused_uvm_caching): the cache in DDR, every row in the disk tier; misses ...
    table | sharding  | ranks | load factor | cache DDR (GiB) | rows disk (GiB) | misses/step | disk reads/step (MiB)
    ...

On CUDA the tiers are HBM and DDR (an HBM cache over host memory); on CPU DDR and, when the
topology has an ``ssd_cap``, disk (a cache in RAM over files on local disk).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from recsys_core.planner.search.placement import Partition
from recsys_core.planner.storage import Tier
from recsys_core.planner.topology import GIB, Topology

MIB = 1024**2


@dataclass(frozen=True, kw_only=True)
class RankStats:
    """Estimates for one rank."""

    rank: int
    """The rank."""
    hbm_bytes: float
    """Estimated HBM used by embedding shards (weights, state, buffers, caches)."""
    ddr_bytes: float
    """Estimated host memory used by embedding shards (on CPU: tables, buffers, caches)."""
    cost_ms: float
    """Estimated embedding time per training step (lookups, all-to-alls, backward)."""
    ssd_bytes: float = 0.0
    """Estimated local disk used by the backing files of cached tables (CPU)."""

    def used(self, tier: Tier) -> float:
        return (self.hbm_bytes, self.ddr_bytes, self.ssd_bytes)[tier]


@dataclass(frozen=True, kw_only=True)
class CachedTableStats:
    """One FUSED_UVM_CACHING table of a plan: its cache, its slow tier, its expected misses."""

    table: str
    """Table name."""
    module: str
    """Module path of its collection (``""`` at the top level)."""
    sharding_type: str
    """How it is split."""
    ranks: tuple[int, ...]
    """The rank of each shard."""
    load_factor: float
    """Cache slots per row of each shard (the plan's ``cache_params.load_factor``)."""
    cache_tier: Tier
    """Where the cache lives: HBM on CUDA, DDR on CPU."""
    backing_tier: Tier
    """Where every row lives: DDR on CUDA, disk (SSD) on CPU."""
    cache_bytes: float
    """Bytes of its caches, all shards (slots with their bookkeeping)."""
    backing_bytes: float
    """Bytes of its rows in the slow tier, all shards (weights and optimizer state on CPU)."""
    miss_rows_per_step: float
    """Expected rows read from the slow tier per training step, all shards (the distinct rows
    the step touches times ``1 - load_factor``)."""
    miss_bytes_per_step: float
    """Expected bytes read from the slow tier per step (misses x bytes per row); on CPU the
    trained rows are written back on eviction, about as many bytes again."""


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
    ssd_budget: float = 0.0
    """Usable disk bytes per rank (the topology's ssd_cap)."""
    tiers: tuple[Tier, ...] = (Tier.HBM, Tier.DDR)
    """The tiers the summary shows: HBM and DDR on CUDA, DDR (and disk) on CPU."""
    cached: tuple[CachedTableStats, ...] = ()
    """The plan's FUSED_UVM_CACHING tables."""

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("PlanStats needs at least one rank")

    @classmethod
    def from_partition(
        cls, partition: Partition, topology: Topology, hbm_budget: float, ddr_budget: float,
        batch_size: int, planning_s: float, *, ssd_budget: float = 0.0,
    ) -> PlanStats:
        if topology.is_cuda:
            tiers: tuple[Tier, ...] = (Tier.HBM, Tier.DDR)
        else:
            tiers = (Tier.DDR, Tier.SSD) if ssd_budget > 0 else (Tier.DDR,)
        cached = []
        for (path, name), a in partition.assignments.items():
            option = a.option
            if not option.is_caching or a.load_factor is None:
                continue
            misses = option.expected_miss_rows(a.load_factor)
            cached.append(CachedTableStats(
                table=name, module=path, sharding_type=option.sharding_type.value,
                ranks=tuple(int(r) for r in a.ranks), load_factor=a.load_factor,
                cache_tier=option.cache_tier, backing_tier=option.backing_tier,
                cache_bytes=float(option.cache_bytes(a.load_factor).sum()),
                backing_bytes=float(option.memory()[option.backing_tier].sum()),
                miss_rows_per_step=float(misses.sum()),
                miss_bytes_per_step=float((misses * option.row_bytes).sum()),
            ))
        return cls(
            ranks=tuple(
                RankStats(rank=r, hbm_bytes=float(partition.rank_hbm[r]),
                          ddr_bytes=float(partition.rank_ddr[r]),
                          ssd_bytes=float(partition.rank_ssd[r]),
                          cost_ms=float(partition.rank_cost[r]))
                for r in range(topology.world_size)
            ),
            topology=(
                f"{topology.world_size} ranks ({topology.num_hosts} host(s) x "
                f"{topology.local_size}), {topology.compute_device}, batch {batch_size} per rank"
            ),
            hbm_budget=hbm_budget,
            ddr_budget=ddr_budget,
            ssd_budget=ssd_budget,
            layouts=dict(Counter(
                f"{a.option.sharding_type.value}/{a.option.compute_kernel.value}"
                for a in partition.assignments.values()
            )),
            planning_s=planning_s,
            tiers=tiers,
            cached=tuple(cached),
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

    def budget(self, tier: Tier) -> float:
        return (self.hbm_budget, self.ddr_budget, self.ssd_budget)[tier]

    def _use(self, r: RankStats, tier: Tier) -> str:
        """``"94% of 0.85 GiB"``: a rank's use of its usable ``tier``."""
        budget = self.budget(tier)
        share = f"{100 * r.used(tier) / budget:.0f}%" if budget > 0 else "-"
        return f"{share} of {budget / GIB:.2f} GiB"

    def __str__(self) -> str:
        total = self.total_cost_ms
        rows = [
            [
                str(r.rank),
                *(f"{r.used(t) / GIB:.2f}" for t in self.tiers),
                f"{r.cost_ms:.3f}",
                f"{100 * r.cost_ms / total:.1f}%" if total > 0 else "-",
                *(self._use(r, t) for t in self.tiers),
            ]
            for r in self.ranks
        ]
        headers = ["rank", *(f"{t.label} (GiB)" for t in self.tiers), "est. cost (ms)",
                   "share of total", *(f"{t.label} used" for t in self.tiers)]
        layouts = ", ".join(f"{name} {count}" for name, count in sorted(self.layouts.items()))
        usable = ", ".join(f"{t.label} {self.budget(t) / GIB:.2f} GiB" for t in self.tiers)
        lines = [
            f"planner: {self.topology}; usable per rank: {usable}; planned in "
            f"{self.planning_s:.3f} s",
            *_table(headers, rows),
            f"max/mean cost {self.imbalance:.3f} (1.000 is perfect balance); max "
            f"{self.max_cost_ms:.3f} ms, total {total:.3f} ms; tables: {layouts}",
        ]
        if self.cached:
            fast, slow = self.cached[0].cache_tier.label, self.cached[0].backing_tier.label
            lines.append(f"cached tables (fused_uvm_caching): the cache in {fast}, every row in "
                         f"the {slow} tier; misses per step at hit rate = load factor")
            lines += _table(
                ["table", "sharding", "ranks", "load factor", f"cache {fast} (GiB)",
                 f"rows {slow} (GiB)", "misses/step", f"{slow} reads/step (MiB)"],
                [[c.table if not c.module else f"{c.module}.{c.table}", c.sharding_type,
                  str(list(c.ranks)), f"{c.load_factor:.6g}", f"{c.cache_bytes / GIB:.2f}",
                  f"{c.backing_bytes / GIB:.2f}", f"{c.miss_rows_per_step:.0f}",
                  f"{c.miss_bytes_per_step / MIB:.2f}"] for c in self.cached],
            )
        return "\n".join(lines)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    return [
        " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)),
        " | ".join("-" * w for w in widths),
        *(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows),
    ]
