"""Choose one candidate per table and place its shards: minimise the largest rank cost within
every rank's memory.

1. Greedy, largest first (by the cheapest candidate's cost, then storage, then name): each table
   takes the candidate and placement with the lowest ``max(resulting max rank cost, lower bound
   of the final mean)``, where the lower bound adds the cheapest cost of every table still to
   place. Early on, when the mean dominates, cheap layouts (table-wise) win; a table whose
   cost would stick out above the mean is split instead. Kernels go in tiers: FUSED wherever
   any candidate fits (in HBM on CUDA, in host memory on CPU), else FUSED_UVM_CACHING (its
   cache sized to the free fast tier: HBM on CUDA, host memory on CPU; its rows in the slow
   tier: host memory on CUDA, local disk on CPU), else FUSED_UVM (CUDA).
2. Local search from the most loaded rank: re-choose the candidate (and placement) of each table
   on it, or swap one of its table-wise shards with a smaller one elsewhere; accept a move only
   if it lowers ``(max rank cost, sum of squared rank costs)``, so the plan kept is the best seen.
3. Caches grow into the fast tier left free (up to every row), largest miss cost first.

Memory is tracked per tier (:class:`Tier`: HBM, host memory, local disk), as arrays whose first
axis is the tier. Placement is vectorised over ranks (and hosts) with numpy, so a table costs a few array passes
per candidate. Ties go to the lower rank, host and candidate index: plans are deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from recsys_core.plan.types import EmbeddingComputeKernel
from recsys_core.planner.search.cost import (
    DEFAULT_CACHE_LOAD_FACTOR,
    MAX_CACHE_LOAD_FACTOR,
    fitting_load_factor,
    least_load_factor,
    storage_bytes,
)
from recsys_core.planner.search.types import Candidate, Placement, cache_slots
from recsys_core.planner.storage import Tier
from recsys_core.planner.topology import Topology

TableKey = tuple[str, str]  # (module path, table name)
KERNEL_TIERS = {  # the order in which kernels are tried: fastest memory first
    EmbeddingComputeKernel.FUSED: 0,
    EmbeddingComputeKernel.DENSE: 0,
    EmbeddingComputeKernel.FUSED_UVM_CACHING: 1,
    EmbeddingComputeKernel.FUSED_UVM: 2,
}
_REL_EPS = 1e-9  # relative tolerance when comparing float costs (a move must really improve)


@dataclass(frozen=True, eq=False)
class Assignment:
    """A chosen candidate of one table with the rank of each shard."""

    option: Candidate
    ranks: np.ndarray
    """Rank of each shard (int array)."""
    load_factor: float | None
    """Cache load factor (FUSED_UVM_CACHING only)."""
    cost: np.ndarray
    """Estimated ms of each shard at this load factor."""
    hbm: np.ndarray
    """HBM bytes of each shard, cache included."""
    ddr: np.ndarray
    """Host-memory bytes of each shard, cache included."""
    ssd: np.ndarray
    """Local-disk bytes of each shard."""

    @classmethod
    def of(cls, option: Candidate, ranks: np.ndarray, load_factor: float | None) -> Assignment:
        """``option`` on ``ranks``, its cache (if caching) at ``load_factor``."""
        mem = option.memory(load_factor)
        cost = option.cost
        if option.is_caching:
            assert load_factor is not None
            cost = option.cost + (1.0 - load_factor) * option.miss_cost
        return cls(option, ranks, load_factor, cost, mem[Tier.HBM], mem[Tier.DDR], mem[Tier.SSD])

    @cached_property
    def memory(self) -> np.ndarray:
        """Bytes of each shard per tier, shape [3, shards]."""
        return np.array((self.hbm, self.ddr, self.ssd), dtype=np.float64)

    def host_index(self, local_size: int) -> int:
        return int(self.ranks[0]) // local_size


@dataclass(frozen=True)
class Partition:
    """The partitioner's result: an assignment per table and the per-rank totals."""

    assignments: dict[TableKey, Assignment]
    rank_cost: np.ndarray
    rank_hbm: np.ndarray
    rank_ddr: np.ndarray
    rank_ssd: np.ndarray


