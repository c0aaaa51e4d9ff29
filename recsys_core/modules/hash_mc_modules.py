"""Multi-probe zero-collision hashing (MPZCH): TorchRec 1.8's ``HashZchManagedCollisionModule``.

Instead of a sorted table, each row of the embedding table has an owner in an identity tensor
(``_hash_zch_identities``, ``[zch_size, 1]``, ``-1`` = free). An id hashes into its bucket and
probes forward for its own row or, in training, a free (or expired) one; see
:mod:`recsys_core.kernels.zch_hash` for the probing and a worked example. Buckets split the rows
so that row-wise shards own whole buckets::

    zch_size 20, total_num_buckets 2, input_hash_size 0:
    bucket of id x = x % 2   (input_hash_size > 0: x // ceil(input_hash_size / 2))
    bucket 0 -> rows [0, 10), bucket 1 -> rows [10, 20)

Training inserts and (with an eviction policy) evicts; eval and inference only look up, and an
id not found lands on its hash position (or is dropped with ``disable_fallback``).
"""


import logging
import math
from collections.abc import Iterator
from typing import Any

import torch

from recsys_core.kernels.zch_hash import zero_collision_hash
from recsys_core.modules.hash_mc_evictions import (
    HashZchEvictionConfig,
    HashZchEvictionModule,
    HashZchEvictionPolicyName,
    get_kernel_from_policy,
)
from recsys_core.modules.mc_modules import ManagedCollisionModule
from recsys_core.sparse import JaggedTensor

logger = logging.getLogger(__name__)

__all__ = [
    "HashZchManagedCollisionModule",
    "TrainInputMapper",
    "make_hash_zch_buckets_non_persistent",
]

_MAX_BUCKET_ROWS = 2**31 - 1  # the hash kernel's modulo arithmetic needs buckets below 2**31


@torch.fx.wrap
def _tensor_may_to_device(
    src: torch.Tensor, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.device]:
    src_device: torch.device = src.device
    if device is None:
        return (src, src_device)
    if device.type != "meta" and src_device != device:
        return (src.to(device), src_device)
    return (src, src_device)


@torch.fx.wrap
def _get_device(hash_zch_identities: torch.Tensor) -> torch.device:
    return hash_zch_identities.device


@torch.fx.wrap
def _check_hash_ids(values: torch.Tensor, name: str, input_hash_size: int) -> None:
    """Ids must be int32/int64 and in ``[0, input_hash_size)`` (any non-negative id when
    ``input_hash_size`` is 0): a negative id has no bucket and ``-1`` marks a free row."""
    if values.dtype != torch.int64 and values.dtype != torch.int32:
        raise TypeError(
            "HashZchManagedCollisionModule: feature '" + name + "' has ids of dtype "
            + str(values.dtype) + "; ids must be torch.int64 (or torch.int32)"
        )
    if values.numel() == 0:
        return
    if bool((values < 0).any()):
        raise ValueError(
            "HashZchManagedCollisionModule: feature '" + name + "' has negative id "
            + str(int(values.min())) + "; raw ids must be >= 0"
        )
    if input_hash_size > 0 and bool((values >= input_hash_size).any()):
        raise ValueError(
            "HashZchManagedCollisionModule: feature '" + name + "' has id "
            + str(int(values.max())) + " outside [0, input_hash_size=" + str(input_hash_size)
            + ")"
        )


def _compute_lengths_from_hits(lengths: torch.Tensor, hit_indices: torch.Tensor) -> torch.Tensor:
    """Per bag, how many of its ids are hits (``hit_indices`` has one entry per id)."""
    bag_of_id = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=lengths.device), lengths.to(torch.int64)
    )
    counts = torch.zeros(lengths.numel(), dtype=torch.int64, device=lengths.device)
    counts.index_add_(0, bag_of_id, hit_indices.to(torch.int64))
    return counts.to(lengths.dtype)


