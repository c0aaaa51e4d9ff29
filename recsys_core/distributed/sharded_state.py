"""Plan-independent state of a sharded collection, for ``torch.distributed.checkpoint``.

Each table is exposed under its unsharded name (``embedding_bags.<table>.weight``) as a
``ShardedTensor`` whose local shards are views of this rank's kernel storage, so
``dcp.load`` writes straight into the kernels and a checkpoint saved with one plan or world size
loads into another (DCP reshards). Data-parallel tables are plain (replicated) tensors.
Optimizer state follows the weights' sharding; a row-wise state (one value per row) of a table
split by columns keeps one accumulator per column shard, laid out as TorchRec lays it out: a
1-D tensor of ``rows * num_column_shards`` values, column shard ``j`` (by column offset) at
``j * rows``. The fused optimizer's state dict lists the tables this rank holds a part of, as
TorchRec's does (``torch.distributed.checkpoint`` loads it on any plan).

``load_state_dict`` also takes full, unsharded tensors (e.g. an EmbeddingBagCollection's
state dict): every rank copies its slices.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.utils import (
    build_global_metadata,
    build_metadata_from_local_shards,
)

from recsys_core.distributed.sharding.shards import ShardedTable, ShardSpec
from recsys_core.distributed.types import ShardingEnv, ShardingType
from recsys_core.kernels.config import FusedOptimizerConfig
from recsys_core.optim.keyed import CombinedOptimizer, KeyedOptimizer

_COLUMN_TYPES = (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE)


@dataclass
class LocalShard:
    spec: ShardSpec
    weight: torch.Tensor  # [rows, cols] view into the kernel
    state: dict[str, torch.Tensor]  # views: [rows, cols] per element or [rows] per row


def _region(
    spec: ShardSpec, table: ShardedTable, tensor: torch.Tensor
) -> tuple[list[int], list[int], torch.Tensor]:
    """Offsets, sizes and matching view of a shard's tensor within the table-keyed tensor."""
    if tensor.dim() == 2:
        return [spec.row_offset, spec.col_offset], [spec.rows, spec.cols], tensor
    if table.sharding.sharding_type in _COLUMN_TYPES:  # row-wise state of a column shard
        column = sorted({s.col_offset for s in table.shards}).index(spec.col_offset)
        return [column * table.config.num_embeddings + spec.row_offset], [spec.rows], tensor
    return [spec.row_offset], [spec.rows], tensor


def global_size(table: ShardedTable, rowwise_state: bool) -> list[int]:
    rows, dim = table.config.num_embeddings, table.config.embedding_dim
    if not rowwise_state:
        return [rows, dim]
    if table.sharding.sharding_type in _COLUMN_TYPES:
        return [rows * len({s.col_offset for s in table.shards})]
    return [rows]


def _pick(name: str | None) -> Callable[[LocalShard], torch.Tensor]:
    return (lambda s: s.weight) if name is None else (lambda s: s.state[name])


def _local_shards(
    table: ShardedTable, shards: list[LocalShard], env: ShardingEnv, name: str | None,
) -> list[Shard]:
    """This rank's parts of the table's weight (``name=None``) or state ``name``, each placed
    at its offsets in the global tensor (placements name global ranks, as torch's do)."""
    pick = _pick(name)
    assert env.pg is not None
    rank = dist.get_global_rank(env.pg, env.rank)
    local = []
    for s in shards:
        if s.spec.rows == 0 or s.spec.cols == 0:
            continue  # an empty row block owns no part of the table
        offsets, sizes, view = _region(s.spec, table, pick(s))
        local.append(Shard(view, TorchShardMetadata(offsets, sizes, f"rank:{rank}/{view.device}")))
    return local


def local_weight_shards(table: ShardedTable, shards: list[LocalShard], env: ShardingEnv) -> list[Shard]:
    """This rank's parts of the table's weight as torch Shards (views, placed in the table)."""
    return _local_shards(table, shards, env, None)


