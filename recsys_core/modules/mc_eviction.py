"""Eviction policies of ``MCHManagedCollisionModule`` and its threshold filters (TorchRec's
names; importable from ``recsys_core.modules.mc_modules`` as in TorchRec).

At each table update a policy scores the ``zch_size`` entries of the table together with the
new ids seen since the last update; the ``zch_size`` best stay, the rest leave::

    merged = [entry scores ..., new id scores ...]     (higher is kept)
    keep the top zch_size (stable: on ties an entry beats a new id, an earlier one a later one)
    entries outside the top are evicted; new ids inside it take the evicted entries in order

The last entry of the table always scores highest, so the shared row for misses is never given
away. LFU scores by count, LRU by recency ``-(now - last_access + 1) ** decay_exponent``,
distance-LFU by ``count / (now - last_access + 1) ** decay_exponent``.
"""


import abc
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = [
    "DistanceLFU_EvictionPolicy",
    "LFU_EvictionPolicy",
    "LRU_EvictionPolicy",
    "MCHEvictionPolicy",
    "MCHEvictionPolicyMetadataInfo",
    "average_threshold_filter",
    "dynamic_threshold_filter",
    "probabilistic_threshold_filter",
]

_INT64_MAX = torch.iinfo(torch.int64).max
ThresholdFilter = Callable[[torch.Tensor], tuple[torch.Tensor, float | torch.Tensor]]