class TrainInputMapper(torch.nn.Module):
    """Each id's bucket size and first row (as the training ranks split the table).

    Args:
        input_hash_size: raw id range; 0 means ids are dealt to buckets by ``id % buckets``,
            otherwise by contiguous blocks of ``ceil(input_hash_size / buckets)``.
        total_num_buckets: buckets across all ranks.
        size_per_rank: rows per bucket.
        train_rank_offsets: first row of each bucket.
        inference_dispatch_div_train_world_size: also divide the id by the bucket count (or
            take it modulo the block), as TorchRec's inference dispatch does.
        name: for messages.
    """

    _zch_size_per_training_rank: torch.Tensor
    _train_rank_offsets: torch.Tensor

    def __init__(
        self,
        input_hash_size: int,
        total_num_buckets: int,
        size_per_rank: torch.Tensor,
        train_rank_offsets: torch.Tensor,
        inference_dispatch_div_train_world_size: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__()
        if total_num_buckets <= 0:
            raise ValueError(f"TrainInputMapper: total_num_buckets must be > 0, got {total_num_buckets}")
        self._input_hash_size = input_hash_size
        self._buckets = total_num_buckets
        self._inference_dispatch_div_train_world_size = inference_dispatch_div_train_world_size
        self._name = name
        self.register_buffer("_zch_size_per_training_rank", size_per_rank, persistent=False)
        self.register_buffer("_train_rank_offsets", train_rank_offsets, persistent=False)

    def forward(
        self, values: torch.Tensor, output_offset: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(ids, bucket sizes, bucket first rows - output_offset)``, one per id."""
        sizes, _ = _tensor_may_to_device(self._zch_size_per_training_rank, values.device)
        starts, _ = _tensor_may_to_device(self._train_rank_offsets, values.device)
        x = values
        if self._input_hash_size == 0:
            bucket = x % self._buckets
            if self._inference_dispatch_div_train_world_size:
                x = x // self._buckets
        else:
            block = (self._input_hash_size + self._buckets - 1) // self._buckets
            bucket = x // block
            if self._inference_dispatch_div_train_world_size:
                x = x % block
        local_sizes = sizes.index_select(0, bucket)
        offsets = starts.index_select(0, bucket)
        if output_offset is not None:
            offsets = offsets - output_offset
        return (x, local_sizes, offsets)


class HashZchManagedCollisionModule(ManagedCollisionModule):
    """TorchRec's MPZCH module (arguments, buffers and state_dict keys as TorchRec 1.8).

    Args:
        zch_size: rows of this (local) table; ``> 0`` and a multiple of ``total_num_buckets``
            unless ``output_segments`` is given.
        device: where the identity table lives.
        total_num_buckets: buckets of the whole table (a multiple of the world size when sharded).
        max_probe: rows probed per id (``> 0``).
        input_hash_size: raw id range (0: unbounded, ids dealt by ``id % buckets``).
        output_segments: row boundaries of the buckets (computed when not given).
        is_inference: start in inference mode (no metadata, read-only).
        name: the table's name.
        tb_logging_frequency: TorchRec's TensorBoard metrics; not available here (must be 0 when
            ``name`` is set).
        eviction_policy_name / eviction_config: ``HashZchEvictionPolicyName`` and its config.
        inference_dispatch_div_train_world_size: see :class:`TrainInputMapper`.
        start_bucket / end_bucket: this shard's buckets (set by sharding).
        opt_in_prob / percent_reserved_slots: admit a new id with probability ``opt_in_prob``
            percent; the others share the last ``percent_reserved_slots`` percent of each bucket.
        disable_fallback: drop ids not found (instead of using their hash row).
        track_id_freq: count lookups per row in ``_hash_zch_runtime_meta``.
        read_only_suffix: features named ``...<suffix>`` never insert.
        enable_per_feature_lookups: kept for TorchRec compatibility.
        no_bag: with ``disable_fallback``, misses become row 0 instead of being dropped.
        write_runtime_meta_dim: columns of custom per-row metadata (``update_runtime_meta``).
        persist_hash_zch_bucket: keep ``_hash_zch_bucket`` in ``state_dict``.
    """

    _evicted_indices: list[torch.Tensor]
    _hash_zch_metadata: torch.Tensor | None
    _hash_zch_runtime_meta: torch.Tensor | None

    IDENTITY_BUFFER: str = "_hash_zch_identities"
    METADATA_BUFFER: str = "_hash_zch_metadata"
    BUCKET_BUFFER: str = "_hash_zch_bucket"
    RUNTIME_META_BUFFER: str = "_hash_zch_runtime_meta"

    def __init__(
        self,
        zch_size: int,
        device: torch.device,
        total_num_buckets: int,
        max_probe: int = 128,
        input_hash_size: int = 0,
        output_segments: list[int] | None = None,
        is_inference: bool = False,
        name: str | None = None,
        tb_logging_frequency: int = 0,
        eviction_policy_name: HashZchEvictionPolicyName | None = None,
        eviction_config: HashZchEvictionConfig | None = None,
        inference_dispatch_div_train_world_size: bool = False,
        start_bucket: int = 0,
        end_bucket: int | None = None,
        opt_in_prob: int = -1,
        percent_reserved_slots: float = 0,
        disable_fallback: bool = False,
        track_id_freq: bool = False,
        read_only_suffix: str = "_readonly",
        enable_per_feature_lookups: bool = False,
        no_bag: bool = False,
        write_runtime_meta_dim: int = 0,
        persist_hash_zch_bucket: bool = True,
    ) -> None:
        where = f"HashZchManagedCollisionModule {name!r}" if name else "HashZchManagedCollisionModule"
        if isinstance(zch_size, bool) or not isinstance(zch_size, int) or zch_size <= 0:
            raise ValueError(f"{where}: zch_size must be a positive int, got {zch_size!r}")
        if total_num_buckets <= 0:
            raise ValueError(f"{where}: total_num_buckets must be > 0, got {total_num_buckets}")
        if max_probe <= 0:
            raise ValueError(f"{where}: max_probe must be > 0, got {max_probe}")
        if output_segments is None:
            if zch_size % total_num_buckets != 0:
                raise ValueError(
                    f"{where}: zch_size {zch_size} is not a multiple of total_num_buckets "
                    f"{total_num_buckets}; pass output_segments for uneven buckets"
                )
            per_bucket = zch_size // total_num_buckets
            output_segments = [per_bucket * b for b in range(total_num_buckets + 1)]
        super().__init__(device=device, output_segments=output_segments, skip_state_validation=True)
        sizes = torch.diff(torch.tensor(output_segments, dtype=torch.int64))
        if bool((sizes <= 0).any()) or int(sizes.max()) > _MAX_BUCKET_ROWS:
            raise ValueError(
                f"{where}: output_segments {output_segments} must increase, with buckets of "
                f"1 to {_MAX_BUCKET_ROWS} rows"
            )
        if not 0 <= percent_reserved_slots < 100:
            raise ValueError(f"{where}: percent_reserved_slots must be in [0, 100), got {percent_reserved_slots}")
        if opt_in_prob > 0 and percent_reserved_slots <= 0:
            raise ValueError(f"{where}: percent_reserved_slots must be > 0 when opt_in_prob is set")
        assert not (track_id_freq and write_runtime_meta_dim > 0), (
            f"{where}: _hash_zch_runtime_meta holds either id frequencies (track_id_freq) or "
            f"custom metadata (write_runtime_meta_dim), not both"
        )
        if tb_logging_frequency > 0 and name is not None and not is_inference:
            raise ValueError(
                f"{where}: tb_logging_frequency={tb_logging_frequency}: TorchRec's ZCH "
                "TensorBoard metrics (hash_mc_metrics.ScalarLogger) are not part of recsys_core; "
                "pass tb_logging_frequency=0"
            )
        self._zch_size: int = zch_size
        self._output_segments: list[int] = list(output_segments)
        self._start_bucket: int = start_bucket
        self._end_bucket: int = end_bucket if end_bucket is not None else total_num_buckets
        self._output_global_offset_tensor: torch.Tensor | None = None
        if output_segments[start_bucket] > 0:
            self._output_global_offset_tensor = torch.tensor(
                [output_segments[start_bucket]],
                dtype=torch.int64,
                device=device if torch.device(device).type != "meta" else torch.device("cpu"),
            )
        self._device = torch.device(device)
        self._input_hash_size: int = input_hash_size
        self._is_inference: bool = is_inference
        self._name: str | None = name
        self._tb_logging_frequency: int = 0
        self._eviction_policy_name: HashZchEvictionPolicyName | None = eviction_policy_name
        self._eviction_config: HashZchEvictionConfig | None = eviction_config
        self._eviction_module = (
            HashZchEvictionModule(eviction_policy_name, self._device, eviction_config)
            if eviction_policy_name is not None and self.training
            else None
        )
        self._opt_in_prob: int = opt_in_prob
        self._percent_reserved_slots: float = percent_reserved_slots
        self._disable_fallback: bool = disable_fallback
        self._track_id_freq: bool = track_id_freq
        self._write_runtime_meta_dim: int = write_runtime_meta_dim
        self._hash_zch_identities = torch.nn.Parameter(
            torch.full((zch_size, 1), -1, dtype=torch.int64, device=self._device),
            requires_grad=False,
        )
        metadata = (
            torch.full((zch_size, 1), -1, dtype=torch.int32, device=self._device)
            if self._eviction_module is not None
            else None
        )
        self.register_buffer(HashZchManagedCollisionModule.METADATA_BUFFER, metadata)
        self._hash_zch_runtime_meta = None
        meta_dim = 1 if track_id_freq else write_runtime_meta_dim
        if meta_dim > 0:
            self._hash_zch_runtime_meta = torch.nn.Parameter(
                torch.zeros((zch_size, meta_dim), dtype=torch.int64, device=self._device),
                requires_grad=False,
            )
        self._max_probe = max_probe
        self._buckets = total_num_buckets
        self._persist_hash_zch_bucket: bool = persist_hash_zch_bucket
        self.register_buffer(
            HashZchManagedCollisionModule.BUCKET_BUFFER,
            torch.tensor([[total_num_buckets]]),
            persistent=persist_hash_zch_bucket,
        )
        self._evicted_indices = []
        self.input_mapper: torch.nn.Module = TrainInputMapper(
            input_hash_size=input_hash_size,
            total_num_buckets=total_num_buckets,
            size_per_rank=sizes,
            train_rank_offsets=torch.cumsum(sizes, 0) - sizes,
            inference_dispatch_div_train_world_size=inference_dispatch_div_train_world_size,
            name=name,
        )
        if is_inference:
            self.reset_inference_mode()
        self._eviction_policy_name_copy: HashZchEvictionPolicyName | None = eviction_policy_name
        self._read_only_suffix: str = read_only_suffix
        self._enable_per_feature_lookups: bool = enable_per_feature_lookups
        self._no_bag = no_bag
        self._inference_dispatch_div_train_world_size = inference_dispatch_div_train_world_size

    # ---- properties ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return _get_device(self._hash_zch_identities)

    @property
    def max_probe(self) -> int:
        return self._max_probe

    @property
    def disable_fallback(self) -> bool:
        return self._disable_fallback

    @property
    def eviction_flag(self) -> int:
        return get_kernel_from_policy(self._eviction_policy_name)

    @property
    def is_sharded(self) -> bool:
        """True when this module holds only some of the table's buckets."""
        return (self._end_bucket - self._start_bucket) < self._buckets

    def buckets(self) -> int:
        return self._buckets

    def output_size(self) -> int:
        return self._zch_size

    def input_size(self) -> int:
        return self._input_hash_size

    def open_slots(self) -> torch.Tensor:
        return torch.tensor([0])

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Buffers, plus the identity table and id counts (parameters in TorchRec's layout,
        listed here as TorchRec does for publishing)."""
        yield from super().named_buffers(prefix, recurse, remove_duplicate)
        dot = f"{prefix}." if prefix else ""
        yield (f"{dot}{self.IDENTITY_BUFFER}", self._hash_zch_identities.data)
        if self._track_id_freq and self._hash_zch_runtime_meta is not None:
            yield (f"{dot}{self.RUNTIME_META_BUFFER}", self._hash_zch_runtime_meta.data)

    def validate_state(self) -> None:
        # Built with skip_state_validation (as TorchRec): no segment buffers to check.
        return None

    # ---- modes --------------------------------------------------------------------------------
    def _set_eval_mode_impl(self) -> None:
        self.eval()
        self._is_inference = True
        self._evicted_indices = []
        self._eviction_policy_name = None
        self._eviction_module = None

    @staticmethod
    def _reset_inference_mode_load_state_dict_pre_hook(
        module: "HashZchManagedCollisionModule", state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        # Checkpoints carry the training metadata; inference modules keep none.
        if module._is_inference:
            state_dict.pop(prefix + "_hash_zch_metadata", None)

    def reset_inference_mode(self) -> None:
        """Read-only from now on; the eviction metadata is dropped (also from loaded states)."""
        self._set_eval_mode_impl()
        self._hash_zch_metadata = None
        self._register_load_state_dict_pre_hook(
            self._reset_inference_mode_load_state_dict_pre_hook, with_module=True
        )

    def reset_intrainer_bulk_eval_mode(self) -> None:
        self._set_eval_mode_impl()

    def reset_training_mode(self) -> None:
        self._is_inference = False
        self.train()
        self._eviction_policy_name = self._eviction_policy_name_copy
        self._eviction_module = (
            HashZchEvictionModule(self._eviction_policy_name, self._device, self._eviction_config)
            if self._eviction_policy_name is not None
            else None
        )
        if self._eviction_module is not None and self._hash_zch_metadata is None:
            self._hash_zch_metadata = torch.full(
                (self._zch_size, 1), -1, dtype=torch.int32, device=self.device
            )

    # ---- ManagedCollisionModule ---------------------------------------------------------------
    def preprocess(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        return features

    def profile(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        return features

    def evict(self) -> torch.Tensor | None:
        """Rows (global ids) whose owner was evicted since the last call, or None."""
        if len(self._evicted_indices) == 0:
            return None
        out = torch.unique(torch.cat(self._evicted_indices))
        self._evicted_indices = []
        offset = self._output_global_offset_tensor
        return out + offset if offset is not None else out

    def get_reserved_slots_per_bucket(self) -> int:
        if self._opt_in_prob == -1:
            return -1
        return math.floor(
            self._zch_size
            * self._percent_reserved_slots
            / 100
            / (self._end_bucket - self._start_bucket)
        )

    def remap(
        self,
        features: dict[str, JaggedTensor],
        mutate_miss_lengths: bool = True,
        write_weights: torch.Tensor | None = None,
    ) -> dict[str, JaggedTensor]:
        """Each id's row (global); inserts and evicts in training."""
        if self._output_global_offset_tensor is not None:
            self._output_global_offset_tensor, _ = _tensor_may_to_device(
                self._output_global_offset_tensor, self.device
            )
        readonly: bool = not self.training
        metadata: torch.Tensor | None = self._hash_zch_metadata if self.training else None
        with torch.no_grad():
            remapped_features: dict[str, JaggedTensor] = {}
            for name, feature in features.items():
                if name.lower().endswith(self._read_only_suffix):
                    feature_readonly = True
                    feature_metadata: torch.Tensor | None = None
                else:
                    feature_readonly = readonly
                    feature_metadata = metadata
                values = feature.values()
                _check_hash_ids(values, name, self._input_hash_size)
                input_metadata: torch.Tensor | None = None
                eviction_threshold: int = -1
                eviction_module = self._eviction_module
                if eviction_module is not None and not feature_readonly:
                    input_metadata, eviction_threshold = eviction_module(feature)
                opt_in_rands: torch.Tensor | None = None
                if self._opt_in_prob > 0 and self._opt_in_prob < 100 and self.training:
                    opt_in_rands = (torch.rand_like(values, dtype=torch.float) * 100).to(torch.int32)
                values, orig_device = _tensor_may_to_device(values, self.device)
                values, local_sizes, offsets = self.input_mapper(
                    values=values, output_offset=self._output_global_offset_tensor
                )
                remapped_ids, evictions = zero_collision_hash(
                    values,
                    self._hash_zch_identities,
                    self._max_probe,
                    feature_readonly,
                    local_sizes,
                    offsets,
                    feature_metadata,
                    self._disable_fallback,
                    input_metadata,
                    eviction_threshold,
                    self.eviction_flag,
                    self._opt_in_prob,
                    self.get_reserved_slots_per_bucket(),
                    opt_in_rands,
                    None if self._write_runtime_meta_dim > 0 else self._hash_zch_runtime_meta,
                )
                runtime_meta = self._hash_zch_runtime_meta
                if (
                    self._write_runtime_meta_dim > 0
                    and runtime_meta is not None
                    and evictions is not None
                    and evictions.numel() > 0
                ):
                    runtime_meta.data[evictions] = 0
                if write_weights is not None:
                    self.update_runtime_meta(values, remapped_ids, write_weights)
                lengths: torch.Tensor = feature.lengths()
                bag_offsets: torch.Tensor | None = feature.offsets()
                hit_indices = remapped_ids != -1
                if self._disable_fallback:
                    if self._no_bag:
                        remapped_ids = torch.where(
                            hit_indices, remapped_ids, torch.zeros_like(remapped_ids)
                        )
                    else:
                        remapped_ids = remapped_ids[hit_indices]
                    if mutate_miss_lengths:
                        lengths = _compute_lengths_from_hits(lengths, hit_indices)
                        bag_offsets = None
                offset = self._output_global_offset_tensor
                if offset is not None:
                    remapped_ids = remapped_ids + offset
                if evictions is not None and evictions.numel() > 0:
                    self._evicted_indices.append(evictions)
                remapped_ids, _ = _tensor_may_to_device(remapped_ids, orig_device)
                remapped_features[name] = JaggedTensor(
                    values=remapped_ids,
                    lengths=lengths,
                    offsets=bag_offsets,
                    weights=feature.weights_or_none(),
                )
            return remapped_features

    def forward(
        self, features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True
    ) -> dict[str, JaggedTensor]:
        return self.remap(features, mutate_miss_lengths=mutate_miss_lengths)

    def rebuild_with_output_id_range(
        self,
        output_id_range: tuple[int, int],
        output_segments: list[int] | None = None,
        device: torch.device | None = None,
    ) -> "HashZchManagedCollisionModule":
        """The shard owning rows ``[start, end)``; both must be bucket boundaries."""
        if (
            output_id_range[0] not in self._output_segments
            or output_id_range[1] not in self._output_segments
        ):
            raise RuntimeError(
                f"HashZchManagedCollisionModule {self._name!r}: row range {output_id_range} does "
                f"not align with the bucket boundaries {self._output_segments}; the planner must "
                "give each rank whole buckets"
            )
        return self.__class__(
            zch_size=output_id_range[1] - output_id_range[0],
            device=device or self.device,
            max_probe=self._max_probe,
            total_num_buckets=self._buckets,
            input_hash_size=self._input_hash_size,
            is_inference=self._is_inference,
            start_bucket=self._output_segments.index(output_id_range[0]),
            end_bucket=self._output_segments.index(output_id_range[1]),
            output_segments=self._output_segments,
            name=self._name,
            eviction_policy_name=self._eviction_policy_name,
            eviction_config=self._eviction_config,
            opt_in_prob=self._opt_in_prob,
            percent_reserved_slots=self._percent_reserved_slots,
            disable_fallback=self._disable_fallback,
            track_id_freq=self._track_id_freq,
            read_only_suffix=self._read_only_suffix,
            enable_per_feature_lookups=self._enable_per_feature_lookups,
            no_bag=self._no_bag,
            write_runtime_meta_dim=self._write_runtime_meta_dim,
            persist_hash_zch_bucket=self._persist_hash_zch_bucket,
            inference_dispatch_div_train_world_size=self._inference_dispatch_div_train_world_size,
        )

    # ---- runtime metadata ---------------------------------------------------------------------
    def lookup_runtime_meta(self, features: torch.Tensor, remapped_ids: torch.Tensor) -> torch.Tensor:
        """Per id, its row's runtime metadata (0 where the row belongs to another id; -1 for
        every id when the module keeps none)."""
        if features.numel() != remapped_ids.numel():
            raise ValueError(
                f"lookup_runtime_meta: {features.numel()} ids but {remapped_ids.numel()} rows"
            )
        runtime_meta = self._hash_zch_runtime_meta
        if runtime_meta is None:
            return torch.full_like(remapped_ids, -1)
        not_owner = self._hash_zch_identities.view(-1)[remapped_ids] != features
        metadata = torch.index_select(runtime_meta, 0, remapped_ids)
        metadata[not_owner] = 0
        return metadata.reshape(-1)

    def lookup_custom_runtime_meta(self, remapped_ids: torch.Tensor) -> torch.Tensor:
        runtime_meta = self._hash_zch_runtime_meta
        if runtime_meta is None:
            raise ValueError(
                f"HashZchManagedCollisionModule {self._name!r}: no runtime metadata (build with "
                "write_runtime_meta_dim > 0 or track_id_freq=True)"
            )
        return torch.index_select(runtime_meta, 0, remapped_ids)

    def update_runtime_meta(
        self, raw_ids: torch.Tensor, remapped_ids: torch.Tensor, weights: torch.Tensor
    ) -> None:
        """Write ``weights`` (``[N]`` or ``[N, D]``, int64 bits) into the runtime metadata of the
        rows the ids own (ids that fell back onto another id's row are skipped)."""
        runtime_meta = self._hash_zch_runtime_meta
        if runtime_meta is None:
            raise ValueError(
                "HashZchManagedCollisionModule: update_runtime_meta needs "
                + "write_runtime_meta_dim > 0"
            )
        if weights.dim() == 1:
            weights = weights.unsqueeze(1)
        if not self._disable_fallback:
            owned = self._hash_zch_identities.view(-1)[remapped_ids] == raw_ids
            remapped_ids = remapped_ids[owned]
            weights = weights[owned]
        runtime_meta.data[remapped_ids] = weights.view(runtime_meta.dtype)

    def get_indices_of_reserved_slots_per_bucket(self) -> torch.Tensor | None:
        """Local rows reserved for ids not opted in (the tail of each of this shard's
        buckets), or None without opt-in."""
        num_slots = self.get_reserved_slots_per_bucket()
        if num_slots == -1:
            return None
        sizes = self.input_mapper._zch_size_per_training_rank
        starts = self.input_mapper._train_rank_offsets
        indices = torch.cat(
            [
                torch.arange(
                    int(starts[b] + sizes[b]) - num_slots,
                    int(starts[b] + sizes[b]),
                    device=self.device,
                )
                for b in range(self._start_bucket, self._end_bucket)
            ]
        )
        if self._output_global_offset_tensor is not None:
            indices = indices - self._output_global_offset_tensor.to(indices.device)
        return indices

    @torch.jit.unused
    def sync_identities(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError(
            "HashZchManagedCollisionModule.sync_identities merges identity tables across "
            "replicas of a 2D-sharded table; recsys_core has no 2D sharding for managed "
            "collision tables yet"
        )


def make_hash_zch_buckets_non_persistent(module: torch.nn.Module) -> int:
    """Drop ``_hash_zch_bucket`` from the state_dict of every hash module under ``module``
    (for loading checkpoints saved before the buffer existed); returns how many changed."""
    changed = 0
    for sub in module.modules():
        if isinstance(sub, HashZchManagedCollisionModule):
            name = HashZchManagedCollisionModule.BUCKET_BUFFER
            if name not in sub._non_persistent_buffers_set:
                sub._non_persistent_buffers_set.add(name)
                sub._persist_hash_zch_bucket = False
                changed += 1
    return changed