class GlobalLayouts:
    """The global ``ShardedTensorMetadata`` of each table's weight and optimizer states of one
    sharded collection, gathered from the ranks in one collective the first time any of them
    is exported, and reused by every export after it.

    ``init_from_local_shards`` gathers a tensor's metadata from every rank each time it is
    called: two collectives per table and state, for every ``state_dict()`` (a checkpoint of
    52 tables with one optimizer state each: 104 ``all_gather_object`` calls, most of a 2-rank
    save's time). The layout of a sharded collection's tensors does not change after
    sharding, so this gathers the same per-rank metadata once, for all of them, and merges it
    with torch's own ``build_global_metadata`` (the same checks: no overlaps, the whole tensor
    covered, the same dtype everywhere). ``ShardedTensor._init_from_local_shards_and_global_metadata``
    then builds each tensor without communication, checking the local shards against it.

    Collective on first use, like ``init_from_local_shards``: every rank exports in the same
    order, so every rank reaches the one gather together."""

    def __init__(self, tables: list[ShardedTable], shards: Callable[[], dict[str, list[LocalShard]]],
                 env: ShardingEnv, state_names: Iterable[str],
                 rowwise: Callable[[str], bool]) -> None:
        self._tables, self._shards, self._env = tables, shards, env
        self._states = [(None, False)] + [(n, rowwise(n)) for n in state_names]
        self._metadata: dict[tuple[str, str | None], ShardedTensorMetadata] | None = None

    def gather(self) -> None:
        """Gather the layouts now if not yet done (collective: every rank calls it together)."""
        if self._metadata is None:
            self._metadata = self._gather()

    def get(self, table: str, name: str | None) -> ShardedTensorMetadata | None:
        """The metadata of ``table``'s weight (``name=None``) or state ``name``; None where no
        rank holds any part of it (the caller then builds it the collective way)."""
        if self._metadata is None:
            self._metadata = self._gather()
        return self._metadata.get((table, name))

    def _gather(self) -> dict[tuple[str, str | None], ShardedTensorMetadata]:
        if all(t.sharding.sharding_type is ShardingType.DATA_PARALLEL for t in self._tables):
            return {}  # replicas only: plain tensors, nothing to gather (the same on every rank)
        env, shards = self._env, self._shards()
        local: dict[Any, tuple[list[Shard], torch.Size]] = {}
        for table in self._tables:
            if table.sharding.sharding_type is ShardingType.DATA_PARALLEL:
                continue
            held = shards.get(table.config.name, [])
            for name, rowwise in self._states:
                if name is not None and any(name not in s.state for s in held):
                    continue  # not kept for this table: exported (and refused) as before
                local[(table.config.name, name)] = (
                    _local_shards(table, held, env, name), torch.Size(global_size(table, rowwise)))
        return gather_global_metadata(local, env)


def gather_global_metadata(
    local: Mapping[Any, tuple[list[Shard], torch.Size]], env: ShardingEnv,
) -> dict[Any, ShardedTensorMetadata]:
    """Global ``ShardedTensorMetadata`` of several tensors in one ``all_gather_object``: for
    each key, this rank's local shards (possibly none) and the global size. The result is what
    ``init_from_local_shards`` would compute for each (torch's own merge and checks); keys no
    rank holds a shard of are absent. Collective: every rank calls it with the same keys."""
    assert env.pg is not None
    rank = dist.get_global_rank(env.pg, env.rank)
    mine = {key: build_metadata_from_local_shards(shards, size, rank, env.pg)
            for key, (shards, size) in local.items() if shards}
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, mine, group=env.pg)
    keys = dict.fromkeys(k for part in gathered for k in part)
    return {k: build_global_metadata([part.get(k) for part in gathered]) for k in keys}


