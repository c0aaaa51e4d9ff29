"""TorchRec's ``torchrec.distributed.mc_modules`` path: a ManagedCollisionCollection sharded
row-wise with its embedding tables (zero-collision hashing under DistributedModelParallel).

Each rank owns one row block of every managed table and a remapping module for exactly those
rows (``MCHManagedCollisionModule.rebuild_with_output_id_range``). A raw id is routed by its
value, as TorchRec's input dist does: with ``W`` ranks and ``block = ceil(input_hash_size / W)``
the id goes to rank ``id // block`` (ids outside ``[0, block * W)``, e.g. negative ones, to
``id mod W``). That rank's module remaps it into its own rows, so its row never changes rank::

    2 ranks, table of 16 rows (rows 0-7 on rank 0, 8-15 on rank 1), input_hash_size 4000
    id 1001 -> rank 0 (1001 // 2000 = 0) -> a row in [0, 8), misses share row 7
    id 2002 -> rank 1                     -> a row in [8, 16), misses share row 15

    input_dist:  ids (after the module's input_hash_func) all-to-all to their rank
    compute:     each rank's module counts, evicts and remaps its share (shard-local rows)
    output_dist: the global rows go back to where the ids came from, in their input positions

Per table the result equals ``W`` independent unsharded modules over the row blocks, each fed
the ids of its input block; it is not the one unsharded module over all rows (each block keeps
its own miss row and evicts among its own ids), which is TorchRec's semantics too. With the
default ``input_hash_size`` (``2**63 - 1``) every id below ``2**62`` lands on rank 0: give the
modules the real id range (or an ``input_hash_func``) to spread them.

State: the remapping tables are exported as ShardedTensors indexed by row (entry ``j`` of
``_mch_sorted_raw_ids`` is the raw id owning row ``j``, ``INT64_MAX`` when free), so a checkpoint
reshards with the embedding rows; loading into another world size re-homes each id to its new
rank together with its embedding row and optimizer state (see ``mc_embedding_modules``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata

from recsys_core.distributed.awaitable import Awaitable, FunctionAwaitable, LazyAwaitable, NoWait
from recsys_core.distributed.comm import TensorAllToAll
from recsys_core.distributed.dist_data import SparseFeaturesAllToAll
from recsys_core.distributed.embedding_types import BaseEmbeddingSharder
from recsys_core.distributed.sharded_state import gather_global_metadata, sharded_tensor
from recsys_core.distributed.sharding.shards import resolve_shards
from recsys_core.distributed.types import (
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from recsys_core.kernels import sparse_ops
from recsys_core.modules.embedding_configs import BaseEmbeddingConfig
from recsys_core.modules.mc_modules import (
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
    _cat_jagged_values,
    _get_length_per_key,
    route_blocks,
)
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor
from recsys_core.sparse.key_order import KeyOrder

logger = logging.getLogger(__name__)

_INT64_MAX = torch.iinfo(torch.int64).max
# Per-module buffers that are not remapping entries (replicated, never resharded).
_UNSHARDED_BUFFERS = ("_output_segments_tensor", "_current_iter_tensor")


class KJTList(list):  # list[KeyedJaggedTensor]
    """TorchRec's list of KJTs, one per sharding (a single row-wise one here)."""


@dataclass
class SequenceShardingContext:
    """The per-sharding facts TorchRec's sequence shardings keep between the steps of a
    forward (here: the features before the input dist and how their ids were routed)."""

    features_before_input_dist: KeyedJaggedTensor | None = None
    lengths_after_input_dist: torch.Tensor | None = None
    unbucketize_permute_tensor: torch.Tensor | None = None
    batch_size_per_feature_pre_a2a: list[int] = field(default_factory=list)
    variable_batch_per_feature: bool = False
    route: _Route | None = None


@dataclass
class EmbeddingCollectionContext:
    """TorchRec's forward context of (managed-collision) embedding collections."""

    sharding_contexts: list[SequenceShardingContext] = field(default_factory=list)
    input_features: list[KeyedJaggedTensor] = field(default_factory=list)
    inverse_indices: tuple[list[str], torch.Tensor] | None = None
    variable_batch_per_feature: bool = False
    early_releasable_inputs: list[KeyedJaggedTensor] = field(default_factory=list)
    reverse_indices: list[torch.Tensor] = field(default_factory=list)

    def record_stream(self, stream: torch.Stream) -> None:
        for f in self.input_features:
            f.record_stream(stream)


