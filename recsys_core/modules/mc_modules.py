"""Managed collisions (zero-collision hashing): raw ids of unbounded range mapped to the rows of
a fixed-size table, each live id with a row of its own (TorchRec's ``torchrec.modules.mc_modules``).

``MCHManagedCollisionModule`` keeps a sorted remapping table: ``_mch_sorted_raw_ids`` (ascending
raw ids, ``INT64_MAX`` marks a free entry) and ``_mch_remapped_ids_mapping`` (the row each entry
owns). Every ``eviction_interval`` training steps it counts the ids seen since the last update
and lets its eviction policy decide which new ids enter and which entries they replace. The
last row is never given to an id: ids not in the table map to it::

    zch_size 4, LFU, eviction_interval 1; batch [10, 20, 10, 30, 40, 50]
    counts: 10 x2, 20/30/40/50 x1 -> 3 usable rows; 10, 20, 30 enter (ties: smaller id first)
    _mch_sorted_raw_ids       [10, 20, 30, MAX]
    _mch_remapped_ids_mapping [ 0,  1,  2,   3]
    remap -> [0, 1, 0, 2, 3, 3]      (40 and 50 missed: the shared row 3)

The table, the policy's per-row metadata (``_mch_counts``, ``_mch_last_access_iter``) and the
step counter are buffers, so they live in ``state_dict``. In eval mode nothing is counted or
evicted: ids are only looked up.
"""


import abc
import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from recsys_core.modules import mc_eviction
from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.modules.mc_eviction import *  # noqa: F403 (re-exported: see __all__)
from recsys_core.modules.mc_eviction import MCHEvictionPolicy
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor

logger = logging.getLogger(__name__)

__all__ = [
    *mc_eviction.__all__,  # the eviction policies and filters, importable from here as in TorchRec
    "MCHManagedCollisionModule",
    "ManagedCollisionCollection",
    "ManagedCollisionModule",
    "apply_mc_method_to_jt_dict",
]

_INT64_MAX = torch.iinfo(torch.int64).max
_MAX_SHARDS = 1024


# ---- graph leaves (one call each in an fx graph, compiled as functions by TorchScript) -------
@torch.fx.wrap
def apply_mc_method_to_jt_dict(
    mc_module: nn.Module, method: str, features_dict: dict[str, JaggedTensor]
) -> dict[str, JaggedTensor]:
    """Call ``mc_module.<method>(features_dict)`` (TorchRec's helper, kept for its callers)."""
    return getattr(mc_module, method)(features_dict)


@torch.fx.wrap
def _update(
    base: dict[str, JaggedTensor] | None, delta: dict[str, JaggedTensor]
) -> dict[str, JaggedTensor]:
    res: dict[str, JaggedTensor] = {}
    if base is not None:
        for k, v in base.items():
            res[k] = v
    for k, v in delta.items():
        res[k] = v
    return res


@torch.fx.wrap
def _cat_jagged_values(jd: dict[str, JaggedTensor]) -> torch.Tensor:
    return torch.cat([jt.values() for jt in jd.values()])


@torch.fx.wrap
def _cat_jagged_lengths(jd: dict[str, JaggedTensor]) -> torch.Tensor:
    return torch.cat([jt.lengths() for jt in jd.values()])


@torch.fx.wrap
def _get_length_per_key(kjt: KeyedJaggedTensor) -> torch.Tensor:
    return torch.tensor(kjt.length_per_key())


@torch.fx.wrap
def _mcc_lazy_init_inplace(
    features: KeyedJaggedTensor,
    feature_names: list[str],
    features_order: list[int],
    created_feature_order: list[bool],
) -> KeyedJaggedTensor:
    """Permute the input's keys to the collection's table order (computed on the first call)."""
    input_feature_names: list[str] = features.keys()
    if len(created_feature_order) == 0 or not created_feature_order[0]:
        for f in feature_names:
            if f not in input_feature_names:
                raise ValueError(
                    "ManagedCollisionCollection: feature '" + f + "' is missing from the input "
                    + "(keys " + str(input_feature_names) + "); every table's features must be "
                    + "present"
                )
            features_order.append(input_feature_names.index(f))
        if features_order == list(range(len(input_feature_names))):
            features_order.clear()
        if len(created_feature_order) > 0:
            created_feature_order[0] = True
        else:
            created_feature_order.append(True)
    if len(features_order) > 0:
        features = features.permute(features_order)
    return features


