"""TorchRec's proposers: which sharding option of each table to try next.

- :class:`GreedyProposer`: each table's options by estimated time; after each proposal, the
  table whose current option uses the most memory moves to its next option.
- :class:`UniformProposer`: one proposal per sharding type every table has (best option each).
- :class:`GridSearchProposer`: every combination (when at most ``max_proposals``).
- :class:`DynamicProgrammingProposer`: least total time under total-HBM bins, one proposal per
  reachable bin, largest first.
- :class:`EmbeddingOffloadScaleupProposer`: grows the caches of FUSED_UVM_CACHING tables into
  spare HBM, by a Luus-Jaakola search over the extra budget.

:func:`proposers_to_proposals_list` lists the distinct proposals of proposers whose sequence
does not depend on feedback.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable

import torch

from recsys_core.plan.params import CacheAlgorithm
from recsys_core.planner.interfaces import Enumerator, Proposer
from recsys_core.planner.sharding_option import ShardingOption
from recsys_core.planner.topology import Topology
from recsys_core.planner.utils import LuusJaakolaSearch, bytes_to_gb, prod

logger: logging.Logger = logging.getLogger(__name__)

MAX_PROPOSALS: int = int(1e4)
_FUSED = "fused"
_CACHING = "fused_uvm_caching"


def _sharding_option_score(sharding_option: ShardingOption, use_depth: bool = True) -> float:
    """Slowest shard's time (``use_depth``) or all shards' time."""
    totals = [shard.perf.total for shard in sharding_option.shards]
    return max(totals) if use_depth else sum(totals)


def _by_fqn(search_space: list[ShardingOption]) -> dict[str, list[ShardingOption]]:
    grouped: dict[str, list[ShardingOption]] = {}
    for sharding_option in search_space:
        grouped.setdefault(sharding_option.fqn, []).append(sharding_option)
    return grouped


class GreedyProposer(Proposer):
    """Starts from each table's fastest option; after each proposal the table whose current
    option has the largest (max HBM, total HBM, max DDR, total DDR) of shards moves to its
    next option. Stops when no table has one left, or (``threshold``) after that many
    consecutive proposals rated worse than the best."""

    def __init__(self, use_depth: bool = True, threshold: int | None = None) -> None:
        self._use_depth = use_depth
        self._threshold = threshold if threshold else None
        self._sharding_options_by_fqn: dict[str, list[ShardingOption]] = {}
        self._current_proposal: dict[str, int] = {}
        self._best_perf_rating = float("inf")
        self._num_inferior_perf = 0

    def load(self, search_space: list[ShardingOption], enumerator: Enumerator | None = None) -> None:
        self._sharding_options_by_fqn = _by_fqn(search_space)
        for options in self._sharding_options_by_fqn.values():
            options.sort(key=lambda x: _sharding_option_score(x, self._use_depth))
        self._current_proposal = {fqn: 0 for fqn in self._sharding_options_by_fqn}

    def propose(self) -> list[ShardingOption] | None:
        if not self._current_proposal:
            return None
        return [self._sharding_options_by_fqn[fqn][i] for fqn, i in self._current_proposal.items()]

    def feedback(
        self,
        partitionable: bool,
        plan: list[ShardingOption] | None = None,
        perf_rating: float | None = None,
        storage_constraint: Topology | None = None,
    ) -> None:
        if self._threshold and perf_rating:
            self._num_inferior_perf += 1
            if perf_rating < self._best_perf_rating:
                self._best_perf_rating = perf_rating
                self._num_inferior_perf = 0
            if self._num_inferior_perf > self._threshold:
                self._current_proposal = {}
                return
        largest_fqn = None
        largest: tuple[float, float, float, float] = (0, 0, 0, 0)
        for fqn, options in self._sharding_options_by_fqn.items():
            index = self._current_proposal[fqn]
            if index + 1 >= len(options):
                continue
            storages = [shard.storage for shard in options[index].shards]
            current = (max(s.hbm for s in storages), sum(s.hbm for s in storages),
                       max(s.ddr for s in storages), sum(s.ddr for s in storages))
            if current > largest:
                largest_fqn, largest = fqn, current
        if largest_fqn is None:
            self._current_proposal = {}
        else:
            self._current_proposal[largest_fqn] += 1


class _ListedProposer(Proposer):
    """A proposer whose proposals are listed at load: each feedback moves to the next one,
    whatever it says."""

    _proposal_index = 0

    def feedback(
        self,
        partitionable: bool,
        plan: list[ShardingOption] | None = None,
        perf_rating: float | None = None,
        storage_constraint: Topology | None = None,
    ) -> None:
        self._proposal_index += 1


class UniformProposer(_ListedProposer):
    """One proposal per sharding type that every table has: each table's fastest option of
    that type (types in the order the search space first shows them)."""

    def __init__(self, use_depth: bool = True) -> None:
        self._use_depth = use_depth
        self._grouped_sharding_options: list[list[ShardingOption]] = []
        self._proposal_index = 0

    def load(self, search_space: list[ShardingOption], enumerator: Enumerator | None = None) -> None:
        self._grouped_sharding_options, self._proposal_index = [], 0
        all_fqns = {so.fqn for so in search_space}
        by_type: dict[str, dict[str, list[ShardingOption]]] = {}
        for so in search_space:
            by_type.setdefault(so.sharding_type, {}).setdefault(so.fqn, []).append(so)
        for by_fqn in by_type.values():
            if by_fqn.keys() != all_fqns:
                continue
            self._grouped_sharding_options.append([
                min(options, key=lambda x: _sharding_option_score(x, self._use_depth))
                for options in by_fqn.values()
            ])

    def propose(self) -> list[ShardingOption] | None:
        if self._proposal_index < len(self._grouped_sharding_options):
            return self._grouped_sharding_options[self._proposal_index]
        return None


class GridSearchProposer(_ListedProposer):
    """Every combination of the tables' options (each table's sorted by total time), in
    ``itertools.product`` order; none when there are more than ``max_proposals``."""

    def __init__(self, max_proposals: int = MAX_PROPOSALS) -> None:
        self._max_proposals = max_proposals
        self._sharding_options_by_fqn: dict[str, list[ShardingOption]] = {}
        self._proposal_index = 0
        self._proposals: list[tuple[int, ...]] = []

    def load(self, search_space: list[ShardingOption], enumerator: Enumerator | None = None) -> None:
        self._proposal_index, self._proposals = 0, []
        self._sharding_options_by_fqn = _by_fqn(search_space)
        for options in self._sharding_options_by_fqn.values():
            options.sort(key=_sharding_option_score)
        total = prod(len(options) for options in self._sharding_options_by_fqn.values())
        if total > self._max_proposals:
            logger.info("GridSearchProposer: %d proposals exceed max_proposals=%d; skipped",
                        total, self._max_proposals)
            return
        self._proposals = list(itertools.product(
            *(range(len(options)) for options in self._sharding_options_by_fqn.values())
        ))

    def propose(self) -> list[ShardingOption] | None:
        if self._proposal_index >= len(self._proposals):
            return None
        indices = self._proposals[self._proposal_index]
        return [options[i] for i, options in zip(indices, self._sharding_options_by_fqn.values(), strict=False)]


class DynamicProgrammingProposer(Proposer):
    """Minimum total time subject to total HBM, by dynamic programming over HBM bins.

    The first proposal is every table's smallest-HBM option. Its feedback (which must carry
    ``storage_constraint``) splits the topology's total HBM into ``hbm_bins_per_device`` bins
    per rank; ``dp[i][b]`` is the least time of the first i tables using b bins (fractional
    bin counts carried, as TorchRec's). Then one proposal per reachable final bin, from the
    largest HBM total down: the partitioner decides which of them fits per rank.
    """

    def __init__(self, hbm_bins_per_device: int = 100) -> None:
        self._inited = False
        self._hbm_bins_per_device = max(hbm_bins_per_device, 1)
        self._sharding_options_by_fqn: OrderedDict[str, list[ShardingOption]] = OrderedDict()
        self._proposal_list: list[list[int]] = []
        self._current_proposal = -1

    def load(self, search_space: list[ShardingOption], enumerator: Enumerator | None = None) -> None:
        self._sharding_options_by_fqn = OrderedDict()
        self._proposal_list, self._current_proposal = [], -1
        for so in sorted(search_space, key=lambda x: x.total_storage.hbm):
            self._sharding_options_by_fqn.setdefault(so.fqn, []).append(so)

    def propose(self) -> list[ShardingOption] | None:
        if not self._inited:
            return [options[0] for options in self._sharding_options_by_fqn.values()]
        if self._current_proposal < 0:
            return None
        indices = self._proposal_list[self._current_proposal]
        return [options[i] for options, i in zip(self._sharding_options_by_fqn.values(), indices, strict=False)]

    def feedback(
        self,
        partitionable: bool,
        plan: list[ShardingOption] | None = None,
        perf_rating: float | None = None,
        storage_constraint: Topology | None = None,
    ) -> None:
        if self._inited:
            self._current_proposal += 1
            if self._current_proposal >= len(self._proposal_list):
                self._current_proposal = -1
            return
        self._inited = True
        if storage_constraint is None:
            raise ValueError("DynamicProgrammingProposer.feedback: the first feedback needs "
                             "storage_constraint (the topology whose HBM is binned)")
        tables = list(self._sharding_options_by_fqn.values())
        n_tables, n_options = len(tables), max(len(x) for x in tables)
        bins = self._hbm_bins_per_device * len(storage_constraint.devices)
        bin_size = float(sum(d.storage.hbm for d in storage_constraint.devices)) / bins
        inf = float("inf")
        hbm = [[inf] * n_options for _ in range(n_tables)]
        perf = [[inf] * n_options for _ in range(n_tables)]
        for t, options in enumerate(tables):
            for j, so in enumerate(options):
                hbm[t][j] = float(so.total_storage.hbm) / bin_size
                perf[t][j] = so.total_perf
        dp = [[(inf, inf)] * bins for _ in range(n_tables)]  # (time, bins used)
        back = [[(-1, -1)] * bins for _ in range(n_tables)]  # (option, previous bin)
        for j in range(n_options):
            if hbm[0][j] < bins:
                b = int(hbm[0][j])
                if dp[0][b][0] > perf[0][j]:
                    dp[0][b], back[0][b] = (perf[0][j], hbm[0][j]), (j, -1)
        for t in range(1, n_tables):
            for j in range(n_options):
                for b in range(bins):
                    prev_perf, prev_hbm = dp[t - 1][b]
                    if prev_perf == inf:
                        continue
                    used = prev_hbm + hbm[t][j]
                    if used < bins:
                        nb, total = int(used), prev_perf + perf[t][j]
                        if dp[t][nb][0] > total:
                            dp[t][nb], back[t][nb] = (total, used), (j, b)
        self._proposal_list = []
        for c in range(bins - 1, -1, -1):
            option, prev = back[n_tables - 1][c]
            if option < 0:
                continue
            indices = [-1] * n_tables
            indices[-1] = option
            for t in range(n_tables - 2, -1, -1):
                indices[t], prev = back[t][prev]
            self._proposal_list.append(indices)
        if self._proposal_list:
            self._current_proposal = 0


def _set_load_factor(so: ShardingOption, clf: float | None) -> None:
    # CacheParams is frozen here (TorchRec's is mutable): the option gets a changed copy.
    if so.cache_params is not None:
        so.cache_params = dataclasses.replace(so.cache_params, load_factor=clf)


def _make_fused(so: ShardingOption) -> None:
    _set_load_factor(so, None)
    so.compute_kernel = _FUSED


class EmbeddingOffloadScaleupProposer(Proposer):
    """Grows FUSED_UVM_CACHING caches into the HBM a first plan leaves free.

    The starting proposal is each table's fastest option, a caching one where the table has
    one; caches whose estimated size is larger than the whole table in HBM are promoted to
    FUSED first. After the first (partitioned) plan, the extra HBM budget is searched in
    ``[0, min(free HBM, what promoting every cache would need)]`` by :class:`LuusJaakolaSearch`
    (16 iterations); each budget is shared among the caches in proportion to their
    cacheability x expected lookups (``cache_params.stats``), caches that reach the table size
    becoming FUSED. An unpartitionable plan shrinks the search range to below its budget.
    """

    def __init__(self, use_depth: bool = True) -> None:
        self.use_depth = use_depth
        self.enumerator: Enumerator | None = None
        self.starting_proposal: list[ShardingOption] = []
        self.proposal: list[ShardingOption] | None = None
        self.search: LuusJaakolaSearch | None = None
        self.best_perf_rating: float = 1e99

    def load(self, search_space: list[ShardingOption], enumerator: Enumerator | None = None) -> None:
        self.enumerator = enumerator
        by_fqn = _by_fqn(search_space)
        for options in by_fqn.values():
            options.sort(key=lambda x: _sharding_option_score(x, self.use_depth))
        self.starting_proposal = copy.deepcopy(self._build_proposal_from_sharding_options(by_fqn))
        self.promote_high_prefetch_overheaad_table_to_hbm(self.enumerator, self.starting_proposal)
        self.proposal = copy.deepcopy(self.starting_proposal)

    @staticmethod
    def _build_proposal_from_sharding_options(
        sharding_options_by_fqn: dict[str, list[ShardingOption]],
    ) -> list[ShardingOption]:
        """One option per table, in the given order: the first caching one, else the first;
        a warning names each table whose other options are dropped, an error each cache that
        is not LRU (the budget search assumes LRU's hit rates)."""
        proposal = []
        for fqn, options in sharding_options_by_fqn.items():
            chosen = next((so for so in options if so.compute_kernel == _CACHING), options[0])
            if len(options) > 1:
                logger.warning(
                    f"EmbeddingOffloadScaleupProposer - ignored {len(options) - 1} sharding "
                    f"options for table {fqn}: it keeps one per table ({chosen.sharding_type}, "
                    f"{chosen.compute_kernel})")
            algorithm = chosen.cache_params.algorithm if chosen.cache_params else None
            if algorithm is not None and algorithm != CacheAlgorithm.LRU:
                logger.error(
                    "EmbeddingOffloadScaleupProposer - proposer only supports LRU cache algorithm; "
                    f"table {fqn} uses {algorithm}")
            proposal.append(chosen)
        return proposal

    @staticmethod
    def get_hbm_ceiling(starting_proposal: list[ShardingOption], enumerator: Enumerator) -> int:
        """HBM of the proposal with every scalable cache promoted to FUSED."""
        proposal = copy.deepcopy(starting_proposal)
        cached = EmbeddingOffloadScaleupProposer.get_scalable_sharding_options(proposal)
        for so in cached:
            _make_fused(so)
        enumerator.populate_estimates(cached)
        return sum(so.total_storage.hbm for so in proposal)

    @staticmethod
    def promote_high_prefetch_overheaad_table_to_hbm(
        enumerator: Enumerator | None, proposal: list[ShardingOption]
    ) -> None:
        """Caching tables that would use less HBM as FUSED become FUSED (in place)."""
        if not enumerator:
            return
        originals = [so for so in proposal if so.compute_kernel == _CACHING]
        what_if = copy.deepcopy(originals)
        for so in what_if:
            _make_fused(so)
        enumerator.populate_estimates(what_if)
        for fused, original in zip(what_if, originals, strict=False):
            if fused.total_storage.hbm < original.total_storage.hbm:
                _make_fused(original)
        enumerator.populate_estimates(originals)

    def propose(self) -> list[ShardingOption] | None:
        return self.proposal

    def feedback(
        self,
        partitionable: bool,
        plan: list[ShardingOption] | None = None,
        perf_rating: float | None = None,
        storage_constraint: Topology | None = None,
    ) -> None:
        if not self.enumerator or plan is None:
            self.proposal = None
            return
        used = sum(so.total_storage.hbm for so in plan)
        if self.search is None:
            if not partitionable or storage_constraint is None:
                self.proposal = None
                return
            available = self.get_budget(plan, storage_constraint)
            need = self.get_hbm_ceiling(plan, self.enumerator) - used
            budget = min(available, need)
            logger.info("EmbeddingOffloadScaleupProposer: plan %.2f GB, exploring caches of up "
                        "to %.2f GB more", bytes_to_gb(used), bytes_to_gb(budget))
            self.search = LuusJaakolaSearch(0, budget, max_iterations=16, left_cost=perf_rating)
        if perf_rating is not None and perf_rating < self.best_perf_rating:
            self.best_perf_rating = perf_rating
        if not partitionable:
            start = sum(so.total_storage.hbm for so in self.starting_proposal)
            self.search.shrink_right(used - start)
        probe = self.search.next(perf_rating or 1e99)
        self.proposal = self.next_plan(
            self.starting_proposal, None if probe is None else int(probe), self.enumerator
        )

    @staticmethod
    def get_budget(proposal: list[ShardingOption], storage_constraint: Topology) -> int:
        """HBM the topology has beyond what ``proposal`` uses."""
        available = sum(device.storage.hbm for device in storage_constraint.devices)
        return available - sum(so.total_storage.hbm for so in proposal)

    @staticmethod
    def get_scalable_sharding_options(proposal: list[ShardingOption]) -> list[ShardingOption]:
        """Caching options with cacheability x expected lookups x load factor > 0."""
        return [
            so for so in proposal
            if so.compute_kernel == _CACHING
            and (EmbeddingOffloadScaleupProposer.get_cacheability(so) or 0.0)
            * (EmbeddingOffloadScaleupProposer.get_expected_lookups(so) or 0.0)
            * (so.cache_load_factor or 0.0) > 0
        ]

    @staticmethod
    def next_plan(
        starting_proposal: list[ShardingOption], budget: int | None,
        enumerator: Enumerator | None,
    ) -> list[ShardingOption] | None:
        """The starting proposal with ``budget`` more bytes of cache (None: search over)."""
        if budget is None or enumerator is None:
            return None
        proposal = copy.deepcopy(starting_proposal)
        cached = EmbeddingOffloadScaleupProposer.get_scalable_sharding_options(proposal)
        if not cached:
            return None
        model, ceiling = EmbeddingOffloadScaleupProposer.build_affine_storage_model(
            cached, enumerator)
        clfs = torch.tensor([so.cache_load_factor for so in cached])
        priority = torch.tensor([
            (EmbeddingOffloadScaleupProposer.get_cacheability(so) or 0.0)
            * (EmbeddingOffloadScaleupProposer.get_expected_lookups(so) or 0.0)
            for so in cached
        ])
        new_clfs = EmbeddingOffloadScaleupProposer.allocate_budget(
            model=model, fused_hbm_ceiling=ceiling, clfs=clfs, budget=budget,
            allocation_priority=priority)
        for so, clf in zip(cached, new_clfs.tolist(), strict=False):
            _set_load_factor(so, clf)
            if clf > 0.9999:  # the whole table: FUSED instead
                _make_fused(so)
        enumerator.populate_estimates(cached)
        return proposal

    @staticmethod
    def get_cacheability(sharding_option: ShardingOption) -> float | None:
        params = sharding_option.cache_params
        stats = getattr(params, "stats", None) if params is not None else None
        return None if stats is None else stats.cacheability

    @staticmethod
    def get_expected_lookups(sharding_option: ShardingOption) -> float | None:
        params = sharding_option.cache_params
        stats = getattr(params, "stats", None) if params is not None else None
        return None if stats is None else stats.expected_lookups

    @staticmethod
    def build_affine_storage_model(
        uvm_caching_sharding_options: list[ShardingOption], enumerator: Enumerator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per option, HBM = a * load_factor + b (fitted at 0.1 and 0.9) as an [N, 2] tensor,
        and each option's HBM as FUSED."""
        plan = copy.deepcopy(uvm_caching_sharding_options)

        def hbm_after(change: Callable[[ShardingOption], None]) -> torch.Tensor:
            for so in plan:
                change(so)
            enumerator.populate_estimates(plan)
            return torch.tensor([so.total_storage.hbm for so in plan])

        def set_clf(clf: float) -> Callable[[ShardingOption], None]:
            def change(so: ShardingOption) -> None:
                _set_load_factor(so, clf)
            return change

        low, high = 0.1, 0.9
        low_hbm = hbm_after(set_clf(low))
        high_hbm = hbm_after(set_clf(high))
        fused_hbm = hbm_after(_make_fused)
        a = (high_hbm - low_hbm) / (high - low)
        return torch.stack((a, low_hbm - a * low), dim=1), fused_hbm

    @staticmethod
    def clf_to_bytes(model: torch.Tensor, clfs: float | torch.Tensor) -> torch.Tensor:
        return (model[:, 0] * clfs + model[:, 1]).to(torch.float64)

    @staticmethod
    def allocate_budget(
        model: torch.Tensor,
        fused_hbm_ceiling: torch.Tensor,
        clfs: torch.Tensor,
        budget: int,
        allocation_priority: torch.Tensor,
    ) -> torch.Tensor:
        """New load factors: ``budget`` bytes shared in proportion to ``allocation_priority``
        among the caches below their table size, repeatedly (at most 128 passes); a cache
        whose size passes its FUSED size becomes the whole table and returns the excess."""
        to_bytes = EmbeddingOffloadScaleupProposer.clf_to_bytes
        min_size, max_size = to_bytes(model, 0), to_bytes(model, 1)
        cache_size = to_bytes(model, clfs) - min_size
        max_cache = max_size - min_size
        passes = 0
        while budget > 1 and passes < 128:
            passes += 1
            mask = (min_size + cache_size) < max_size
            if mask.sum() == 0:
                break
            priority = (mask * allocation_priority).to(torch.float64)
            grown = torch.minimum(cache_size + budget * priority / priority.sum(), max_cache)
            budget -= torch.sum(grown - cache_size).item()
            cache_size = grown
            promotes = mask & (min_size + cache_size > fused_hbm_ceiling)
            if promotes.sum() > 0:
                budget += torch.sum(((min_size + cache_size) - fused_hbm_ceiling)[promotes]).item()
                cache_size[promotes] = max_cache[promotes]
        return (cache_size / max_cache).to(clfs.dtype)


def proposers_to_proposals_list(
    proposers_list: list[Proposer], search_space: list[ShardingOption]
) -> list[list[ShardingOption]]:
    """Every distinct proposal of ``proposers_list`` (in order), each fed back as
    partitionable. For proposers whose sequence does not depend on the ratings."""
    proposals, seen = [], set()
    for proposer in proposers_list:
        proposer.load(search_space=search_space)
    for proposer in proposers_list:
        proposal = proposer.propose()
        while proposal:
            key = tuple(sorted(map(hash, proposal)))
            proposer.feedback(partitionable=True)
            if key not in seen:
                proposals.append(proposal)
                seen.add(key)
            proposal = proposer.propose()
    return proposals