class ManagedCollisionCollectionContext(EmbeddingCollectionContext):
    """The context of a sharded ManagedCollisionCollection's forward."""


# ---- TorchRec's fx leaves --------------------------------------------------------------------
@torch.fx.wrap
def input_dist_permute(
    features: KeyedJaggedTensor, features_order: list[int], features_order_tensor: torch.Tensor
) -> KeyedJaggedTensor:
    """``features.permute(features_order)`` as one fx graph node."""
    return features.permute(features_order, features_order_tensor)


@torch.fx.wrap
def _fx_global_to_local_index(
    feature_dict: dict[str, JaggedTensor], feature_to_offset: dict[str, int]
) -> dict[str, JaggedTensor]:
    """Subtract each key's row offset from its ids (global rows -> shard rows), in place."""
    for key, jt in feature_dict.items():
        jt._values = jt.values() - feature_to_offset[key]
    return feature_dict


@torch.fx.wrap
def _fx_jt_dict_add_offset(
    feature_dict: dict[str, JaggedTensor], feature_to_offset: dict[str, int]
) -> dict[str, JaggedTensor]:
    """Add each key's row offset to its ids (shard rows -> global rows), in place."""
    for key, jt in feature_dict.items():
        jt._values = jt.values() + feature_to_offset[key]
    return feature_dict


@torch.fx.wrap
def update_jagged_tensor_dict(
    output: dict[str, JaggedTensor], new_dict: dict[str, JaggedTensor]
) -> dict[str, JaggedTensor]:
    output.update(new_dict)
    return output


def create_mc_sharding(
    sharding_type: str, sharding_infos: Sequence[Any], env: ShardingEnv,
    device: torch.device | None = None,
) -> str:
    """TorchRec's factory of managed-collision shardings: row-wise only. Returns the sharding
    type this library runs (its sharded collection builds the routing itself)."""
    if sharding_type != ShardingType.ROW_WISE.value:
        raise ValueError(
            f"managed collisions: sharding type {sharding_type!r} is not supported; "
            "managed-collision tables shard row_wise only"
        )
    return sharding_type


# ---- routing ---------------------------------------------------------------------------------
def route_ids(ids: torch.Tensor, input_size: int, world_size: int) -> torch.Tensor:
    """The rank of each raw id (TorchRec's bucketization of managed-collision inputs).

    ``block = ceil(input_size / world_size)``; ids in ``[0, block * world_size)`` go to
    ``id // block``, others to ``id mod world_size`` (non-negative)."""
    return route_blocks(ids, input_size, world_size)


@dataclass
class _Route:
    """How one forward's ids were sent, to bring their rows back to the same positions."""

    order: torch.Tensor  # stable permutation grouping the values by (destination, feature)
    values_per_dest: list[int]
    features: KeyedJaggedTensor  # the input (after preprocessing), in table order


def _send_ids(
    features: KeyedJaggedTensor, values: torch.Tensor, dest: torch.Tensor, env: ShardingEnv
) -> tuple[SparseFeaturesAllToAll, _Route]:
    """Send ``values`` (``features``' ids after preprocessing) to ranks ``dest``."""
    world, batch, keys = env.world_size, features.stride(), features.keys()
    k = len(keys)
    lengths = features.lengths().to(torch.int64)
    n = values.numel()
    rows = torch.arange(k * batch, device=values.device)  # (feature, sample) of each bag
    bag = torch.repeat_interleave(rows, lengths, output_size=n)
    key = dest * (k * batch) + bag  # destination-major, then feature, then sample
    order = torch.argsort(dest * k + torch.div(bag, batch, rounding_mode="floor"), stable=True)
    send_lengths = torch.bincount(key, minlength=world * k * batch).to(features.lengths().dtype)
    values_per_dest = torch.bincount(dest, minlength=world).tolist()
    exchange = SparseFeaturesAllToAll(
        send_lengths, values[order], None, [k * batch] * world, values_per_dest, keys, batch,
        env.pg, world,
    )
    return exchange, _Route(order, values_per_dest, features)


