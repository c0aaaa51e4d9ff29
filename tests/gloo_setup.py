"""What the multi-process (gloo) tests share: random per-rank batches and the global batch the
unsharded oracle sees, the usual two pooled tables and their plans per sharding type, sharding a collection
beside its unsharded copy, one training step against that copy, and the comparisons of local
shards with the oracle's tables, and counting a module's layout gathers.

The functions run inside ``recsys_core.testing.run_gloo`` ranks (the default process group is
up) or in the test process itself; every module-level function here pickles by reference, so a
test may pass one straight to ``run_gloo``.

A global batch is the ranks' batches key by key, rank 0 first::

    rank 0: keys [f0, f1], lengths [1, 2 | 0, 1]      rank 1: lengths [2, 0 | 1, 1]
    concat_ranks -> keys [f0, f1], lengths [1, 2, 2, 0 | 0, 1, 1, 1], stride 4

so rank ``r``'s pooled rows are ``rank_rows(r, batch)`` of the oracle's output.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from table_configs import one_feature_tables
from torch import nn

from recsys_core import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from recsys_core.distributed import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    ShardingEnv,
    ShardingPlan,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)

ShardKey = tuple[str, int, int]  # (table, row offset, column offset)
T = TypeVar("T")


def world_env() -> ShardingEnv:
    """The sharding environment of the default (gloo) process group."""
    return ShardingEnv.from_process_group(dist.group.WORLD)


# ---- batches --------------------------------------------------------------------------------


def random_batch(
    gen: torch.Generator, keys: Sequence[str], rows: Sequence[int], batch: int, *,
    max_len: int = 4, weighted: bool = False, empty_first: bool = False,
) -> KeyedJaggedTensor:
    """``batch`` bags per key of 0 to ``max_len - 1`` ids below the key's ``rows``; per-id
    weights when ``weighted``; with ``empty_first`` the first bag of the first key is empty."""
    lengths = torch.randint(0, max_len, (len(keys) * batch,), generator=gen)
    if empty_first:
        lengths[0] = 0
    values = torch.cat([
        torch.randint(0, rows[i], (int(lengths[i * batch : (i + 1) * batch].sum()),), generator=gen)
        for i in range(len(keys))
    ])
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths, weights=weights,
                             stride=batch)


def rank_batches(
    seed: int, world: int, keys: Sequence[str], rows: Sequence[int], batch: int, **kwargs: Any,
) -> list[KeyedJaggedTensor]:
    """One ``random_batch`` per rank, all drawn from one generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [random_batch(gen, keys, rows, batch, **kwargs) for _ in range(world)]


def concat_ranks(kjts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """The global batch: every rank's bags of a key, rank 0's first (weights too, if any)."""
    keys = kjts[0].keys()
    per_key = [[k.to_dict()[key] for k in kjts] for key in keys]
    weighted = kjts[0].weights_or_none() is not None
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([jt.values() for jts in per_key for jt in jts]),
        lengths=torch.cat([jt.lengths() for jts in per_key for jt in jts]),
        weights=torch.cat([jt.weights() for jts in per_key for jt in jts]) if weighted else None,
        stride=sum(k.stride() for k in kjts),
    )


def rank_rows(rank: int, batch: int) -> slice:
    """Rank ``rank``'s rows of the global batch when every rank has ``batch`` rows."""
    return slice(rank * batch, (rank + 1) * batch)


# ---- plans ----------------------------------------------------------------------------------


SUM_MEAN_KEYS = ["f0", "f1", "f2"]
"""The features of :func:`sum_and_mean_tables`: f0 and f1 read the first table, f2 the second."""