class _State:
    """Per-rank load and free memory while tables are being placed, with two indexes for the
    local search: the tables on each rank, and the table-wise shards as arrays (for swaps)."""

    def __init__(self, topology: Topology, budgets: np.ndarray, capacity: int) -> None:
        world = topology.world_size
        self.hosts, self.local = topology.num_hosts, topology.local_size
        self.cost = np.zeros(world)
        self.free = np.repeat(np.asarray(budgets, dtype=np.float64)[:, None], world, axis=1)
        """Free bytes per tier and rank, shape [3, world]."""
        self.assignments: dict[TableKey, Assignment] = {}
        self.on_rank: list[dict[TableKey, None]] = [{} for _ in range(world)]
        # one slot per swappable (single-shard, uncached) assignment; rank -1 marks a free slot
        self.slot_of: dict[TableKey, int] = {}
        self.slot_key: list[TableKey | None] = [None] * capacity
        self.slot_rank = np.full(capacity, -1)
        self.slot_cost = np.zeros(capacity)
        self.slot_mem = np.zeros((3, capacity))
        self._free_slots = list(range(capacity - 1, -1, -1))

    def add(self, key: TableKey, a: Assignment) -> None:
        self.assignments[key] = a
        np.add.at(self.cost, a.ranks, a.cost)
        mem = a.memory
        for tier in Tier:
            np.subtract.at(self.free[tier], a.ranks, mem[tier])
        for rank in a.ranks.tolist():
            self.on_rank[rank][key] = None
        if a.option.placement is Placement.ANY_RANKS and len(a.ranks) == 1 and not a.option.is_caching:
            slot = self._free_slots.pop()
            self.slot_of[key] = slot
            self.slot_key[slot] = key
            self.slot_rank[slot] = int(a.ranks[0])
            self.slot_cost[slot] = a.cost[0]
            self.slot_mem[:, slot] = mem[:, 0]

    def remove(self, key: TableKey) -> Assignment:
        a = self.assignments.pop(key)
        np.subtract.at(self.cost, a.ranks, a.cost)
        mem = a.memory
        for tier in Tier:
            np.add.at(self.free[tier], a.ranks, mem[tier])
        for rank in a.ranks.tolist():
            self.on_rank[rank].pop(key, None)
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.slot_key[slot] = None
            self.slot_rank[slot] = -1
            self._free_slots.append(slot)
        return a

    def score(self) -> tuple[float, float]:
        return float(self.cost.max()), float(np.dot(self.cost, self.cost))


def _cache_load_factors(
    rows: np.ndarray, slot_bytes: np.ndarray, load_factor: float | None, room: np.ndarray,
    least: float = 0.0,
) -> np.ndarray:
    """Load factor each placement could give its cache (0 where it cannot have one).

    ``room`` is the free fast tier after the shards' own bytes there, shaped ``[placements,
    shards]``; ``rows`` and ``slot_bytes`` are the shards' rows and bytes per cache slot. A
    table has one load factor, so a placement gets the smallest its shards allow."""
    if load_factor is not None:  # the constraint's factor, exactly, or not at all
        fits = (room >= cache_slots(rows, load_factor) * slot_bytes).all(axis=1)
        return np.where(fits, load_factor, 0.0)
    fits = fitting_load_factor(room, rows, slot_bytes).min(axis=1)
    fits = np.where((room >= 0).all(axis=1), fits, 0.0)
    # the default factor, or the least this cache can run with where that is more
    return np.minimum(fits, max(DEFAULT_CACHE_LOAD_FACTOR, least))