def _return_rows(
    remapped: KeyedJaggedTensor, route: _Route, env: ShardingEnv
) -> Awaitable[KeyedJaggedTensor]:
    """Send each remapped id back to the rank it came from, in its input position."""
    world, k = env.world_size, len(remapped.keys())
    batch = remapped.stride() // world
    values, lengths = remapped.values(), remapped.lengths()
    if world > 1 and k:
        # received rows are (feature, source); the sources want (source, feature)
        perm = torch.arange(k * world, device=values.device).view(k, world).t().reshape(-1)
        lengths2d, values, _ = sparse_ops.permute_2d_sparse_data(
            perm, lengths.view(k * world, batch), values
        )
        lengths = lengths2d.reshape(-1)
    per_source = lengths.view(world, -1).sum(dim=1).tolist()
    back = TensorAllToAll(values, per_source, route.values_per_dest, env.pg)
    original = route.features

    def restore() -> KeyedJaggedTensor:
        got = back.wait()
        out = torch.empty_like(got)
        out[route.order] = got
        return KeyedJaggedTensor(
            keys=original.keys(),
            values=out.to(original.values().dtype),
            lengths=original.lengths(),
            weights=original.weights_or_none(),
            stride=original.stride(),
        )

    return FunctionAwaitable(restore)


class ManagedCollisionCollectionAwaitable(LazyAwaitable[KeyedJaggedTensor]):
    """The remapped features (global rows, the input's keys and positions)."""

    def __init__(self, inner: Awaitable[KeyedJaggedTensor]) -> None:
        super().__init__()
        self._inner = inner

    def _wait_impl(self) -> KeyedJaggedTensor:
        return self._inner.wait()


