"""TorchRec's plan statistics: :class:`EmbeddingStats` (a per-rank
table of the chosen plan: storage, estimated time, shards by type), :class:`NoopEmbeddingStats`
and the imbalance measures of a distribution ``p`` over ``k`` ranks (0 when balanced).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from recsys_core.planner.interfaces import Stats
from recsys_core.planner.utils import bytes_to_gb

logger: logging.Logger = logging.getLogger(__name__)


def _normalize_float(p: list[float]) -> list[float]:
    total = sum(p)
    if not total > 0:
        raise ValueError(f"_normalize_float: values {p} must sum to > 0")
    return [x / total for x in p]


def _normalize_int(p: list[int]) -> list[float]:
    total = sum(p)
    if not total > 0:
        raise ValueError(f"_normalize_int: values {p} must sum to > 0")
    return [x * 1.0 / total for x in p]


def _check(p: list[float]) -> int:
    if not p:
        raise ValueError("an imbalance measure needs at least one rank")
    return len(p)


def _total_variation(p: list[float]) -> float:
    """Largest deviation from the uniform share: ``max |p_i - 1/k|``."""
    k = _check(p)
    return max(abs(x - 1.0 / k) for x in p)


def _total_distance(p: list[float]) -> float:
    """``sum |p_i - 1/k|``."""
    k = _check(p)
    return sum(abs(x - 1.0 / k) for x in p)


def _chi_sq_divergence(p: list[float]) -> float:
    """``sum k (p_i - 1/k)^2``."""
    k = _check(p)
    return sum(abs(x - 1.0 / k) ** 2.0 * k for x in p)


def _kl_divergence(p: list[float]) -> float:
    """KL(p || uniform) = ``sum p_i log(k p_i)``."""
    k = _check(p)
    return sum(x * math.log(k * x) for x in p if x > 0)


def _calc_max_chi_sq_divergence(N: int) -> float:
    """The chi-square divergence of everything on one of N ranks."""
    if N <= 0:
        raise ValueError(f"N={N} must be > 0")
    return (((N - 1) / N) ** 2.0) * N + (N - 1) * (1 / N)


def _calc_max_kl_divergence(N: int) -> float:
    """The KL divergence of everything on one of N ranks: log N."""
    if N <= 0:
        raise ValueError(f"N={N} must be > 0")
    return math.log(N)


def _normalized_kl_divergence(p: list[float]) -> float:
    top = _calc_max_kl_divergence(_check(p))
    return _kl_divergence(p) / top if top > 0 else 0.0


def _normalized_chi_sq_divergence(p: list[float]) -> float:
    top = _calc_max_chi_sq_divergence(_check(p))
    return _chi_sq_divergence(p) / top if top > 0 else 0.0


IMBALANCE_STAT_MEASURE = {
    "Total Variation": (_total_variation, {}),
    "Total Distance": (_total_distance, {}),
    "Chi Divergence": (_normalized_chi_sq_divergence, {}),
    "KL Divergence": (_normalized_kl_divergence, {}),
}


class EmbeddingStats(Stats):
    """Logs (and with ``debug`` prints) TorchRec's framed summary of the chosen plan in
    ``_stats_table``: per rank HBM and DDR in GB, estimated ms per step and shards by sharding
    type; the top HBM usage ("Top HBM Memory Usage Estimation: <GB> GB"), the perf imbalance
    measures and how many tables had their compute kernel fixed by constraints ("Compute Kernel
    Constraints:" / "Hardcoded: n, Auto-selected: m").

    This planner's own search hands it its plan through :meth:`defer`: the table is built the
    first time ``_stats_table`` is read, so planning pays nothing for statistics nobody reads.
    """

    def __init__(self) -> None:
        self._table: list[str] = []
        self._pending: Any = None
        self._width = 80

    @property
    def _stats_table(self) -> list[str]:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.log(**pending(), debug=False)
        return self._table

    @_stats_table.setter
    def _stats_table(self, value: list[str]) -> None:
        self._table = value

    def defer(self, inputs: Any) -> None:
        """Logs ``log(**inputs())`` when ``_stats_table`` is next read."""
        self._pending = inputs

    def log(
        self,
        sharding_plan: Any,
        topology: Any,
        batch_size: int,
        storage_reservation: Any,
        num_proposals: int,
        num_plans: int,
        run_time: float,
        best_plan: list[Any],
        constraints: dict[str, Any] | None = None,
        sharders: list[Any] | None = None,
        enumerator: Any = None,
        debug: bool = True,
        debug_stats: Any = None,
    ) -> None:
        self._pending = None
        world = topology.world_size
        hbm, ddr, perf = [0] * world, [0] * world, [0.0] * world
        types: list[dict[str, int]] = [{} for _ in range(world)]
        for so in best_plan:
            for shard in so.shards:
                if shard.rank is None:
                    continue
                if shard.storage is not None:
                    hbm[shard.rank] += shard.storage.hbm
                    ddr[shard.rank] += shard.storage.ddr
                if shard.perf is not None:
                    perf[shard.rank] += shard.perf.total
                kind = "".join(w[0].upper() for w in str(so.sharding_type).split("_"))
                types[shard.rank][kind] = types[shard.rank].get(kind, 0) + 1
        rows = [f"{'Rank':>4} | {'HBM (GB)':>9} | {'DDR (GB)':>9} | {'Perf (ms)':>10} | Shards"]
        for rank in range(world):
            shards = ", ".join(f"{k}: {v}" for k, v in sorted(types[rank].items()))
            rows.append(f"{rank:>4} | {bytes_to_gb(hbm[rank]):>9.3f} | "
                        f"{bytes_to_gb(ddr[rank]):>9.3f} | {perf[rank]:>10.3f} | {shards}")
        rows.append("")
        rows.append(f"Top HBM Memory Usage Estimation: {round(bytes_to_gb(max(hbm)), 3)} GB")
        if sum(perf) > 0:
            p = _normalize_float(perf)
            rows.append("Perf imbalance: " + ", ".join(
                f"{name} {fn(p, **kw):.3f}" for name, (fn, kw) in IMBALANCE_STAT_MEASURE.items()))
        fixed = [so for so in best_plan
                 if constraints and constraints.get(so.name) is not None
                 and constraints[so.name].compute_kernels]
        rows += ["", "Compute Kernel Constraints:",
                 f"   Hardcoded: {len(fixed)}, Auto-selected: {len(best_plan) - len(fixed)}"]
        width = max(self._width, max(len(r) for r in rows) + 4)
        title = (f"--- Planner Statistics: {num_proposals} proposals, {num_plans} plans, "
                 f"{run_time:.3f} s, batch size {batch_size} ---")
        lines = ["#" * width, f"#{title: ^{width - 2}}#"]
        lines += [f"# {row: <{width - 3}}#" for row in rows]
        lines.append("#" * width)
        self._table = lines
        for line in lines:
            logger.info(line)
        if debug:
            print("\n".join(lines))


class NoopEmbeddingStats(Stats):
    """Logs nothing."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        pass