@torch.fx.wrap
def route_blocks(ids: torch.Tensor, input_size: int, blocks: int) -> torch.Tensor:
    """The row block (a row-wise shard's rank) of each id: with ``block = ceil(input_size /
    blocks)``, ids in ``[0, block * blocks)`` go to ``id // block``, others to ``id mod blocks``
    (TorchRec's bucketization of managed-collision inputs)."""
    ids = ids.to(torch.int64)
    if blocks == 1:
        return torch.zeros_like(ids)
    # ceil without overflow: TorchScript's ints are int64 and input_size is often int64's max
    block = max(input_size // blocks + (1 if input_size % blocks != 0 else 0), 1)
    by_block = torch.div(ids.clamp(min=0), block, rounding_mode="floor")
    inside = (ids >= 0) & (by_block < blocks)  # id < block * blocks, never computed
    return torch.where(inside, by_block, ids.remainder(blocks))


@torch.fx.wrap
def _mch_remap(
    features: dict[str, JaggedTensor],
    mch_sorted_raw_ids: torch.Tensor,
    mch_remapped_ids_mapping: torch.Tensor,
    zch_index: int,
    miss_block_ends: torch.Tensor | None = None,
    first_row: int = 0,
    input_size: int = 0,
) -> dict[str, JaggedTensor]:
    """Each id's row: its entry's row when the sorted table holds it, else ``zch_index``; with
    ``miss_block_ends`` (the last row of each training row block), the last row of the block
    the id was routed to, where that row lies in ``[first_row, zch_index]``. A leaf when traced
    (``torch.fx.wrap``), as TorchRec's: its loop over the features is not traceable."""
    remapped: dict[str, JaggedTensor] = {}
    for name, feature in features.items():
        values = feature.values()
        _check_ids(values, name)
        ids = values.to(torch.int64)
        position = torch.searchsorted(mch_sorted_raw_ids[:-1], ids)
        hit = mch_sorted_raw_ids[position] == ids
        if miss_block_ends is None:
            miss = torch.full_like(ids, zch_index)
        else:
            block_rows = miss_block_ends[route_blocks(ids, input_size, miss_block_ends.numel())]
            in_module = (block_rows >= first_row) & (block_rows <= zch_index)
            miss = torch.where(in_module, block_rows, torch.full_like(ids, zch_index))
        rows = torch.where(hit, mch_remapped_ids_mapping[position], miss)
        remapped[name] = JaggedTensor(
            values=rows.to(values.dtype),
            lengths=feature.lengths(),
            offsets=feature.offsets(),
            weights=feature.weights_or_none(),
        )
    return remapped


def _check_ids(values: torch.Tensor, name: str) -> None:
    if values.dtype != torch.int64 and values.dtype != torch.int32:
        raise TypeError(
            "managed collision: feature '" + name + "' has ids of dtype " + str(values.dtype)
            + "; ids must be torch.int64 (or torch.int32)"
        )


# ---- the interface --------------------------------------------------------------------------
class ManagedCollisionModule(nn.Module):
    """Maps a feature's raw ids into ``[0, output_size())`` (abstract; TorchRec's base class).

    Args:
        device: where the module's state lives.
        output_segments: the boundaries of the row ranges the table is split into when sharded
            row-wise (``[start, end]`` unsharded); at most 1024 ranges.
        skip_state_validation: skip the segment buffers and the check after loading a state.
        read_only_suffix: features named ``<name><suffix>`` are looked up without inserting.
        enable_per_feature_lookups: kept for TorchRec compatibility (hash modules).
    """

    def __init__(
        self,
        device: torch.device,
        output_segments: list[int],
        skip_state_validation: bool = False,
        read_only_suffix: str = "_readonly",
        enable_per_feature_lookups: bool = False,
    ) -> None:
        super().__init__()
        self._device = torch.device(device)
        self._enable_per_feature_lookups = enable_per_feature_lookups
        self._read_only_suffix = read_only_suffix
        if skip_state_validation:
            logger.info(
                "ManagedCollisionModule: state validation skipped; the module may not be "
                "reshardable"
            )
            return
        if len(output_segments) > _MAX_SHARDS + 1:
            raise ValueError(
                f"ManagedCollisionModule: {len(output_segments) - 1} output segments; at most "
                f"{_MAX_SHARDS} row-wise shards are supported"
            )
        padded = list(output_segments) + [-1] * (_MAX_SHARDS + 1 - len(output_segments))
        self.register_buffer(
            "_output_segments_tensor",
            torch.tensor(padded, dtype=torch.int64, device=self._device),
        )
        self.register_buffer(
            "_current_iter_tensor", torch.zeros(1, dtype=torch.int64, device=self._device)
        )
        self.register_load_state_dict_post_hook(_validate_after_load)

    @property
    def read_only_suffix(self) -> str:
        """Features whose name ends with it are looked up but never inserted (TorchRec 1.9's
        name; ``readable_suffix``, TorchRec 1.8's, returns the same)."""
        return self._read_only_suffix

    @property
    def readable_suffix(self) -> str:
        return self._read_only_suffix

    @property
    def device(self) -> torch.device:
        return self._device

    @abc.abstractmethod
    def preprocess(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]: ...

    @abc.abstractmethod
    def evict(self) -> torch.Tensor | None:
        """Rows whose owner changed since the last call (to re-initialise), or None."""

    @abc.abstractmethod
    def remap(
        self,
        features: dict[str, JaggedTensor],
        mutate_miss_lengths: bool = True,
        write_weights: torch.Tensor | None = None,
    ) -> dict[str, JaggedTensor]: ...

    @abc.abstractmethod
    def profile(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]: ...

    @abc.abstractmethod
    def forward(
        self, features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True
    ) -> dict[str, JaggedTensor]: ...

    @abc.abstractmethod
    def output_size(self) -> int:
        """Rows of the downstream table (remapped ids lie in ``[0, output_size())``)."""

    @abc.abstractmethod
    def input_size(self) -> int:
        """Range of the raw ids (for sharding)."""

    @abc.abstractmethod
    def buckets(self) -> int:
        """Number of uniform buckets (resharding granularity)."""

    @abc.abstractmethod
    def validate_state(self) -> None:
        """Check the state after loading a checkpoint."""

    @abc.abstractmethod
    def open_slots(self) -> torch.Tensor:
        """Rows not yet given to an id."""

    @abc.abstractmethod
    def rebuild_with_output_id_range(
        self,
        output_id_range: tuple[int, int],
        output_segments: list[int],
        device: torch.device | None = None,
    ) -> "ManagedCollisionModule":
        """A module owning rows ``[start, end)`` of this one (a row-wise shard)."""


def _validate_after_load(module: ManagedCollisionModule, incompatible_keys: object) -> None:
    module.validate_state()


# ---- the sorted-table module ----------------------------------------------------------------
class MCHManagedCollisionModule(ManagedCollisionModule):
    """Zero-collision hashing with a sorted remapping table (see the module docstring).

    Args:
        zch_size: rows managed (``> 0``); ids land in ``[output_global_offset,
            output_global_offset + zch_size)``, the last of which is the shared row for misses.
        device: where the table lives.
        eviction_policy: which ids enter and which leave (``LFU_EvictionPolicy`` etc.).
        eviction_interval: training steps between updates of the table (``> 0``).
        input_hash_size: range of raw ids, passed to ``input_hash_func``.
        input_hash_func: optional ``f(ids, input_hash_size) -> ids`` applied first.
        mch_size / mch_hash_func: deprecated in TorchRec and ignored there; ignored here too
            (a warning says so).
        name: a name for messages (the table's, in a collection).
        output_global_offset: first row of this module's range (row-wise shards).
        output_segments: row-range boundaries of all shards (default ``[offset, offset+size]``).
        buckets: uniform buckets (resharding granularity).

    Ids seen since the last update are kept in a history buffer that grows as needed (TorchRec
    sizes it from the first batch and drops ids past its end).
    """

    _mch_sorted_raw_ids: torch.Tensor
    _mch_remapped_ids_mapping: torch.Tensor

    def __init__(
        self,
        zch_size: int,
        device: torch.device,
        eviction_policy: MCHEvictionPolicy,
        eviction_interval: int,
        input_hash_size: int = (2**63) - 1,
        input_hash_func: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        mch_size: int | None = None,
        mch_hash_func: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        name: str | None = None,
        output_global_offset: int = 0,
        output_segments: list[int] | None = None,
        buckets: int = 1,
    ) -> None:
        where = f"MCHManagedCollisionModule {name!r}" if name else "MCHManagedCollisionModule"
        if isinstance(zch_size, bool) or not isinstance(zch_size, int) or zch_size <= 0:
            raise ValueError(f"{where}: zch_size must be a positive int, got {zch_size!r}")
        if (
            isinstance(eviction_interval, bool)
            or not isinstance(eviction_interval, int)
            or eviction_interval <= 0
        ):
            raise ValueError(
                f"{where}: eviction_interval must be a positive int, got {eviction_interval!r}"
            )
        if not isinstance(eviction_policy, MCHEvictionPolicy):
            raise TypeError(
                f"{where}: eviction_policy must be an MCHEvictionPolicy (LFU_EvictionPolicy, "
                f"LRU_EvictionPolicy, ...), got {eviction_policy!r}"
            )
        if output_segments is None:
            output_segments = [output_global_offset, output_global_offset + zch_size]
        super().__init__(device=device, output_segments=output_segments)
        if mch_size is not None or mch_hash_func is not None:
            logger.warning(
                "%s: mch_size / mch_hash_func (a co-located hash table for missing ids) are "
                "deprecated and ignored, as in TorchRec",
                where,
            )
        self._init_output_segments_tensor: torch.Tensor = self._output_segments_tensor
        self._miss_segments: list[int] | None = None
        """The row blocks of the training that made the loaded state (its row-wise shards),
        while this module has not trained since: in eval mode an id without a row gets the
        last row of the block it was routed to in that training, as it did there (None: this
        module's own last row)."""
        self._name = name
        self._input_hash_size = input_hash_size
        self._input_hash_func = input_hash_func
        self._zch_size: int = zch_size
        self._output_global_offset: int = output_global_offset
        self._eviction_interval = eviction_interval
        self._eviction_policy = eviction_policy
        self._buckets = buckets
        self._current_iter: int = -1
        self._last_eviction_iter: int = -1
        self._evicted: bool = False
        self._evicted_emb_indices: torch.Tensor = torch.empty(
            0, dtype=torch.int64, device=self._device
        )
        self._input_history_buffer_size: int = -1
        self._current_history_buffer_offset: int = 0
        self._mch_metadata: dict[str, torch.Tensor] = {}
        self._history_metadata: dict[str, torch.Tensor] = {}
        self._init_buffers()
        self._init_metadata_buffers()

    def _init_buffers(self) -> None:
        size, dev = self._zch_size, self._device
        self.register_buffer(
            "_mch_sorted_raw_ids", torch.full((size,), _INT64_MAX, dtype=torch.int64, device=dev)
        )
        self.register_buffer(
            "_mch_slots", torch.tensor([size - 1], dtype=torch.int64, device=dev), persistent=False
        )
        self.register_buffer(
            "_delimiter",
            torch.tensor([_INT64_MAX], dtype=torch.int64, device=dev),
            persistent=False,
        )
        start = self._output_global_offset
        self.register_buffer(
            "_mch_remapped_ids_mapping",
            torch.arange(start, start + size, dtype=torch.int64, device=dev),
        )

    def _init_metadata_buffers(self) -> None:
        for info in self._eviction_policy.metadata_info:
            if info.is_mch_metadata:
                buffer_name = "_mch_" + info.metadata_name
                self.register_buffer(
                    buffer_name,
                    torch.zeros(self._zch_size, dtype=torch.int64, device=self._device),
                )
                self._mch_metadata[info.metadata_name] = getattr(self, buffer_name)

    def _init_history_buffers(self, capacity: int) -> None:
        self._input_history_buffer_size = capacity
        self._history_accumulator = torch.empty(capacity, dtype=torch.int64, device=self.device)
        for info in self._eviction_policy.metadata_info:
            if info.is_history_metadata:
                buffer_name = "_history_" + info.metadata_name
                self.register_buffer(
                    buffer_name,
                    torch.zeros(capacity, dtype=torch.int64, device=self.device),
                    persistent=False,
                )
                self._history_metadata[info.metadata_name] = getattr(self, buffer_name)

    def _grow_history(self, needed: int) -> None:
        """Double the history buffers (keeping their contents) until ``needed`` fits."""
        capacity = max(self._input_history_buffer_size, 1)
        while capacity < needed:
            capacity *= 2
        used = self._current_history_buffer_offset
        grown = torch.empty(capacity, dtype=torch.int64, device=self.device)
        grown[:used] = self._history_accumulator[:used]
        self._history_accumulator = grown
        for metadata_name, old in list(self._history_metadata.items()):
            new = torch.zeros(capacity, dtype=torch.int64, device=self.device)
            new[:used] = old[:used]
            setattr(self, "_history_" + metadata_name, new)
            self._history_metadata[metadata_name] = new
        self._input_history_buffer_size = capacity

    # ---- ManagedCollisionModule ---------------------------------------------------------------
    def preprocess(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        if self._input_hash_func is None:
            return features
        out: dict[str, JaggedTensor] = {}
        for name, feature in features.items():
            try:
                hashed = self._input_hash_func(feature.values(), self._input_hash_size)
            except ValueError as e:  # name the feature the hash function refused
                raise ValueError(f"{self._label(name)}: {e}") from None
            out[name] = JaggedTensor(
                values=hashed,
                lengths=feature.lengths(),
                offsets=feature.offsets(),
                weights=feature.weights_or_none(),
            )
        return out

    def reset_inference_mode(self) -> None:
        self._evicted = False
        self._last_eviction_iter = -1

    def profile(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        """Training only: record this batch's ids; every ``eviction_interval`` steps update the
        table from the ids recorded since the last update."""
        if not self.training:
            return features
        self._miss_segments = None  # trained from here on under its own rows
        if self._current_iter == -1:
            self._current_iter = int(self._current_iter_tensor.item())
            self._last_eviction_iter = self._current_iter
        self._current_iter += 1
        self._current_iter_tensor.add_(1)

        parts = []
        for name, feature in features.items():
            values = feature.values()
            _check_ids(values, self._label(name))
            parts.append(values.to(torch.int64))
        values = torch.cat(parts) if len(parts) != 1 else parts[0]
        if self._input_history_buffer_size == -1:
            self._init_history_buffers(int(values.numel() * self._eviction_interval * 1.25) + 1)
        start = self._current_history_buffer_offset
        end = start + values.numel()
        if end > self._input_history_buffer_size:
            self._grow_history(end)
        self._history_accumulator[start:end] = values
        self._eviction_policy.record_history_metadata(
            self._current_iter,
            values,
            {k: v[start:end] for k, v in self._history_metadata.items()},
        )
        self._current_history_buffer_offset = end

        if self._current_iter - self._last_eviction_iter == self._eviction_interval:
            self._coalesce_history()
            self._last_eviction_iter = self._current_iter
        return features

    def remap(
        self,
        features: dict[str, JaggedTensor],
        mutate_miss_lengths: bool = True,
        write_weights: torch.Tensor | None = None,
    ) -> dict[str, JaggedTensor]:
        last = self._output_global_offset + self._zch_size - 1
        segments = self._miss_segments
        if segments is None or self.training:
            return _mch_remap(
                features, self._mch_sorted_raw_ids, self._mch_remapped_ids_mapping, last
            )
        # the training's row block of each id; its last row where this module holds it
        ends = torch.tensor(segments[1:], dtype=torch.int64, device=self._device) - 1
        return _mch_remap(
            features, self._mch_sorted_raw_ids, self._mch_remapped_ids_mapping, last, ends,
            self._output_global_offset, self.input_size(),
        )

    def forward(
        self, features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True
    ) -> dict[str, JaggedTensor]:
        """Preprocess (hash), profile (training), remap."""
        features = self.preprocess(features)
        features = self.profile(features)
        return self.remap(features)

    def output_size(self) -> int:
        return self._zch_size

    def buckets(self) -> int:
        return self._buckets

    def input_size(self) -> int:
        return self._input_hash_size

    def open_slots(self) -> torch.Tensor:
        return self._mch_slots - torch.searchsorted(self._mch_sorted_raw_ids, self._delimiter)

    @torch.no_grad()
    def evict(self) -> torch.Tensor | None:
        if not self._evicted:
            return None
        self._evicted = False
        return self._evicted_emb_indices

    def validate_state(self) -> None:
        """After loading: the module's row range must be one of the checkpoint's segments, and the
        table must be a remapping of exactly this module's rows."""
        start = self._output_global_offset
        end = start + self._zch_size
        segments = self._output_segments_tensor
        if not (bool((segments == start).any()) and bool((segments == end).any())):
            raise ValueError(
                f"{self._label()}: the loaded state's output segments "
                f"{[s for s in segments.tolist() if s >= 0]} do not contain this module's row "
                f"range [{start}, {end}); the state belongs to a differently sized table"
            )
        mapping = self._mch_remapped_ids_mapping
        expected = torch.arange(start, end, dtype=mapping.dtype, device=mapping.device)
        if not torch.equal(torch.sort(mapping).values, expected):
            raise ValueError(
                f"{self._label()}: the loaded _mch_remapped_ids_mapping is not a permutation of "
                f"rows [{start}, {end}); the remapping state comes from another model or shard"
            )
        loaded = [int(v) for v in segments.tolist() if v >= 0]
        own = [start, end]
        self._miss_segments = None if loaded == own or len(loaded) < 3 else loaded
        self._output_segments_tensor = self._init_output_segments_tensor
        self._sort_mch_buffers()

    def rebuild_with_output_id_range(
        self,
        output_id_range: tuple[int, int],
        output_segments: list[int],
        device: torch.device | None = None,
    ) -> "MCHManagedCollisionModule":
        return type(self)(
            name=self._name,
            zch_size=output_id_range[1] - output_id_range[0],
            device=device or self.device,
            eviction_policy=self._eviction_policy,
            eviction_interval=self._eviction_interval,
            input_hash_size=self._input_hash_size,
            input_hash_func=self._input_hash_func,
            output_global_offset=output_id_range[0],
            output_segments=output_segments,
            buckets=len(output_segments) - 1,
        )

    # ---- internals ----------------------------------------------------------------------------
    @torch.jit.unused
    def _label(self, feature: str | None = None) -> str:
        name = self._name or getattr(self, "_table_name", None)
        label = f"MCHManagedCollisionModule {name!r}" if name else "MCHManagedCollisionModule"
        return label if feature is None else f"{label}, feature {feature!r}"

    @torch.no_grad()
    def _match_indices(
        self, sorted_sequence: torch.Tensor, search_values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        position = torch.searchsorted(sorted_sequence[:-1], search_values)
        matching = sorted_sequence[position] == search_values
        return matching, position[matching]

    @torch.no_grad()
    def _sort_mch_buffers(self) -> None:
        order = torch.argsort(self._mch_sorted_raw_ids, stable=True)
        self._mch_sorted_raw_ids.copy_(self._mch_sorted_raw_ids[order])
        self._mch_remapped_ids_mapping.copy_(self._mch_remapped_ids_mapping[order])
        for buffer in self._mch_metadata.values():
            buffer.copy_(buffer[order])

    @torch.no_grad()
    def _coalesce_history(self) -> None:
        used = self._current_history_buffer_offset
        history = self._history_accumulator[:used]
        uniq_ids, inverse, counts = torch.unique(history, return_inverse=True, return_counts=True)
        threshold_mask: torch.Tensor | None = None
        if self._eviction_policy._threshold_filtering_func is not None:
            threshold_mask, _ = self._eviction_policy._threshold_filtering_func(counts)
        metadata = self._eviction_policy.coalesce_history_metadata(
            self._current_iter,
            {k: v[:used] for k, v in self._history_metadata.items()},
            counts,
            inverse,
            threshold_mask=threshold_mask,
        )
        if threshold_mask is not None:
            uniq_ids = uniq_ids[threshold_mask]
            counts = counts[threshold_mask]
        self._update_and_evict(uniq_ids, counts, metadata)
        self._current_history_buffer_offset = 0

    @torch.no_grad()
    def _update_and_evict(
        self,
        uniq_ids: torch.Tensor,
        uniq_ids_counts: torch.Tensor,
        uniq_ids_metadata: dict[str, torch.Tensor],
    ) -> None:
        by_count = torch.argsort(uniq_ids_counts, descending=True, stable=True)
        ids = uniq_ids[by_count]
        counts = uniq_ids_counts[by_count]
        matching, matched_positions = self._match_indices(self._mch_sorted_raw_ids, ids)
        new_ids = ids[~matching]
        evicted_positions, selected_new = (
            self._eviction_policy.update_metadata_and_generate_eviction_scores(
                self._current_iter,
                self._zch_size,
                by_count,
                counts,
                matching,
                matched_positions,
                self._mch_metadata,
                uniq_ids_metadata,
            )
        )
        self._mch_sorted_raw_ids[evicted_positions] = new_ids[selected_new]
        rows = self._mch_remapped_ids_mapping[evicted_positions]
        if self._evicted:  # rows from an earlier update not yet consumed by evict()
            rows = torch.unique(torch.cat([self._evicted_emb_indices, rows]))
        self._evicted_emb_indices = rows
        self._evicted = True
        self._sort_mch_buffers()


# ---- the collection -------------------------------------------------------------------------
class ManagedCollisionCollection(nn.Module):
    """One managed-collision module per table: remaps a KJT's ids table by table.

    Args:
        managed_collision_modules: ``{table name: module}``; every table needs one, and its
            ``output_size()`` must equal the table's ``num_embeddings``.
        embedding_configs: the tables (their ``feature_names`` select the KJT keys).
        need_preprocess: kept for TorchRec compatibility.

    ``forward`` returns a KJT with the same keys, lengths and batch, ids replaced by rows.
    Features of one table are remapped together by that table's module.
    """

    _table_to_features: dict[str, list[str]]
    _features_order: list[int]
    _created_feature_order: list[bool]

    def __init__(
        self,
        managed_collision_modules: dict[str, ManagedCollisionModule],
        embedding_configs: Sequence[BaseEmbeddingConfig],
        need_preprocess: bool = True,
    ) -> None:
        super().__init__()
        self._managed_collision_modules = nn.ModuleDict(managed_collision_modules)
        self._embedding_configs = embedding_configs
        self.need_preprocess = need_preprocess
        self._feature_to_table: dict[str, str] = {
            f: c.name for c in embedding_configs for f in c.feature_names
        }
        self._table_to_features = {c.name: list(c.feature_names) for c in embedding_configs}
        self._table_name_to_config: dict[str, BaseEmbeddingConfig] = {
            c.name: c for c in embedding_configs
        }
        for name, config in self._table_name_to_config.items():
            if name not in managed_collision_modules:
                raise ValueError(
                    f"ManagedCollisionCollection: table {name!r} has no managed collision module "
                    f"(modules given for {sorted(managed_collision_modules)})"
                )
            module = managed_collision_modules[name]
            if module.output_size() != config.num_embeddings:
                raise ValueError(
                    f"ManagedCollisionCollection: table {name!r} has num_embeddings "
                    f"{config.num_embeddings} but its managed collision module maps to "
                    f"{module.output_size()} rows; they must be equal"
                )
            if getattr(module, "_name", None) is None:
                module._table_name = name  # for messages only
        extra = sorted(set(managed_collision_modules) - set(self._table_name_to_config))
        if extra:
            raise ValueError(
                f"ManagedCollisionCollection: modules given for unknown tables {extra}"
            )
        # Tables in module order, so that splits line up with the modules when iterating.
        order = list(self._managed_collision_modules.keys())
        self._table_feature_splits: list[int] = [len(self._table_to_features[t]) for t in order]
        self._feature_names: list[str] = [f for t in order for f in self._table_to_features[t]]
        self._created_feature_order = [False]
        self._features_order = []

    def embedding_configs(self) -> Sequence[BaseEmbeddingConfig]:
        return self._embedding_configs

    def table_to_number_buckets(self) -> dict[str, int]:
        return {t: m.buckets() for t, m in self._managed_collision_modules.items()}

    def forward(
        self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True
    ) -> KeyedJaggedTensor:
        features = _mcc_lazy_init_inplace(
            features, self._feature_names, self._features_order, self._created_feature_order
        )
        splits: list[KeyedJaggedTensor] = features.split(self._table_feature_splits)
        output: dict[str, JaggedTensor] | None = None
        for i, (table, mc_module) in enumerate(self._managed_collision_modules.items()):
            kjt: KeyedJaggedTensor = splits[i]
            mc_input: dict[str, JaggedTensor] = {
                table: JaggedTensor(
                    values=kjt.values(),
                    lengths=kjt.lengths(),
                    weights=_get_length_per_key(kjt),
                )
            }
            mc_input = mc_module(mc_input, mutate_miss_lengths=mutate_miss_lengths)
            output = _update(output, mc_input)
        assert output is not None
        return KeyedJaggedTensor(
            keys=features.keys(),
            values=_cat_jagged_values(output),
            lengths=_cat_jagged_lengths(output),
            weights=features.weights_or_none(),
            stride=features.stride(),
            stride_per_key=features.stride_per_key(),
            stride_per_key_per_rank=features._stride_per_key_per_rank,
            inverse_indices=features.inverse_indices_or_none(),
        )

    def evict(self) -> dict[str, torch.Tensor | None]:
        """Per table: rows given to new ids since the last call (None when none)."""
        return {t: m.evict() for t, m in self._managed_collision_modules.items()}

    def open_slots(self) -> dict[str, torch.Tensor]:
        return {t: m.open_slots() for t, m in self._managed_collision_modules.items()}

    def lookup_runtime_meta(
        self, features: KeyedJaggedTensor, remapped_ids: KeyedJaggedTensor
    ) -> KeyedJaggedTensor:
        """Per id, its row's runtime metadata (hash modules with ``track_id_freq``; ``-1`` where
        a module keeps none), as a KJT shaped like ``features``."""
        feature_splits = features.split(self._table_feature_splits)
        remapped_splits = remapped_ids.split(self._table_feature_splits)
        metas: list[torch.Tensor] = []
        for i, mc_module in enumerate(self._managed_collision_modules.values()):
            meta = mc_module.lookup_runtime_meta(
                feature_splits[i].values(), remapped_splits[i].values()
            )
            metas.append(meta.reshape(-1))
        return KeyedJaggedTensor(
            keys=features.keys(),
            values=torch.cat(metas, dim=0),
            lengths=features.lengths(),
            weights=features.weights_or_none(),
            stride=features.stride(),
            stride_per_key=features.stride_per_key(),
            stride_per_key_per_rank=features._stride_per_key_per_rank,
            inverse_indices=features.inverse_indices_or_none(),
        )

    def lookup_custom_runtime_meta(self, remapped_ids: KeyedJaggedTensor) -> torch.Tensor:
        """Rows of each table's custom runtime metadata at the remapped ids, concatenated."""
        splits = remapped_ids.split(self._table_feature_splits)
        metas: list[torch.Tensor] = []
        for i, mc_module in enumerate(self._managed_collision_modules.values()):
            metas.append(mc_module.lookup_custom_runtime_meta(splits[i].values()))
        return torch.cat(metas, dim=0)


# The Union name is part of TorchRec's signatures of threshold functions.
ThresholdResult = tuple[torch.Tensor, float | torch.Tensor]