def _place(option: Candidate, st: _State) -> Assignment | None:
    """The placement of ``option`` with the lowest resulting load on its ranks, if any fits."""
    k = option.num_shards
    mem = option.memory()  # [tier, shard], without cache slots
    if option.placement is Placement.ANY_RANKS and k > len(st.cost):
        # more column blocks than ranks: only column-wise on a single rank (TorchRec's blocks)
        if len(st.cost) != 1 or option.is_caching:
            return None
        if (st.free[:, 0] - mem.sum(axis=1) < 0).any():
            return None
        return Assignment.of(option, np.zeros(k, dtype=np.int64), None)
    if option.placement is Placement.ANY_RANKS:
        # k identical shards on k distinct ranks: the k least loaded that fit
        cost, free = st.cost[:, None], st.free[:, :, None]  # [world, 1], [tier, world, 1]
        shards = slice(0, 1)
    else:
        shape = (st.hosts, st.local) if option.placement is Placement.ANY_HOST else (1, k)
        cost = st.cost.reshape(shape)[:, :k]
        free = st.free.reshape(3, *shape)[:, :, :k]  # [tier, placement, shard]
        shards = slice(0, k)
    room = free - mem[:, None, shards]
    shard_cost, shard_miss = option.cost[shards], option.miss_cost[shards]
    lf = None
    if option.is_caching:
        others = [t for t in Tier if t is not option.cache_tier]
        ok = (room[others] >= 0).all(axis=(0, 2))
        least = least_load_factor(option)
        lf = _cache_load_factors(option.shard_rows[shards], option.slot_bytes[shards],
                                 option.load_factor, room[option.cache_tier], least)
        ok &= lf >= least
        load = cost + shard_cost + (1.0 - lf[:, None]) * shard_miss
    else:
        ok = (room >= 0).all(axis=(0, 2))
        load = cost + shard_cost
    worst = np.where(ok, load.max(axis=1), np.inf)
    if option.placement is Placement.ANY_RANKS:
        if k == 1:
            chosen = np.array([int(np.argmin(worst))])
        else:
            chosen = np.argsort(worst, kind="stable")[:k]
        if len(chosen) < k or not np.isfinite(worst[chosen]).all():
            return None
        ranks = chosen
    else:
        group = int(np.argmin(worst))
        if not np.isfinite(worst[group]):
            return None
        chosen = np.array([group])
        base = group * st.local if option.placement is Placement.ANY_HOST else 0
        ranks = base + np.arange(k)
    factor = None
    if option.is_caching:
        assert lf is not None
        factor = float(lf[chosen].min())
    return Assignment.of(option, ranks, factor)


def _within(a: Assignment, allowed: float, tier: Tier) -> Assignment | None:
    """``a`` with its cache shrunk so that the table takes at most ``allowed`` bytes of ``tier``
    over its ranks (at least its least load factor: with ``allowed`` 0, its most compact
    form), or None: not caching there, the factor fixed by constraints, or no factor fits."""
    option = a.option
    if (not option.is_caching or option.load_factor is not None or option.cache_tier != tier
            or a.load_factor is None):
        return None
    if float(a.memory[tier].sum()) <= allowed:
        return a
    least = least_load_factor(option)
    # the room the cache may take, shared by the shards as their slots are (by rows); one
    # factor for the table: the smallest any shard allows
    rows = np.asarray(option.shard_rows, dtype=np.float64)
    room = (allowed - float(option.memory()[tier].sum())) * rows / max(float(rows.sum()), 1.0)
    factor = float(fitting_load_factor(room, rows, option.slot_bytes).min())
    if factor < least:
        return Assignment.of(option, a.ranks, least) if allowed <= 0.0 else None
    return Assignment.of(option, a.ranks, min(factor, a.load_factor))