def sharded_tensor(local: list[Shard], metadata: ShardedTensorMetadata,
                   env: ShardingEnv) -> ShardedTensor:
    """A ShardedTensor of this rank's ``local`` shards and known global ``metadata``, built
    without communication (torch checks the local shards against the metadata)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor's deprecation notice; DCP reads it
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local, metadata, process_group=env.pg)


def export_tensor(
    table: ShardedTable, shards: list[LocalShard], env: ShardingEnv, name: str | None,
    rowwise_state: bool, layouts: GlobalLayouts | None = None,
) -> torch.Tensor:
    """The table's weight (``name=None``) or optimizer state ``name`` as one global tensor.

    Collective: every rank calls it for every table in order. With ``layouts`` the metadata
    comes from there (one gather for all tables, on the first export); without, from
    ``init_from_local_shards`` (a gather per call).
    """
    pick = _pick(name)
    size = global_size(table, rowwise_state)
    if table.sharding.sharding_type is ShardingType.DATA_PARALLEL or env.pg is None:
        whole = [pick(s) for s in shards if list(pick(s).shape) == size]
        if whole:
            return whole[0]
        raise ValueError(
            f"table {table.config.name!r}: a single-process environment must hold the whole "
            "table; build the ShardingEnv from a process group"
        )
    local = _local_shards(table, shards, env, name)
    metadata = None if layouts is None else layouts.get(table.config.name, name)
    if metadata is not None:
        return sharded_tensor(local, metadata, env)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor's deprecation notice; DCP reads it
        return init_from_local_shards(local, size, process_group=env.pg)


def import_tensor(
    table: ShardedTable, shards: list[LocalShard], value: torch.Tensor, name: str | None, key: str
) -> None:
    """Copy ``value`` (a ShardedTensor or a full tensor) into this rank's shards."""
    pick = _pick(name)
    for s in shards:
        offsets, sizes, target = _region(s.spec, table, pick(s))
        if target.numel() == 0:
            continue
        with torch.no_grad():
            if isinstance(value, ShardedTensor):
                _copy_from_sharded(value, offsets, sizes, target, key)
                continue
            if value.dim() != len(offsets):
                raise ValueError(
                    f"{key}: expected a {len(offsets)}-D tensor, got shape {tuple(value.shape)}"
                )
            index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
            target.copy_(value[index].view_as(target))


def _copy_from_sharded(
    value: ShardedTensor, offsets: list[int], sizes: list[int], target: torch.Tensor, key: str
) -> None:
    covered = 0
    for shard in value.local_shards():
        md = shard.metadata
        lo = [max(a, b) for a, b in zip(offsets, md.shard_offsets, strict=True)]
        hi = [
            min(a + n, b + m)
            for a, n, b, m in zip(offsets, sizes, md.shard_offsets, md.shard_sizes, strict=True)
        ]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            continue
        src = shard.tensor[tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, md.shard_offsets, strict=True))]
        dst = target.view(sizes)[tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, offsets, strict=True))]
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src)
        covered += src.numel()
    if covered != target.numel():
        raise ValueError(
            f"{key}: the ShardedTensor's local shards do not cover this rank's shard "
            f"(offsets {offsets}, sizes {sizes}); load resharded checkpoints with "
            "torch.distributed.checkpoint.load into this module's own state_dict()"
        )


def shards_by_table(lookups: Iterable) -> dict[str, list[LocalShard]]:
    out: dict[str, list[LocalShard]] = {}
    for local in lookups:
        for spec, weight, state in local.local_shards():
            out.setdefault(spec.table, []).append(LocalShard(spec, weight, state))
    return out


def state_names(shards: Mapping[str, list[LocalShard]]) -> list[str]:
    for table_shards in shards.values():
        for s in table_shards:
            return sorted(s.state)
    return []