def sum_and_mean_tables(rows: tuple[int, int] = (13, 7), names: tuple[str, str] = ("t_sum", "t_mean"),
                        ) -> list[EmbeddingBagConfig]:
    """The two pooled tables the EBC tests shard (``two_table_plans(*names, ...)``):
    ``names[0]`` of ``rows[0]`` x 8 read by f0 and f1, SUM pooling; ``names[1]`` of ``rows[1]``
    x 4 read by f2, MEAN pooling."""
    return [
        EmbeddingBagConfig(name=names[0], embedding_dim=8, num_embeddings=rows[0],
                           feature_names=["f0", "f1"], pooling=PoolingType.SUM),
        EmbeddingBagConfig(name=names[1], embedding_dim=4, num_embeddings=rows[1],
                           feature_names=["f2"], pooling=PoolingType.MEAN),
    ]


def two_table_plans(
    first: str, second: str, world: int, local: int | None = None, kernel: str = "fused",
) -> dict[str, dict[str, Any]]:
    """Sharding kind -> generators for tables ``first`` and ``second``: table-wise on the last
    rank and rank 0; row-wise; ``first``'s columns on ranks 0 and the last, ``second``'s on the
    last; table-row-wise on the last host and host 0; ``first`` table-column-wise on the last
    host beside ``second`` table-wise on rank 0; data-parallel. Tests add their own "mixed"."""
    last, last_host = world - 1, world // (local or world) - 1
    return {
        "table_wise": {first: table_wise(rank=last, compute_kernel=kernel),
                       second: table_wise(rank=0, compute_kernel=kernel)},
        "row_wise": {first: row_wise(compute_kernel=kernel),
                     second: row_wise(compute_kernel=kernel)},
        "column_wise": {first: column_wise(ranks=[0, last], compute_kernel=kernel),
                        second: column_wise(ranks=[last], compute_kernel=kernel)},
        "table_row_wise": {first: table_row_wise(host_index=last_host, compute_kernel=kernel),
                           second: table_row_wise(host_index=0, compute_kernel=kernel)},
        "table_column_wise": {first: table_column_wise(host_index=last_host, compute_kernel=kernel),
                              second: table_wise(rank=0, compute_kernel=kernel)},
        "data_parallel": {first: data_parallel(compute_kernel=kernel),
                          second: data_parallel(compute_kernel=kernel)},
    }


def shard_beside_reference(
    module: EmbeddingBagCollection | EmbeddingCollection, generators: Mapping[str, Any],
    world: int, local: int | None = None, **sharder_kwargs: Any,
) -> tuple[nn.Module, nn.Module]:
    """(sharded, reference): ``module`` sharded by ``generators`` over the default process
    group on CPU, and an unsharded copy of it taken before sharding (the oracle)."""
    reference = copy.deepcopy(module)
    plan = construct_module_sharding_plan(module, dict(generators), world, local)
    sharder_type = (EmbeddingCollectionSharder if isinstance(module, EmbeddingCollection)
                    else EmbeddingBagCollectionSharder)
    sharded = sharder_type(**sharder_kwargs).shard(module, plan, world_env(), torch.device("cpu"))
    return sharded, reference


def equal_tables_dmp(
    names: Sequence[str], rows: int, dim: int, generators: Mapping[str, Any], world: int,
    fused_params: Mapping[str, Any],
) -> DistributedModelParallel:
    """A DistributedModelParallel of tables ``names``, each ``rows`` x ``dim`` and table ``n``
    read by feature ``f<n>``, sharded by ``generators`` over the default process group with
    the fused optimizer ``fused_params`` (the tutorial's dict); initialized from torch's seed."""
    ebc = EmbeddingBagCollection(
        one_feature_tables(EmbeddingBagConfig, {n: (rows, dim) for n in names}))
    plan = construct_module_sharding_plan(ebc, dict(generators), world)
    sharder = EmbeddingBagCollectionSharder(fused_params=dict(fused_params))
    return DistributedModelParallel(ebc, plan=ShardingPlan({"": plan}), sharders=[sharder])


# ---- one step against the oracle ------------------------------------------------------------