class GreedyPartitioner:
    """Greedy largest-first placement, local search, cache growth (see the module docstring)."""

    def __init__(
        self, topology: Topology, hbm_budget: float, ddr_budget: float,
        ssd_budget: float | None = None,
    ) -> None:
        """Budgets are usable bytes per rank of each tier (``ssd_budget`` None: the topology's
        ``ssd_cap``)."""
        self._topology = topology
        ssd = topology.ssd_per_rank if ssd_budget is None else ssd_budget
        self._budgets = np.array([hbm_budget, ddr_budget, ssd], dtype=np.float64)

    def partition(
        self, options: dict[TableKey, Sequence[Candidate]], max_moves: int | None = None,
        deadline: float | None = None,
    ) -> tuple[Partition, TableKey | None]:
        """Place every table: ``(partition, None)``; or, when a table fits nowhere, the tables
        placed before it and its key (the state an error message should describe).

        ``deadline`` (a ``time.perf_counter()`` value) stops the local search early; the greedy
        placement always completes."""
        tiers = {key: _by_tier(opts) for key, opts in options.items()}
        cheapest = {
            key: min(o.total_cost(DEFAULT_CACHE_LOAD_FACTOR) for o in t[0]) for key, t in tiers.items()
        }
        size = {key: min(storage_bytes(o) for o in opts) for key, opts in options.items()}
        order = sorted(options, key=lambda key: (-cheapest[key], -size[key], key))
        # With disk on CPU, memory is kept for the tables still to place (the least memory each
        # can take: its cache, bookkeeping and buffers): otherwise the first, largest tables take
        # it fused and the small ones placed last find none, though caching a large one would
        # have made room for all.
        keep = self._keep_tier()
        least = ({key: min(float(o.memory(least_load_factor(o))[keep].sum())
                           for o in opts) for key, opts in options.items()}
                 if keep is not None else {})
        # The tables placed last may take more than their least (data-parallel copies on every
        # rank): when the greedy pass runs out, it runs again keeping 2x, 4x, 8x that much.
        for scale in (1.0, 2.0, 4.0, 8.0) if keep is not None else (1.0,):
            st = _State(self._topology, self._budgets, len(options))
            rest = sum(cheapest.values())
            reserve = scale * sum(least.values())
            failed = None
            for key in order:
                rest -= cheapest[key]
                reserve -= scale * least.get(key, 0.0)
                choice = self._choose(tiers[key], st, rest, keep, reserve)
                if choice is None:
                    failed = key
                    break
                st.add(key, choice)
            if failed is None:
                break
            if scale == 1.0:  # the error describes the first pass
                first_failure = (self._result(options, st), failed)
        else:
            return first_failure
        self._local_search(
            tiers, st, max_moves if max_moves is not None else 4 * len(options) + 64, deadline
        )
        self._grow_caches(st)
        return self._result(options, st), None

    def _result(self, options: dict[TableKey, Sequence[Candidate]], st: _State) -> Partition:
        ordered = {key: st.assignments[key] for key in options if key in st.assignments}
        used = self._budgets[:, None] - st.free
        return Partition(ordered, st.cost.copy(), used[Tier.HBM], used[Tier.DDR], used[Tier.SSD])

    def _keep_tier(self) -> Tier | None:
        """The tier whose room the greedy pass keeps for later tables: host memory on a CPU
        topology with disk; None elsewhere (placement as without caching)."""
        if self._topology.is_cuda or self._budgets[Tier.SSD] <= 0:
            return None
        return Tier.DDR

    def _choose(
        self, tiers: list[list[Candidate]], st: _State, rest: float,
        keep: Tier | None = None, reserve: float = 0.0,
    ) -> Assignment | None:
        """The best assignment from the first tier with one that fits; with ``keep``, one that
        leaves ``reserve`` bytes of that tier free over all ranks, else the one that fits taking
        least of that tier."""
        if keep is None or reserve <= 0:
            return self._pick(tiers, st, rest, None, 0.0)
        chosen = self._pick(tiers, st, rest, keep, reserve)
        if chosen is not None:
            return chosen
        fitting = [_within(a, 0.0, keep) or a for options in tiers for option in options
                   if (a := _place(option, st)) is not None]
        if not fitting:
            return None
        return min(fitting, key=lambda a: (float(a.memory[keep].sum()), float(a.cost.sum())))

    def _pick(
        self, tiers: list[list[Candidate]], st: _State, rest: float, keep: Tier | None,
        reserve: float,
    ) -> Assignment | None:
        world = self._topology.world_size
        current_max = float(st.cost.max())
        current_total = float(st.cost.sum())
        for options in tiers:
            best, best_key = None, None
            for index, option in enumerate(options):
                a = _place(option, st)
                if a is None:
                    continue
                if keep is not None and float(st.free[keep].sum() - a.memory[keep].sum()) < reserve:
                    # a cache may take less than the default factor to leave the reserve (the
                    # caches grow back into what is left once every table is placed)
                    a = _within(a, float(st.free[keep].sum()) - reserve, keep)
                    if a is None:
                        continue
                loads = st.cost[a.ranks] + a.cost
                new_max = max(current_max, float(loads.max()))
                total = float(a.cost.sum())
                bound = max(new_max, (current_total + total + rest) / world)
                key = (bound, new_max, total, index)
                if best_key is None or key < best_key:
                    best, best_key = a, key
            if best is not None:
                return best
        return None

    def _local_search(
        self, tiers: dict[TableKey, list[list[Candidate]]], st: _State, limit: int,
        deadline: float | None,
    ) -> None:
        for _ in range(limit):
            if deadline is not None and time.perf_counter() > deadline:
                return
            rank = int(np.argmax(st.cost))
            # swaps first: one vectorised pass over all table-wise shards is cheap
            if not (self._swap_from(rank, st) or self._move_from(rank, tiers, st)):
                return

    def _move_from(
        self, rank: int, tiers: dict[TableKey, list[list[Candidate]]], st: _State
    ) -> bool:
        """Re-choose the candidate of a table on ``rank``; True if that improved the plan."""
        before = st.score()
        on_rank = []
        for key in st.on_rank[rank]:
            a = st.assignments[key]
            on_rank.append((-float(a.cost[a.ranks == rank].sum()), key))
        for _, key in sorted(on_rank):
            old = st.remove(key)
            new = self._choose(tiers[key], st, 0.0)
            if new is not None:
                st.add(key, new)
                if _better(st.score(), before):
                    return True
                st.remove(key)
            st.add(key, old)
        return False

    def _swap_from(self, rank: int, st: _State) -> bool:
        """Swap a table-wise shard on ``rank`` with a cheaper one elsewhere, if that helps."""
        mine = np.flatnonzero(st.slot_rank == rank)
        others = (st.slot_rank >= 0) & (st.slot_rank != rank)
        if not len(mine) or not others.any():
            return False
        o_rank = np.where(others, st.slot_rank, 0)
        before = st.score()
        top = before[0]
        order = sorted(mine.tolist(), key=lambda slot: (-st.slot_cost[slot], st.slot_key[slot]))
        for slot in order:
            c, m = st.slot_cost[slot], st.slot_mem[:, slot, None]
            here = top - c + st.slot_cost
            there = st.cost[o_rank] - st.slot_cost + c
            fits = (
                others & (st.slot_cost < c)
                & (st.free[:, rank, None] + m - st.slot_mem >= 0).all(axis=0)
                & (st.free[:, o_rank] + st.slot_mem - m >= 0).all(axis=0)
            )
            pair_max = np.where(fits, np.maximum(here, there), np.inf)
            j = int(np.argmin(pair_max))
            if not pair_max[j] < top * (1 - _REL_EPS):
                continue
            key, other_key = st.slot_key[slot], st.slot_key[j]
            assert key is not None and other_key is not None
            a, b = st.remove(key), st.remove(other_key)
            st.add(key, _moved(a, int(b.ranks[0])))
            st.add(other_key, _moved(b, rank))
            if _better(st.score(), before):
                return True
            st.remove(key)
            st.remove(other_key)
            st.add(key, a)
            st.add(other_key, b)
        return False

    def _grow_caches(self, st: _State) -> None:
        caching = [
            (-float(a.option.miss_cost.sum()), key)
            for key, a in st.assignments.items()
            if a.option.is_caching and a.option.load_factor is None
        ]
        for _, key in sorted(caching):
            old = st.remove(key)
            option = old.option
            tier = option.cache_tier
            room = st.free[tier][old.ranks] - option.memory()[tier]
            factor = float(fitting_load_factor(room, option.shard_rows, option.slot_bytes).min())
            factor = min(MAX_CACHE_LOAD_FACTOR, factor)
            assert old.load_factor is not None
            if factor <= old.load_factor:
                st.add(key, old)
                continue
            st.add(key, Assignment.of(option, old.ranks, factor))


def _by_tier(options: Sequence[Candidate]) -> list[list[Candidate]]:
    tiers: dict[int, list[Candidate]] = {}
    for option in options:
        tiers.setdefault(KERNEL_TIERS[option.compute_kernel], []).append(option)
    return [tiers[t] for t in sorted(tiers)]


def _moved(a: Assignment, rank: int) -> Assignment:
    return Assignment(a.option, np.array([rank]), a.load_factor, a.cost, a.hbm, a.ddr, a.ssd)


def _better(new: tuple[float, float], old: tuple[float, float]) -> bool:
    if new[0] < old[0] * (1 - _REL_EPS):
        return True
    return new[0] <= old[0] * (1 + _REL_EPS) and new[1] < old[1] * (1 - _REL_EPS)