# ---- threshold filters (which of the counted ids may enter) --------------------------------
@torch.no_grad()
def dynamic_threshold_filter(
    id_counts: torch.Tensor, threshold_skew_multiplier: float = 10.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep ids counted more than ``total / num_ids * threshold_skew_multiplier`` times."""
    threshold = (1 / id_counts.numel()) * threshold_skew_multiplier * id_counts.sum()
    return id_counts > threshold, threshold


@torch.no_grad()
def average_threshold_filter(id_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep ids counted more than the mean count."""
    counts = id_counts if id_counts.dtype == torch.float else id_counts.float()
    threshold = counts.mean()
    return counts > threshold, threshold


@torch.no_grad()
def probabilistic_threshold_filter(
    id_counts: torch.Tensor, per_id_probability: float = 0.01
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep an id seen ``c`` times with probability ``1 - (1 - per_id_probability) ** c``."""
    keep_none = torch.full_like(id_counts, 1 - per_id_probability, dtype=torch.float)
    scores = 1 - torch.pow(keep_none, id_counts)
    threshold = torch.rand(id_counts.size(), device=id_counts.device)
    return scores > threshold, threshold


# ---- the policy interface -------------------------------------------------------------------
class MCHEvictionPolicyMetadataInfo(NamedTuple):
    """A metadata column a policy keeps: per table entry (``_mch_<name>``) and/or per recorded
    id (``_history_<name>``)."""

    metadata_name: str
    is_mch_metadata: bool
    is_history_metadata: bool


class MCHEvictionPolicy(abc.ABC):
    """Decides, at each table update, which new ids enter and which entries they replace.

    Args:
        metadata_info: the metadata columns the policy keeps.
        threshold_filtering_func: optional ``f(unique id counts) -> (mask, threshold)``; ids
            outside the mask are ignored at this update (TorchRec marks it experimental).
    """

    def __init__(
        self,
        metadata_info: list[MCHEvictionPolicyMetadataInfo],
        threshold_filtering_func: ThresholdFilter | None = None,
    ) -> None:
        self._metadata_info = metadata_info
        self._threshold_filtering_func = threshold_filtering_func

    @property
    def metadata_info(self) -> list[MCHEvictionPolicyMetadataInfo]:
        return self._metadata_info

    @abc.abstractmethod
    def record_history_metadata(
        self, current_iter: int, incoming_ids: torch.Tensor, history_metadata: dict[str, torch.Tensor]
    ) -> None:
        """Fill this batch's slice of the history metadata columns."""

    @abc.abstractmethod
    def coalesce_history_metadata(
        self,
        current_iter: int,
        history_metadata: dict[str, torch.Tensor],
        unique_ids_counts: torch.Tensor,
        unique_inverse_mapping: torch.Tensor,
        additional_ids: torch.Tensor | None = None,
        threshold_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Reduce the history metadata to one value per unique recorded id."""

    @abc.abstractmethod
    def update_metadata_and_generate_eviction_scores(
        self,
        current_iter: int,
        mch_size: int,
        coalesced_history_argsort_mapping: torch.Tensor,
        coalesced_history_sorted_unique_ids_counts: torch.Tensor,
        coalesced_history_mch_matching_elements_mask: torch.Tensor,
        coalesced_history_mch_matching_indices: torch.Tensor,
        mch_metadata: dict[str, torch.Tensor],
        coalesced_history_metadata: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Update the entries' metadata; return ``(evicted entry positions, indices of the
        entering ids among the new ones)``, paired in order."""

    def _compute_selected_eviction_and_replacement_indices(
        self, pivot: int, eviction_scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort(eviction_scores, descending=True, stable=True)
        kept, dropped = order[:pivot], order[pivot:]
        evicted = dropped[dropped < pivot]
        entering = kept[kept >= pivot] - pivot
        return evicted, entering


def _split_new(
    values: torch.Tensor, matching: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return values[matching], values[~matching]


def _merge_counts(
    counts: torch.Tensor,
    sorted_unique_ids_counts: torch.Tensor,
    matching: torch.Tensor,
    matching_indices: torch.Tensor,
    mch_size: int,
) -> torch.Tensor:
    """Add the counts of ids already in the table to their entries (the miss row is pinned at
    the top); return the new ids' counts."""
    seen, new_counts = _split_new(sorted_unique_ids_counts, matching)
    counts[matching_indices] += seen
    counts[mch_size - 1] = _INT64_MAX
    return new_counts


# ---- policies -------------------------------------------------------------------------------
class LFU_EvictionPolicy(MCHEvictionPolicy):  # noqa: N801 (TorchRec's name)
    """Least frequently used: an entry's score is how often its id was seen while in the
    table (counts accumulate across updates)."""

    def __init__(self, threshold_filtering_func: ThresholdFilter | None = None) -> None:
        super().__init__(
            [MCHEvictionPolicyMetadataInfo("counts", True, False)], threshold_filtering_func
        )

    def record_history_metadata(
        self, current_iter: int, incoming_ids: torch.Tensor, history_metadata: dict[str, torch.Tensor]
    ) -> None:
        return None

    def coalesce_history_metadata(
        self,
        current_iter: int,
        history_metadata: dict[str, torch.Tensor],
        unique_ids_counts: torch.Tensor,
        unique_inverse_mapping: torch.Tensor,
        additional_ids: torch.Tensor | None = None,
        threshold_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        return {}

    def update_metadata_and_generate_eviction_scores(
        self,
        current_iter: int,
        mch_size: int,
        coalesced_history_argsort_mapping: torch.Tensor,
        coalesced_history_sorted_unique_ids_counts: torch.Tensor,
        coalesced_history_mch_matching_elements_mask: torch.Tensor,
        coalesced_history_mch_matching_indices: torch.Tensor,
        mch_metadata: dict[str, torch.Tensor],
        coalesced_history_metadata: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        counts = mch_metadata["counts"]
        new_counts = _merge_counts(
            counts, coalesced_history_sorted_unique_ids_counts,
            coalesced_history_mch_matching_elements_mask, coalesced_history_mch_matching_indices,
            mch_size,
        )
        evicted, entering = self._compute_selected_eviction_and_replacement_indices(
            mch_size, torch.cat([counts, new_counts])
        )
        counts[evicted] = new_counts[entering]
        return evicted, entering


class _LastAccessPolicy(MCHEvictionPolicy):
    """The policies that record each id's last access step (``last_access_iter``, per entry and
    per recorded id) and discount by ``(now - last_access + 1) ** decay_exponent``."""

    def __init__(
        self,
        counts: bool,
        decay_exponent: float,
        threshold_filtering_func: ThresholdFilter | None,
    ) -> None:
        super().__init__(
            ([MCHEvictionPolicyMetadataInfo("counts", True, False)] if counts else [])
            + [MCHEvictionPolicyMetadataInfo("last_access_iter", True, True)],
            threshold_filtering_func,
        )
        self._decay_exponent = decay_exponent
        self._with_counts = counts

    def record_history_metadata(
        self, current_iter: int, incoming_ids: torch.Tensor, history_metadata: dict[str, torch.Tensor]
    ) -> None:
        history_metadata["last_access_iter"][:] = current_iter

    def coalesce_history_metadata(
        self,
        current_iter: int,
        history_metadata: dict[str, torch.Tensor],
        unique_ids_counts: torch.Tensor,
        unique_inverse_mapping: torch.Tensor,
        additional_ids: torch.Tensor | None = None,
        threshold_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Each unique id's latest access step."""
        last_access = history_metadata["last_access_iter"]
        if additional_ids is not None:
            last_access = torch.cat([last_access, torch.full_like(additional_ids, current_iter)])
        latest = torch.zeros_like(unique_ids_counts).scatter_reduce_(
            0, unique_inverse_mapping, last_access, reduce="amax", include_self=False
        )
        if threshold_mask is not None:
            latest = latest[threshold_mask]
        return {"last_access_iter": latest}

    def update_metadata_and_generate_eviction_scores(
        self,
        current_iter: int,
        mch_size: int,
        coalesced_history_argsort_mapping: torch.Tensor,
        coalesced_history_sorted_unique_ids_counts: torch.Tensor,
        coalesced_history_mch_matching_elements_mask: torch.Tensor,
        coalesced_history_mch_matching_indices: torch.Tensor,
        mch_metadata: dict[str, torch.Tensor],
        coalesced_history_metadata: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """LRU scores by staleness alone (the stalest entries leave first); distance-LFU
        divides the counts by it."""
        last_access = mch_metadata["last_access_iter"]
        counts: torch.Tensor | None = None
        new_counts = last_access  # read only with counts
        if self._with_counts:
            counts = mch_metadata["counts"]
            new_counts = _merge_counts(
                counts, coalesced_history_sorted_unique_ids_counts,
                coalesced_history_mch_matching_elements_mask,
                coalesced_history_mch_matching_indices, mch_size,
            )
        new_access = self._merge_last_access(
            current_iter, mch_size, coalesced_history_argsort_mapping,
            coalesced_history_mch_matching_elements_mask, coalesced_history_mch_matching_indices,
            mch_metadata, coalesced_history_metadata,
        )
        staleness = self._staleness(current_iter, last_access, new_access)
        scores = (torch.neg(staleness) if counts is None
                  else torch.div(torch.cat([counts, new_counts]), staleness))
        evicted, entering = self._compute_selected_eviction_and_replacement_indices(
            mch_size, scores
        )
        if counts is not None:
            counts[evicted] = new_counts[entering]
        last_access[evicted] = new_access[entering]
        return evicted, entering

    def _merge_last_access(
        self,
        current_iter: int,
        mch_size: int,
        argsort_mapping: torch.Tensor,
        matching: torch.Tensor,
        matching_indices: torch.Tensor,
        mch_metadata: dict[str, torch.Tensor],
        coalesced_history_metadata: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Write the last access of ids already in the table to their entries (the miss row
        counts as seen now); return the new ids' last access steps."""
        last_access = mch_metadata["last_access_iter"]
        history = coalesced_history_metadata["last_access_iter"]
        history.copy_(history[argsort_mapping])  # into count order
        seen, new_access = _split_new(history, matching)
        last_access[matching_indices] = seen
        last_access[mch_size - 1] = current_iter
        return new_access

    def _staleness(
        self, current_iter: int, last_access: torch.Tensor, new_access: torch.Tensor
    ) -> torch.Tensor:
        """``(now - last_access + 1) ** decay_exponent`` of the entries, then the new ids."""
        merged = torch.cat([last_access, new_access])
        return torch.pow(current_iter - merged + 1, self._decay_exponent)


class LRU_EvictionPolicy(_LastAccessPolicy):  # noqa: N801 (TorchRec's name)
    """Least recently used: entries not seen for the longest time leave first."""

    def __init__(
        self,
        decay_exponent: float = 1.0,
        threshold_filtering_func: ThresholdFilter | None = None,
    ) -> None:
        super().__init__(False, decay_exponent, threshold_filtering_func)


class DistanceLFU_EvictionPolicy(_LastAccessPolicy):  # noqa: N801 (TorchRec's name)
    """Counts discounted by staleness: ``count / (now - last_access + 1) ** decay_exponent``."""

    def __init__(
        self,
        decay_exponent: float = 1.0,
        threshold_filtering_func: ThresholdFilter | None = None,
    ) -> None:
        super().__init__(True, decay_exponent, threshold_filtering_func)