def pooled_step(
    values: torch.Tensor, ref_values: torch.Tensor, rows: slice, target: torch.Tensor,
    ref_opt: torch.optim.Optimizer, scale: int, *, atol: float | None = 1e-5,
    rtol: float | None = 1e-5,
) -> None:
    """One step of a rank's pooled output ``values`` against the oracle's ``ref_values`` on the
    global batch: the rank's rows are equal; the rank's loss is ``sum(tanh(values) * target)``
    on its rows, the oracle steps on the sum of the ranks' losses divided by ``scale`` (the
    world size under gradient division), so the gradient reaching the rank is the oracle's
    times ``scale``. ``atol=rtol=None``: assert_close's default tolerances."""
    values.retain_grad()
    ref_values.retain_grad()
    torch.testing.assert_close(values, ref_values[rows].detach(), atol=atol, rtol=rtol)
    (torch.tanh(values) * target[rows]).sum().backward()
    ref_opt.zero_grad()
    ((torch.tanh(ref_values) * target).sum() / scale).backward()
    ref_opt.step()
    torch.testing.assert_close(values.grad, ref_values.grad[rows] * scale, atol=atol, rtol=rtol)


# ---- shards against the oracle's tables -----------------------------------------------------


def check_local_shards(
    sharded: nn.Module, tables: nn.ModuleDict, ref_opt: torch.optim.Optimizer | None = None,
    states: tuple[str, str] | None = None, *, atol: float = 1e-5, rtol: float = 1e-5,
) -> int:
    """Every local shard of ``sharded``'s lookups equals its block of the oracle's table
    (``tables``: ``reference.embedding_bags`` or ``reference.embeddings``); with ``states``
    ``(ref_key, key)`` its optimizer state ``key`` equals ``ref_opt.state[table][ref_key]``'s
    block too (its rows, for a per-row state). Returns how many shards were compared."""
    checked = 0
    for local in sharded.lookups:
        for shard, weight, state in local.local_shards():
            param = tables[shard.table].weight
            rows = slice(shard.row_offset, shard.row_offset + shard.rows)
            cols = slice(shard.col_offset, shard.col_offset + shard.cols)
            torch.testing.assert_close(weight, param.detach()[rows, cols], atol=atol, rtol=rtol)
            if states is not None:
                assert ref_opt is not None
                ref_key, key = states
                ref = ref_opt.state[param][ref_key]
                ref = ref[rows] if ref.dim() == 1 else ref[rows, cols]
                torch.testing.assert_close(state[key], ref, atol=atol, rtol=rtol)
            checked += 1
    return checked


def shard_weights(sharded: nn.Module) -> dict[ShardKey, torch.Tensor]:
    """This rank's shards of every table (a copy), by (table, row offset, column offset)."""
    return {
        (name, s.spec.row_offset, s.spec.col_offset): s.weight.clone()
        for name, shards in sharded.table_shards().items() for s in shards
    }


def table_weights(tables: nn.ModuleDict) -> dict[str, torch.Tensor]:
    """The oracle's whole tables by name (``reference.embedding_bags`` or ``.embeddings``)."""
    return {name: module.weight.detach() for name, module in tables.items()}


def assert_blocks_of(
    shards: Mapping[ShardKey, torch.Tensor], full: Mapping[str, torch.Tensor], **tolerance: Any,
) -> None:
    """Every shard of ``shard_weights`` equals its block of the whole table ``full[table]``."""
    for (name, row, col), weight in shards.items():
        block = full[name][row : row + weight.shape[0], col : col + weight.shape[1]]
        torch.testing.assert_close(weight, block, **tolerance)