# ---- the sharded collection ------------------------------------------------------------------
class ShardedManagedCollisionCollection(nn.Module):
    """A ManagedCollisionCollection sharded row-wise over ``env`` (see the module docstring).

    Built by the managed-collision embedding collections' sharders with the same plan as
    their tables; ``forward(features)`` returns a LazyAwaitable of the remapped KJT (global
    rows), as the unsharded module returns it. ``embedding_shardings`` and
    ``use_index_dedup`` are TorchRec's arguments: the routing is derived from the plan, and
    ids travel as they are (deduplication would change nothing but the traffic).
    ``restore_dedup_feature_boundary`` (TorchRec 1.9, default True) keeps each deduplicated id
    under the feature that sent it, where TorchRec 1.8 spread them evenly over a table's
    features; it matters to modules that treat a table's features differently (hash ZCH's
    read-only features, per-feature TTL), whose sharding this library does not support. Here
    ids always stay under their feature and the sharded modules (MCH) remap every feature of a
    table alike, so either value gives the same rows.
    """

    def __init__(
        self,
        module: ManagedCollisionCollection,
        table_name_to_parameter_sharding: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device,
        embedding_shardings: Sequence[Any] | None = None,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
        use_index_dedup: bool = False,
        restore_dedup_feature_boundary: bool = True,
    ) -> None:
        super().__init__()
        self._restore_dedup_feature_boundary = restore_dedup_feature_boundary
        self.need_preprocess: bool = module.need_preprocess
        self._env, self._device = env, torch.device(device)
        self._use_index_dedup = use_index_dedup
        self._use_2d_weights = False
        self._table_name_to_config: dict[str, BaseEmbeddingConfig] = dict(
            module._table_name_to_config
        )
        self._feature_to_table: dict[str, str] = dict(module._feature_to_table)
        self._table_to_features: dict[str, list[str]] = dict(module._table_to_features)
        self._managed_collision_modules = nn.ModuleDict()
        self._table_to_offset: dict[str, int] = {}
        # (offset, rows, num_embeddings) of this rank's block of each table
        self._mc_module_name_shard_metadata: dict[str, tuple[int, int, int]] = {}
        tables = list(module._managed_collision_modules.keys())
        for table in tables:
            self._build_local_module(table, module, table_name_to_parameter_sharding)
        self._table_feature_splits = [len(self._table_to_features[t]) for t in tables]
        self._feature_names = [f for t in tables for f in self._table_to_features[t]]
        # TorchRec's per-sharding views (one row-wise sharding)
        self._sharding_tables: list[list[str]] = [tables]
        self._sharding_features: list[list[str]] = [list(self._feature_names)]
        self._sharding_per_table_feature_splits: list[list[int]] = [
            list(self._table_feature_splits)
        ]
        self._input_sizes = {t: m.input_size() for t, m in self._managed_collision_modules.items()}
        self._key_order = KeyOrder(self._feature_names, "ShardedManagedCollisionCollection")
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._export_metadata: dict[tuple[str, str], ShardedTensorMetadata] | None = None
        """The state dict's ShardedTensor layouts, gathered on the first export."""
        self._register_state_dict_hook(_export_state)
        self._register_load_state_dict_pre_hook(_import_state, with_module=True)

    def _build_local_module(
        self, table: str, module: ManagedCollisionCollection,
        plan: Mapping[str, ParameterSharding],
    ) -> None:
        config = self._table_name_to_config[table]
        unsharded = module._managed_collision_modules[table]
        if not isinstance(unsharded, MCHManagedCollisionModule):
            raise ValueError(
                f"ShardedManagedCollisionCollection: table {table!r} uses a "
                f"{type(unsharded).__name__}; only MCHManagedCollisionModule tables can be "
                "sharded by recsys_core (leave the others unsharded)"
            )
        if table not in plan:
            raise ValueError(
                f"ShardedManagedCollisionCollection: the sharding plan has no entry for "
                f"managed-collision table {table!r}"
            )
        ps = plan[table]
        if ps.sharding_type is not ShardingType.ROW_WISE:
            raise ValueError(
                f"ShardedManagedCollisionCollection: table {table!r} is planned "
                f"{ps.sharding_type.value}; managed-collision tables shard row_wise only"
            )
        shards = sorted(resolve_shards(config, ps, self._env.world_size).shards,
                        key=lambda s: s.row_offset)
        ranks = sorted(s.rank for s in shards)
        if ranks != list(range(self._env.world_size)) or any(s.rows == 0 for s in shards):
            raise ValueError(
                f"ShardedManagedCollisionCollection: table {table!r} ({config.num_embeddings} "
                f"rows) must have one non-empty row block on every one of the "
                f"{self._env.world_size} ranks (ids are routed to every rank); got blocks on "
                f"ranks {[s.rank for s in shards]} with rows {[s.rows for s in shards]}"
            )
        mine = next(s for s in shards if s.rank == self._env.rank)
        segments = [s.row_offset for s in shards] + [config.num_embeddings]
        local = unsharded.rebuild_with_output_id_range(
            (mine.row_offset, mine.row_offset + mine.rows), segments, device=self._device
        )
        local.train(unsharded.training)
        self._managed_collision_modules[table] = local
        self._table_to_offset[table] = mine.row_offset
        self._mc_module_name_shard_metadata[table] = (
            mine.row_offset, mine.rows, config.num_embeddings
        )

    # ---- forward, in TorchRec's three steps ----------------------------------------------------
    def create_context(self) -> ManagedCollisionCollectionContext:
        return ManagedCollisionCollectionContext(sharding_contexts=[])

    def input_dist(
        self, ctx: ManagedCollisionCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KJTList]]:
        """Preprocess (input hash) each table's ids, then send each id to its rank."""
        if features.variable_stride_per_key():
            raise ValueError(
                "ShardedManagedCollisionCollection: variable-batch KeyedJaggedTensors "
                f"(stride_per_key {features.stride_per_key()}) are not supported; give every "
                "key the same batch size"
            )
        features = self._in_table_order(features)
        batch = features.stride()
        parts: list[torch.Tensor] = []
        dests: list[torch.Tensor] = []
        offsets = features.offset_per_key()
        k = 0
        for table, mc_module in self._managed_collision_modules.items():
            n = len(self._table_to_features[table])
            ids = features.values()[offsets[k] : offsets[k + n]]
            if ids.dtype not in (torch.int64, torch.int32):
                raise TypeError(
                    f"managed collision: features {self._table_to_features[table]} (table "
                    f"{table!r}) have ids of dtype {ids.dtype}; ids must be torch.int64 (or int32)"
                )
            if self.need_preprocess:
                lengths = features.lengths()[k * batch : (k + n) * batch]
                ids = mc_module.preprocess({table: JaggedTensor(values=ids, lengths=lengths)})[
                    table
                ].values()
            k += n
            parts.append(ids.to(torch.int64))
            dests.append(route_ids(parts[-1], self._input_sizes[table], self._env.world_size))
        values = torch.cat(parts) if len(parts) != 1 else parts[0]
        dest = torch.cat(dests) if len(dests) != 1 else dests[0]
        exchange, route = _send_ids(features, values, dest, self._env)
        ctx.sharding_contexts.append(SequenceShardingContext(
            features_before_input_dist=features,
            batch_size_per_feature_pre_a2a=features.stride_per_key(),
            route=route,
        ))
        return NoWait(FunctionAwaitable(lambda: KJTList([exchange.wait()])))

    def _in_table_order(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return self._key_order.apply(features)

    def get_lookup_value(
        self, table: str, features: KeyedJaggedTensor, write_weights: torch.Tensor | None = None
    ) -> dict[str, JaggedTensor]:
        """Count (training) and remap one table's received ids: ``{table: shard-local rows}``."""
        mcm = self._managed_collision_modules[table]
        mc_input = {
            table: JaggedTensor(
                values=features.values(), lengths=features.lengths(),
                weights=_get_length_per_key(features),
            )
        }
        mc_input = mcm.profile(mc_input)
        mc_input = mcm.remap(mc_input)
        return _fx_global_to_local_index(mc_input, self._table_to_offset)

    def compute(self, ctx: ManagedCollisionCollectionContext, dist_input: KJTList) -> KJTList:
        """Remap the received ids of every sharding, table by table (shard-local rows; the
        lengths are the modules' output lengths)."""
        out: list[KeyedJaggedTensor] = []
        for features, tables, splits, names in zip(
            dist_input, self._sharding_tables, self._sharding_per_table_feature_splits,
            self._sharding_features, strict=True,
        ):
            if len(splits) > 1:
                output: dict[str, JaggedTensor] = {}
                for table, kjt in zip(tables, features.split(splits), strict=True):
                    output = update_jagged_tensor_dict(output, self.get_lookup_value(table, kjt))
                values = torch.cat([jt.values() for jt in output.values()])
                lengths = torch.cat([jt.lengths() for jt in output.values()])
            else:
                remapped = self.get_lookup_value(tables[0], features)[tables[0]]
                values, lengths = remapped.values(), remapped.lengths()
            out.append(KeyedJaggedTensor(
                keys=names, values=values, lengths=lengths,
                weights=features.weights_or_none(),
            ))
        return KJTList(out)

    def output_dist(
        self, ctx: ManagedCollisionCollectionContext, output: KJTList
    ) -> LazyAwaitable[KeyedJaggedTensor]:
        """Global rows back to the ids' ranks and positions."""
        (local,) = output
        (sharding_ctx,) = ctx.sharding_contexts
        assert sharding_ctx.route is not None
        per_table = local.split(self._table_feature_splits)
        shifted = [
            kjt.values() + self._table_to_offset[t]
            for t, kjt in zip(self._managed_collision_modules, per_table, strict=True)
        ]
        global_rows = KeyedJaggedTensor(
            keys=local.keys(), values=torch.cat(shifted) if len(shifted) != 1 else shifted[0],
            lengths=local.lengths(), stride=local.stride(),
        )
        return ManagedCollisionCollectionAwaitable(
            _return_rows(global_rows, sharding_ctx.route, self._env)
        )

    def forward(self, features: KeyedJaggedTensor) -> LazyAwaitable[KeyedJaggedTensor]:
        ctx = self.create_context()
        received = self.input_dist(ctx, features).wait().wait()
        return self.output_dist(ctx, self.compute(ctx, received))

    # ---- evictions and slots --------------------------------------------------------------------
    def evict(self) -> dict[str, torch.Tensor | None]:
        """Per table: this rank's rows given to new ids since the last call (shard-local)."""
        out: dict[str, torch.Tensor | None] = {}
        for table, mcm in self._managed_collision_modules.items():
            rows = mcm.evict()
            out[table] = None if rows is None else rows - self._table_to_offset[table]
        return out

    def open_slots(self) -> dict[str, torch.Tensor]:
        return {t: m.open_slots() for t, m in self._managed_collision_modules.items()}

    @property
    def unsharded_module_type(self) -> type[ManagedCollisionCollection]:
        return ManagedCollisionCollection

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        """Names of the buffers exported as ShardedTensors (the remapping entries)."""
        for table, mcm in self._managed_collision_modules.items():
            for name in _entry_buffers(mcm):
                yield ".".join(p for p in (prefix, table, name) if p)

    # ---- row-indexed remapping state (checkpoints) ----------------------------------------------
    def has_pending_state(self) -> bool:
        """A loaded remapping state waits to be installed (see ``install_state``)."""
        return bool(self._pending)

    def row_state(self, table: str) -> dict[str, torch.Tensor]:
        """This rank's remapping state of ``table`` indexed by shard row: ``raw`` (raw id per
        row, INT64_MAX when free) and one tensor per eviction-policy metadata buffer."""
        if table in self._pending:
            return self._pending[table]
        mcm = self._managed_collision_modules[table]
        order = torch.argsort(mcm._mch_remapped_ids_mapping)
        state = {"raw": mcm._mch_sorted_raw_ids[order]}
        for name, buffer in mcm._mch_metadata.items():
            state[name] = buffer[order]
        return state

    def set_row_state(self, table: str, state: Mapping[str, torch.Tensor]) -> None:
        """Install a row-indexed state (every id already on its home rank)."""
        mcm = self._managed_collision_modules[table]
        offset, rows, _ = self._mc_module_name_shard_metadata[table]
        with torch.no_grad():
            mcm._mch_sorted_raw_ids.copy_(state["raw"])
            mcm._mch_remapped_ids_mapping.copy_(
                torch.arange(offset, offset + rows, device=mcm._mch_remapped_ids_mapping.device)
            )
            for name, buffer in mcm._mch_metadata.items():
                buffer.copy_(state[name])
            mcm._sort_mch_buffers()
        self._pending.pop(table, None)

    def route(self, table: str, raw_ids: torch.Tensor) -> torch.Tensor:
        """The rank each (preprocessed) raw id of ``table`` belongs to."""
        return route_ids(raw_ids, self._input_sizes[table], self._env.world_size)

    @property
    def env(self) -> ShardingEnv:
        return self._env


def _entry_buffers(mcm: MCHManagedCollisionModule) -> list[str]:
    return ["_mch_sorted_raw_ids", "_mch_remapped_ids_mapping"] + [
        "_mch_" + name for name in mcm._mch_metadata
    ]


def _export_state(
    module: ShardedManagedCollisionCollection, destination: dict[str, Any], prefix: str,
    _meta: Any,
) -> None:
    env = module._env
    rank = None if env.pg is None else dist.get_global_rank(env.pg, env.rank)
    local: dict[tuple[str, str], tuple[list[Shard], torch.Size]] = {}
    keys: list[tuple[str, tuple[str, str]]] = []
    for table, mcm in module._managed_collision_modules.items():
        offset, rows, total = module._mc_module_name_shard_metadata[table]
        state = module.row_state(table)
        tensors = {
            "_mch_sorted_raw_ids": state["raw"].clone(),
            "_mch_remapped_ids_mapping": torch.arange(
                offset, offset + rows, dtype=torch.int64, device=state["raw"].device
            ),
        }
        for name in mcm._mch_metadata:
            tensors["_mch_" + name] = state[name].clone()
        base = f"{prefix}_managed_collision_modules.{table}."
        if env.pg is None:
            destination.update((base + name, tensor) for name, tensor in tensors.items())
            continue
        for name, tensor in tensors.items():
            shard = Shard(tensor, ShardMetadata([offset], [rows], f"rank:{rank}/{tensor.device}"))
            local[(table, name)] = ([shard], torch.Size([total]))
            keys.append((base + name, (table, name)))
    if local:
        # one gather of every tensor's layout, the first time (the rows each rank holds do not
        # change after sharding), instead of one init_from_local_shards gather per tensor
        if module._export_metadata is None:
            module._export_metadata = gather_global_metadata(local, env)
        for key, layout in keys:
            destination[key] = sharded_tensor(local[layout][0], module._export_metadata[layout],
                                              env)


def _import_state(
    module: ShardedManagedCollisionCollection, state_dict: dict[str, Any], prefix: str,
    *_args: Any,
) -> None:
    """Take the remapping entries out of ``state_dict`` (ShardedTensors of this rank's rows,
    or whole tensors, e.g. an unsharded module's) as a pending row-indexed state; the modules'
    own buffers load as they are, so their checks pass whatever the saved world size was."""
    for table, mcm in module._managed_collision_modules.items():
        base = f"{prefix}_managed_collision_modules.{table}."
        names = _entry_buffers(mcm)
        if not all(base + n in state_dict for n in names):
            continue  # missing keys: reported by the modules' own load
        offset, rows, total = module._mc_module_name_shard_metadata[table]
        loaded = {n: state_dict[base + n] for n in names}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ShardedTensor's deprecation notices
            pending = _rows_of(loaded, table, offset, rows, total, mcm)
        module._pending[table] = pending
        for n in names:
            state_dict[base + n] = getattr(mcm, n).clone()
        state_dict[base + "_output_segments_tensor"] = mcm._output_segments_tensor.clone()


def _local(value: Any, key: str, offset: int, rows: int) -> torch.Tensor:
    if isinstance(value, ShardedTensor):
        parts = sorted(value.local_shards(), key=lambda s: s.metadata.shard_offsets[0])
        covered = [(s.metadata.shard_offsets[0], s.metadata.shard_sizes[0]) for s in parts]
        if sum(n for _, n in covered) != rows or (covered and covered[0][0] != offset):
            raise ValueError(
                f"{key}: the ShardedTensor's local shards {covered} do not cover this rank's "
                f"rows [{offset}, {offset + rows}); load checkpoints with "
                "torch.distributed.checkpoint.load into this module's own state_dict()"
            )
        return torch.cat([s.tensor.reshape(-1) for s in parts])
    return value


def _rows_of(
    loaded: Mapping[str, Any], table: str, offset: int, rows: int, total: int,
    mcm: MCHManagedCollisionModule,
) -> dict[str, torch.Tensor]:
    """A row-indexed state of this rank's rows from loaded remapping entries."""
    where = f"ShardedManagedCollisionCollection, table {table!r}"
    raw_key, map_key = "_mch_sorted_raw_ids", "_mch_remapped_ids_mapping"
    sharded = isinstance(loaded[raw_key], ShardedTensor)
    for key, value in loaded.items():
        size = list(value.size())
        if size != [total]:
            raise ValueError(
                f"{where}: the loaded {key} has shape {size}, but the table has {total} rows; "
                "the remapping state belongs to a differently sized table or another model"
            )
    tensors = {k: _local(v, k, offset, rows).to(mcm._mch_sorted_raw_ids.device)
               for k, v in loaded.items()}
    raw, mapping = tensors[raw_key].to(torch.int64), tensors[map_key].to(torch.int64)
    if bool(((mapping < 0) | (mapping >= total)).any()):
        raise ValueError(f"{where}: the loaded {map_key} holds rows outside [0, {total})")
    if not sharded and not torch.equal(
        torch.sort(mapping).values, torch.arange(total, device=mapping.device)
    ):
        raise ValueError(
            f"{where}: the loaded {map_key} is not a permutation of the table's {total} rows; "
            "the remapping state comes from another model"
        )
    mine = (mapping >= offset) & (mapping < offset + rows)
    if sharded and not bool(mine.all()):
        raise ValueError(
            f"{where}: the checkpoint's entries for rows [{offset}, {offset + rows}) map ids "
            "to other rows; it was not written by recsys_core's sharded module (whose "
            "remapping state is indexed by row)"
        )
    local_rows = mapping[mine] - offset
    state = {"raw": torch.full((rows,), _INT64_MAX, dtype=torch.int64, device=raw.device)}
    state["raw"][local_rows] = raw[mine]
    for name in mcm._mch_metadata:
        column = torch.zeros(rows, dtype=torch.int64, device=raw.device)
        column[local_rows] = tensors["_mch_" + name].to(torch.int64)[mine]
        state[name] = column
    return state


# ---- sharders ---------------------------------------------------------------------------------
class ManagedCollisionCollectionSharder(BaseEmbeddingSharder[ManagedCollisionCollection]):
    """Shards a ManagedCollisionCollection row-wise, with the plan of the embedding tables it
    feeds (used by the managed-collision embedding collections' sharders)."""

    def __init__(
        self,
        qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
        restore_dedup_feature_boundary: bool = True,
    ) -> None:
        super().__init__(qcomm_codecs_registry=qcomm_codecs_registry)
        self._restore_dedup_feature_boundary = restore_dedup_feature_boundary

    def shard(  # type: ignore[override]
        self,
        module: ManagedCollisionCollection,
        params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        embedding_shardings: Sequence[Any] | None = None,
        device: torch.device | None = None,
        use_index_dedup: bool = False,
    ) -> ShardedManagedCollisionCollection:
        return ShardedManagedCollisionCollection(
            module, params, env=env, device=torch.device(device or "cpu"),
            embedding_shardings=embedding_shardings, use_index_dedup=use_index_dedup,
            restore_dedup_feature_boundary=self._restore_dedup_feature_boundary,
        )

    def shardable_parameters(self, module: ManagedCollisionCollection) -> dict[str, nn.Parameter]:
        # As in TorchRec: a collection is sharded with its embedding tables, never alone.
        raise NotImplementedError(
            "ManagedCollisionCollectionSharder: a ManagedCollisionCollection is not sharded on "
            "its own; shard the ManagedCollisionEmbeddingBagCollection/EmbeddingCollection "
            "that holds it"
        )

    @property
    def module_type(self) -> type[ManagedCollisionCollection]:
        return ManagedCollisionCollection

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ShardingType.ROW_WISE.value]