class ShardedFusedOptimizer(KeyedOptimizer):
    """The fused optimizer of a sharded collection, with a plan-independent state dict.

    One param group (``lr``, and ``step`` for bias-corrected optimizers) drives every local
    kernel. ``state_dict()["state"]`` is keyed ``<prefix>.<table>.weight`` (prefix
    ``embedding_bags`` or ``embeddings``) ->
    ``{"<table>.<state>": global tensor}``, so it reshards with the weights.
    """

    def __init__(
        self,
        kernels_optimizer: CombinedOptimizer,
        tables: list[ShardedTable],
        shards: Callable[[], dict[str, list[LocalShard]]],
        env: ShardingEnv,
        optimizer: FusedOptimizerConfig,
        kernels: list[torch.nn.Module],
        state_prefix: str = "embedding_bags",
        layouts: GlobalLayouts | None = None,
    ) -> None:
        self._inner, self._tables, self._shards, self._env = kernels_optimizer, tables, shards, env
        self._config, self._kernels, self._prefix = optimizer, kernels, state_prefix
        self._layouts = layouts
        params = dict(kernels_optimizer.params)
        group = {"params": list(params.values()), "lr": optimizer.learning_rate}
        super().__init__(params, {}, [group])

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        lr = self.param_groups[0]["lr"]
        for group in self._inner.param_groups:
            group["lr"] = lr
        self._inner.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {<prefix>.<table>.weight: {<table>.<state>: tensor}}}`` for the tables
        this rank holds a part of (TorchRec's layout); ``"param_groups"`` (``lr``, ``step``)
        only after ``save_param_groups(True)``, as in TorchRec."""
        shards = self._shards()
        names = self._config.optimizer.state_names
        state = {}
        # a rank may skip a table only where the tensors' layouts come from one gather done
        # by every rank here (the collective construction needs every rank for every table)
        skip = self._layouts is not None and self._env.pg is not None
        if skip:
            self._layouts.gather()
            skip = all(self._layouts.get(t.config.name, None) is not None for t in self._tables
                       if t.config.name in shards
                       and t.sharding.sharding_type is not ShardingType.DATA_PARALLEL)
        for table in self._tables:
            name = table.config.name
            if skip and name not in shards:
                continue
            state[f"{self._prefix}.{name}.weight"] = {
                f"{name}.{s}": export_tensor(
                    table, shards.get(name, []), self._env, s,
                    self._config.optimizer.state_is_rowwise(s), self._layouts,
                )
                for s in names
            }
        if not self.defaults["_save_param_groups"]:
            return {"state": state}
        group = {
            "lr": self.param_groups[0]["lr"],
            "step": int(self._kernels[0].iter.item()) if self._kernels else 0,
            # every table, held here or not: the same group on every rank (DCP keeps one copy)
            "params": [f"{self._prefix}.{t.config.name}.weight" for t in self._tables],
        }
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        shards = self._shards()
        for table in self._tables:
            name = table.config.name
            key = f"{self._prefix}.{name}.weight"
            saved = state_dict["state"].get(key)
            if saved is None and name not in shards:
                continue  # no part of it here (TorchRec's state dicts leave such tables out)
            if saved is None:
                raise ValueError(f"optimizer state_dict has no state for table {name!r} ({key})")
            for s in self._config.optimizer.state_names:
                if f"{name}.{s}" not in saved:
                    raise ValueError(
                        f"optimizer state_dict for table {name!r} lacks {s!r}; it was saved with a "
                        f"different optimizer than {self._config.optimizer.name}"
                    )
                import_tensor(table, shards.get(name, []), saved[f"{name}.{s}"], s, f"{key}/{s}")
        for kernel in self._kernels:
            if callable(getattr(kernel, "invalidate", None)):
                kernel.invalidate()  # cached tables reread what was written into their store
        # A state dict saved without param groups (KeyedOptimizer.save_param_groups(False))
        # keeps the current learning rate and step, as TorchRec's load does.
        groups = state_dict.get("param_groups") or []
        if groups:
            self.param_groups[0]["lr"] = groups[0]["lr"]
            self.set_optimizer_step(int(groups[0].get("step", 0)))
        self.step()

    def set_optimizer_step(self, step: int) -> None:
        """Set every local kernel's iteration counter (bias correction of Adam/LAMB reads it)."""
        for kernel in self._kernels:
            kernel.iter.fill_(int(step))

    def update_hyper_parameters(self, params_dict: Mapping[str, Any]) -> None:
        """Set hyper-parameters by name; only ``lr`` can change after sharding (the others are
        fixed in the kernels: shard the module with new ``fused_params`` instead)."""
        unsupported = sorted(set(params_dict) - {"lr"})
        if unsupported:
            raise NotImplementedError(
                f"Setting hyper-parameter(s) {unsupported} is not supported by the sharded fused "
                "optimizer (only 'lr'); shard the module with the new values in the sharder's "
                "fused_params instead"
            )
        if "lr" in params_dict:
            self.param_groups[0]["lr"] = float(params_dict["lr"])
            self.step()  # pushes the rate to the kernels (their updates run in backward)

    def __repr__(self) -> str:
        return repr(self._inner).lstrip(": ") if len(self._inner.optimizers) == 1 else repr(self._inner)