def assert_sharded_tensor_blocks(value: Any, full: torch.Tensor, **tolerance: Any) -> None:
    """Every local shard of the ShardedTensor ``value`` equals its block of ``full``."""
    for shard in value.local_shards():
        (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        torch.testing.assert_close(shard.tensor, full[r : r + h, c : c + w], **tolerance)


def gather_to_rank0(value: Any, rank: int) -> torch.Tensor | None:
    """The whole ShardedTensor on rank 0 (None on the other ranks, which must call this too)."""
    out = torch.zeros(value.size()) if rank == 0 else None
    value.gather(0, out)
    return out


def counting_gathers(fn: Callable[[], T]) -> tuple[T, int]:
    """(what ``fn()`` returned, how many ``dist.all_gather_object`` calls it made): how often a
    module gathers its global layouts."""
    real, calls = dist.all_gather_object, [0]

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    dist.all_gather_object = counting
    try:
        return fn(), calls[0]
    finally:
        dist.all_gather_object = real


# ---- one table per sharding type --------------------------------------------------------------

ONE_PER_TYPE_ROWS = {"dp": 12, "tw": 10, "rw": 17, "cw": 9, "twrw": 14, "twcw": 11}
"""Rows of the tables of :func:`one_table_per_type` (one table per sharding type, by name)."""
SEQUENCE_TYPES = ("tw", "rw", "cw")
"""The tables an EmbeddingCollection can take (table-, row-, column-wise)."""


def one_table_per_type(world: int, names: Sequence[str] = tuple(ONE_PER_TYPE_ROWS),
                       **kernel: str) -> dict[str, Any]:
    """Generators for the tables ``names``: ``dp`` data-parallel, ``tw`` table-wise on the last
    rank, ``rw`` row-wise, ``cw`` column-wise on ranks 0 and the last, ``twrw`` / ``twcw`` on
    host 0; ``kernel`` (``compute_kernel="fused"``) or TorchRec's default kernel."""
    last = world - 1
    every = {"dp": data_parallel(**kernel), "tw": table_wise(rank=last, **kernel),
             "rw": row_wise(**kernel), "cw": column_wise(ranks=[0, last], **kernel),
             "twrw": table_row_wise(host_index=0, **kernel),
             "twcw": table_column_wise(host_index=0, **kernel)}
    return {name: every[name] for name in names}


def one_table_per_type_module(kind: str, weighted: bool = False,
                              ) -> EmbeddingBagCollection | EmbeddingCollection:
    """The tables of :func:`one_table_per_type`, table ``n`` of ``ONE_PER_TYPE_ROWS[n]`` rows of
    8 read by feature ``f_n``: every one in an EmbeddingBagCollection (``kind`` "ebc", per-id
    weights when ``weighted``), the ``SEQUENCE_TYPES`` ones in an EmbeddingCollection ("ec")."""
    if kind == "ec":
        return EmbeddingCollection([
            EmbeddingConfig(name=n, feature_names=[f"f_{n}"], num_embeddings=ONE_PER_TYPE_ROWS[n],
                            embedding_dim=8) for n in SEQUENCE_TYPES])
    return EmbeddingBagCollection([
        EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], num_embeddings=rows, embedding_dim=8)
        for n, rows in ONE_PER_TYPE_ROWS.items()], is_weighted=weighted)


def one_table_per_type_kind(kind: str) -> tuple[list[str], type, str]:
    """(table names, sharder type, state dict prefix) of ``one_table_per_type_module(kind)``:
    the ``SEQUENCE_TYPES``, EmbeddingCollectionSharder, "embeddings" for "ec"; every table,
    EmbeddingBagCollectionSharder, "embedding_bags" for "ebc"."""
    if kind == "ec":
        return list(SEQUENCE_TYPES), EmbeddingCollectionSharder, "embeddings"
    return list(ONE_PER_TYPE_ROWS), EmbeddingBagCollectionSharder, "embedding_bags"


def one_table_per_type_batches(seed: int, world: int, names: Sequence[str], batch: int,
                               **kwargs: Any) -> list[KeyedJaggedTensor]:
    """``rank_batches`` of the features ``f_<n>`` of the tables ``names`` of
    :func:`one_table_per_type_module`, ids below each table's rows."""
    return rank_batches(seed, world, [f"f_{n}" for n in names],
                        [ONE_PER_TYPE_ROWS[n] for n in names], batch, **kwargs)


def half_squares_loss(out: Any) -> torch.Tensor:
    """Half the sum of the squares of a collection's output (an EmbeddingCollection's dict of
    JaggedTensors, or pooled values): a loss whose gradient depends on the weights, so steps
    compound."""
    if isinstance(out, dict):
        return sum((jt.values() ** 2).sum() for jt in out.values()) * 0.5
    return (out.values() ** 2).sum() * 0.5