class InferManagedCollisionCollectionSharder(ManagedCollisionCollectionSharder):
    """TorchRec's sharder for quantized (inference) models. Sharding a managed-collision
    collection for inference is not implemented by recsys_core: ``shard`` raises."""

    def shard(self, module: Any, params: Any, env: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            "InferManagedCollisionCollectionSharder: sharding managed collisions for inference "
            "(quantized models) is not implemented by recsys_core; serve the unsharded "
            "ManagedCollisionCollection (eval mode freezes its remapping)"
        )


class ShardedMCCRemapper(nn.Module):
    """TorchRec's inference remapper: the local modules of a set of tables, each remapping its
    features and shifting its rows by the table's offset (``shard_metadata[table] = [offset,
    size]``)."""

    def __init__(
        self,
        table_feature_splits: list[int],
        fns: list[str],
        managed_collision_modules: nn.ModuleDict,
        shard_metadata: dict[str, list[int]],
    ) -> None:
        super().__init__()
        self._table_feature_splits, self._fns = table_feature_splits, fns
        self.zchs = managed_collision_modules
        self._shard_metadata = shard_metadata
        self._table_to_offset = {t: meta[0] for t, meta in shard_metadata.items()}
        self._feature_to_offset: dict[str, int] = {}
        names = iter(fns)
        for table, count in zip(self.zchs.keys(), table_feature_splits, strict=True):
            for _ in range(count):
                self._feature_to_offset[next(names)] = self._table_to_offset[table]

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        splits = features.split(self._table_feature_splits)
        output: dict[str, JaggedTensor] = {}
        for i, (table, mc_module) in enumerate(self.zchs.items()):
            kjt = splits[i]
            remapped = mc_module({table: JaggedTensor(
                values=kjt.values(), lengths=kjt.lengths(), weights=_get_length_per_key(kjt),
            )})
            output[table] = self.global_to_local_index(remapped)[table]
        return KeyedJaggedTensor(
            keys=self._fns, values=_cat_jagged_values(output), lengths=features.lengths(),
            weights=features.weights_or_none(),
        )

    def global_to_local_index(self, jt_dict: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        return _fx_global_to_local_index(jt_dict, self._table_to_offset)


class ShardedQuantManagedCollisionCollection(nn.Module):
    """TorchRec's sharded managed collisions of quantized (inference) models. Not implemented
    by recsys_core: constructing one raises. Its context and output assembly (the remapped
    KJTs of every sharding joined into one) are TorchRec's."""

    _feature_names: list[str]

    def __init__(self, module: ManagedCollisionCollection, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            "ShardedQuantManagedCollisionCollection: sharding managed collisions for inference "
            "is not implemented by recsys_core; serve the unsharded ManagedCollisionCollection"
        )

    def compute(self, ctx: Any, rank: int, dist_input: KJTList) -> KJTList:
        # As in TorchRec: the quantized collection remaps inside its input dist.
        raise NotImplementedError(
            "ShardedQuantManagedCollisionCollection remaps in input_dist; compute is not used"
        )

    def output_dist(
        self, ctx: ManagedCollisionCollectionContext, output: KJTList
    ) -> KeyedJaggedTensor:
        if not output:
            return KeyedJaggedTensor.empty()
        return output[0] if len(output) == 1 else KeyedJaggedTensor.concat(list(output))

    def create_context(self) -> ManagedCollisionCollectionContext:
        return ManagedCollisionCollectionContext(sharding_contexts=[])

    @property
    def unsharded_module_type(self) -> type[ManagedCollisionCollection]:
        return ManagedCollisionCollection


__all__ = [
    "EmbeddingCollectionContext",
    "InferManagedCollisionCollectionSharder",
    "KJTList",
    "ManagedCollisionCollectionAwaitable",
    "ManagedCollisionCollectionContext",
    "ManagedCollisionCollectionSharder",
    "SequenceShardingContext",
    "ShardedMCCRemapper",
    "ShardedManagedCollisionCollection",
    "ShardedQuantManagedCollisionCollection",
    "create_mc_sharding",
    "input_dist_permute",
    "route_ids",
    "update_jagged_tensor_dict",
]
