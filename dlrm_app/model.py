"""The DLRM model: dense arch, sparse arch, interaction (dot or DCN-v2), over arch.

Shapes for a batch of ``B`` rows, ``F`` sparse features of embedding dim ``D`` and ``N`` dense
features (the reference DLRM layout)::

    dense [B, N] --DenseArch (bottom MLP, ReLU, last size D)--> d [B, D]
    sparse KJT   --SparseArch (EmbeddingBagCollection, SUM)--> e [B, F, D]
    dot:  z = [d, e_1..e_F] as [B, F+1, D];  z z^T's F(F+1)/2 pairs above the diagonal
          -> [d, pairs]                                     [B, D + F(F+1)/2]
    dcn:  x0 = [d, e_1..e_F] flattened                     [B, (F+1)D]
          x_{l+1} = x0 * (W_l (V_l x_l) + b_l) + x_l       (low-rank cross layers, rank r)
    OverArch (top MLP, ReLU except the last layer, which gives 1 logit)   -> [B, 1]
    wide (``ModelConfig.wide``): + sum_f w_f[id] + v . dense   (a logistic regression's terms)

``build_dlrm(spec, config, device)`` builds it from a dataset's ``dataset.json``: one table per
sparse feature (``t_<feature>``, ``num_embeddings`` from the dataset). Build on
``device="meta"`` and let ``DistributedModelParallel`` materialize it: tables are then allocated
only as shards, and the sharder's ``table_init=table_initializer(seed)`` fills them so that the
same seed gives the same weights under any plan and world size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from dlrm_app.config import ZCH_EVICTION_INTERVAL, ZCH_MEMORY_BYTES, Interaction, ModelConfig
from dlrm_app.data.schema import DatasetSpec, SparseFeature
from recsys_core.distributed.table_init import SeededUniformInit, TableRegion
from recsys_core.models._dot_interaction import (
    dot_interaction_with_grad,
    flat_pair_indices,
    pair_runs,
)
from recsys_core.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from recsys_core.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from recsys_core.sparse import KeyedJaggedTensor


def _mlp(in_features: int, sizes: tuple[int, ...], device: torch.device | str | None,
         last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, out in enumerate(sizes):
        layers.append(nn.Linear(in_features, out, device=device))
        if last_activation or i < len(sizes) - 1:
            layers.append(nn.ReLU())
        in_features = out
    return nn.Sequential(*layers)


class _MLPArch(nn.Module):
    """An MLP held as ``self.model`` (the state-dict keys the checkpoints use)."""

    last_activation: bool

    def __init__(self, in_features: int, layer_sizes: tuple[int, ...],
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.model = _mlp(in_features, layer_sizes, device, self.last_activation)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class DenseArch(_MLPArch):
    """Bottom MLP: ``[B, N] -> [B, D]``, ReLU after every layer."""

    last_activation = True


class SparseArch(nn.Module):
    """Pooled embeddings as ``[B, F, D]`` from the EmbeddingBagCollection and the
    managed-collision one (raw ids mapped to rows by zero-collision hashing); either may be
    None (not both). Features in ``feature_order`` (default: the first collection's, then the
    second's)."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection | None,
                 managed_collision_collection: ManagedCollisionEmbeddingBagCollection | None = None,
                 feature_order: list[str] | None = None) -> None:
        super().__init__()
        if embedding_bag_collection is None and managed_collision_collection is None:
            raise ValueError("SparseArch needs an embedding bag collection")
        self.embedding_bag_collection = embedding_bag_collection
        self.managed_collision_collection = managed_collision_collection
        configs = [] if embedding_bag_collection is None else \
            embedding_bag_collection.embedding_bag_configs()
        if managed_collision_collection is not None:
            configs = configs + managed_collision_collection.embedding_bag_configs()
        dims = {c.embedding_dim for c in configs}
        if len(dims) != 1:
            raise ValueError(f"DLRM needs one embedding dim for every table, got {sorted(dims)}")
        self.embedding_dim = dims.pop()
        produced = [f for c in configs for f in c.feature_names]
        self.feature_names = list(feature_order or produced)
        if sorted(self.feature_names) != sorted(produced):
            raise ValueError(f"feature_order {self.feature_names} must list the collections' "
                             f"features {produced}")
        order = [produced.index(f) for f in self.feature_names]
        self.register_buffer("_order", None if order == list(range(len(order))) else
                             torch.tensor(order), persistent=False)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.finish(self.start(features))

    def start(self, features: KeyedJaggedTensor) -> list[Any]:
        """Look the features up; sharded, the pooled embeddings' exchange between ranks is
        then in flight (the collections return awaitables) until ``finish`` waits for it."""
        parts: list[Any] = []
        if self.embedding_bag_collection is not None:
            # a KeyedTensor (a LazyAwaitable of one, when sharded)
            parts.append(self.embedding_bag_collection(features))
        if self.managed_collision_collection is not None:
            parts.append(self.managed_collision_collection(features)[0])
        return parts

    def finish(self, parts: list[Any]) -> torch.Tensor:
        """``[B, F, D]`` from what ``start`` returned (waits for the exchange)."""
        values = [p.values() for p in parts]
        values = values[0] if len(values) == 1 else torch.cat(values, dim=1)
        pooled = values.view(-1, len(self.feature_names), self.embedding_dim)
        return pooled if self._order is None else pooled.index_select(1, self._order)


class InteractionArch(nn.Module):
    """Dot interaction: the dense vector, then every pairwise dot product of
    ``[dense, e_1, ..., e_F]`` above the diagonal: ``[B, D + F(F+1)/2]``.

    Under autocast the vectors are cast before they are stacked (autocast would cast the
    product's two operands separately, one of them a strided transpose). Training runs
    :class:`~recsys_core.models._dot_interaction.DotInteraction`. Forward + backward at B=2048, 26 features, dim 128 on one core:
    the one-product backward took it from 38 to 17 ms in bf16 and 46 to 31 ms in fp32; writing
    each buffer once then took bf16 21.9 -> 18.5 ms CPU time (fp32 38.4 -> 38.2: there the
    products dominate), medians of 25 interleaved runs on a shared 2-core AMD EPYC with
    AVX-512 BF16. Inference (no gradient, TorchScript, export) keeps cat, bmm and
    index_select, the same values."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        n = num_sparse_features + 1
        self.register_buffer("flat", flat_pair_indices(n), persistent=False)
        self.runs = pair_runs(n)

    def output_dim(self, embedding_dim: int) -> int:
        return embedding_dim + self.flat.numel()

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_scripting():
            kind = sparse.device.type
            low = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else \
                dense.dtype
            if torch.is_grad_enabled() and (dense.requires_grad or sparse.requires_grad):
                return dot_interaction_with_grad(dense, sparse, low, self.flat, self.runs)
            dense, sparse = dense.to(low), sparse.to(low)  # a cat of mixed dtypes is 3-6x slower
        combined = torch.cat([dense.unsqueeze(1), sparse.to(dense.dtype)], dim=1)
        products = torch.bmm(combined, combined.transpose(1, 2))
        pairs = products.view(products.shape[0], -1).index_select(1, self.flat)
        return torch.cat([dense.to(pairs.dtype), pairs], dim=1)


class CrossLayer(nn.Module):
    """One low-rank cross layer: ``x0 * (W (V x) + b) + x``."""

    def __init__(self, in_features: int, low_rank: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.V = nn.Linear(in_features, low_rank, bias=False, device=device)
        self.W = nn.Linear(low_rank, in_features, bias=True, device=device)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.W(self.V(x)) + x


class LowRankCrossNet(nn.Module):
    """DCN-v2 cross layers with low-rank weights: ``x_{l+1} = x0 * (W_l (V_l x_l) + b_l) + x_l``."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.layers = nn.ModuleList(CrossLayer(in_features, low_rank, device)
                                    for _ in range(num_layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = layer(x0, x)
        return x


class InteractionDCNArch(nn.Module):
    """DCN interaction: the cross network over ``[dense, e_1, ..., e_F]`` flattened."""

    def __init__(self, num_sparse_features: int, embedding_dim: int, num_layers: int,
                 low_rank: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.crossnet = LowRankCrossNet((num_sparse_features + 1) * embedding_dim, num_layers,
                                        low_rank, device)

    def output_dim(self, embedding_dim: int) -> int:
        return self.crossnet.in_features

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        combined = torch.cat([dense.unsqueeze(1), sparse], dim=1).flatten(1)
        return self.crossnet(combined)


class OverArch(_MLPArch):
    """Top MLP: ReLU after every layer but the last, which gives one logit per row."""

    last_activation = False


WIDE_PREFIX = "w_"
"""Tables of the wide part are named ``w_<feature>`` (the DLRM's own ``t_<feature>``)."""


class _ZeroLinear(nn.Linear):
    """A linear layer that starts at zero (``reset_parameters`` too, as the sharded model's
    materialization calls it)."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class WideBagCollection(EmbeddingBagCollection):
    """The wide part's tables: an EmbeddingBagCollection of a type of its own, so that its
    sharder can keep their pooled sums in fp32 on the wire whatever ``--comm-precision`` does to
    the embeddings (a rounded scalar goes straight into the logit; the bytes are 1/dim of the
    embeddings')."""


class WidePart(nn.Module):
    """The wide part of wide & deep: a logistic regression's terms added to the logit, a
    learned scalar per id of each feature (SUM-pooled dim-1 tables ``w_<feature>``) and a
    linear term of the dense features. The DLRM sees an id only through dot products with the
    other features; these give it each id's and each dense feature's own effect. Both start at
    zero (:func:`table_initializer` zeroes the tables), so training starts from the plain DLRM.

    ``forward(dense [B, N], sparse KJT) -> [B, 1]``; ``start``/``finish`` split it as
    :class:`SparseArch` does (a sharded lookup in flight in between)."""

    def __init__(self, features: list[tuple[str, int]], num_dense: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.feature_names = [name for name, _ in features]
        self.tables = WideBagCollection(tables=[
            EmbeddingBagConfig(name=WIDE_PREFIX + name, embedding_dim=1, num_embeddings=rows,
                               feature_names=[name], pooling=PoolingType.SUM)
            for name, rows in features], device=device) if features else None
        self.dense = _ZeroLinear(num_dense, 1, device=device)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.finish(self.start(sparse), dense)

    def start(self, sparse: KeyedJaggedTensor) -> Any:
        return None if self.tables is None else self.tables(sparse)

    def finish(self, started: Any, dense: torch.Tensor) -> torch.Tensor:
        # fp32 (the dense term is cast back where autocast ran it in bf16)
        out = self.dense(dense).float()
        if started is not None:
            out = out + started.values().sum(1, keepdim=True)
        return out


class DLRM(nn.Module):
    """Deep Learning Recommendation Model (Naumov et al. 2019), optionally with DCN-v2.

    ``forward(dense_features [B, N], sparse_features KJT) -> logits [B, 1]`` (before sigmoid).
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection | None,
        dense_in_features: int,
        dense_arch_layer_sizes: tuple[int, ...],
        over_arch_layer_sizes: tuple[int, ...],
        interaction: Interaction = Interaction.DOT,
        dcn_num_layers: int = 3,
        dcn_low_rank_dim: int = 512,
        dense_device: torch.device | str | None = None,
        managed_collision_collection: ManagedCollisionEmbeddingBagCollection | None = None,
        feature_order: list[str] | None = None,
        wide_features: list[tuple[str, int]] | None = None,
    ) -> None:
        super().__init__()
        self.sparse_arch = SparseArch(embedding_bag_collection, managed_collision_collection,
                                      feature_order)
        dim = self.sparse_arch.embedding_dim
        if dense_arch_layer_sizes[-1] != dim:
            raise ValueError(f"the bottom MLP's last layer ({dense_arch_layer_sizes[-1]}) must "
                             f"equal the embedding dim ({dim})")
        num_sparse = len(self.sparse_arch.feature_names)
        self.dense_arch = DenseArch(dense_in_features, tuple(dense_arch_layer_sizes),
                                    dense_device)
        self.inter_arch: InteractionArch | InteractionDCNArch
        if interaction is Interaction.DOT:
            self.inter_arch = InteractionArch(num_sparse)
        else:
            self.inter_arch = InteractionDCNArch(num_sparse, dim, dcn_num_layers,
                                                 dcn_low_rank_dim, dense_device)
        self.over_arch = OverArch(self.inter_arch.output_dim(dim), tuple(over_arch_layer_sizes),
                                  dense_device)
        # built last: the other layers draw the same initial values with or without it
        self.wide = None if wide_features is None else WidePart(
            wide_features, dense_in_features, dense_device)

    overlap_exchange: bool = True
    """Run the bottom MLP while the pooled embeddings travel between ranks (sharded), in
    forward and, as autograd then orders it, in backward: the embeddings' gradients travel while
    the bottom MLP's backward runs. The same values either way; False only measures the gain
    (``bench/overlap.py``)."""

    def forward(self, dense_features: torch.Tensor,
                sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        wide = None
        if self.overlap_exchange:
            started = self.sparse_arch.start(sparse_features)
            if self.wide is not None:
                wide = self.wide.start(sparse_features)
            embedded_dense = self.dense_arch(dense_features)
            embedded_sparse = self.sparse_arch.finish(started)
        else:
            embedded_dense = self.dense_arch(dense_features)
            embedded_sparse = self.sparse_arch(sparse_features)
            if self.wide is not None:
                wide = self.wide.start(sparse_features)
        logits = self.over_arch(self.inter_arch(embedded_dense, embedded_sparse))
        if self.wide is not None:
            logits = logits + self.wide.finish(wide, dense_features)
        return logits


def table_name(feature: str) -> str:
    """The embedding table of a sparse feature."""
    return f"t_{feature}"


ZCH_ROW_STATE_BYTES = 4 * 8
"""Remapping state per row of a raw-id table: its raw id and row in the sorted table, and the
eviction policy's count and last access (int64 each)."""
ZCH_HASH_MULTIPLIER = 0x5BD1E995
"""Odd, below 2^31: ``id * M mod 2^k`` is a bijection of ``[0, 2^k)`` (no two raw ids share a
value), which spreads ids over the ranks that own row ranges of a sharded raw-id table."""
MAX_RAW_ID_SPACE = 1 << 32
"""Largest raw id space a raw-id feature may declare (the scramble's product stays in int64)."""


def raw_id_space(feature: SparseFeature) -> int:
    """The power of two at or above a raw-id feature's ``num_embeddings``: the range its ids
    are scrambled in before they are routed and remapped."""
    if feature.num_embeddings > MAX_RAW_ID_SPACE:
        raise ValueError(f"feature '{feature.name}': raw ids in [0, {feature.num_embeddings}) "
                         f"exceed the supported raw id space [0, 2^32); re-preprocess with "
                         f"--id-mapping hash or vocabulary")
    return 1 << max(feature.num_embeddings - 1, 1).bit_length()


def scramble_ids(ids: torch.Tensor, input_hash_size: int) -> torch.Tensor:
    """``ids * ZCH_HASH_MULTIPLIER mod input_hash_size`` (a power of two): a bijection, so the
    remapping stays collision-free; ids outside ``[0, input_hash_size)`` are refused."""
    low, high = (int(x) for x in torch.aminmax(ids)) if ids.numel() else (0, 0)
    if low < 0 or high >= input_hash_size:  # one pass per batch and feature
        bad = low if low < 0 else high
        raise ValueError(f"raw id {bad} is outside [0, {input_hash_size}) of its feature's raw "
                         f"id space; the data must come from the preprocessing the model was "
                         f"trained on")
    return (ids * ZCH_HASH_MULTIPLIER) & (input_hash_size - 1)


def zch_table_rows(spec: DatasetSpec, config: ModelConfig) -> int:
    """Rows of each raw-id table: ``--zch-rows``, else ZCH_MEMORY_BYTES over those tables (fp32
    weights, row-wise optimizer state and remapping state per row), at most a feature's raw id
    space plus the shared row."""
    raw = [f for f in spec.sparse_features if f.raw_ids]
    if config.zch_rows is not None:
        return config.zch_rows
    per_row = config.embedding_dim * 4 + 4 + ZCH_ROW_STATE_BYTES
    rows = ZCH_MEMORY_BYTES // (max(len(raw), 1) * per_row)
    return max(2, min(rows, max(f.num_embeddings for f in raw) + 1))


def build_dlrm(spec: DatasetSpec, config: ModelConfig,
               device: torch.device | str = "meta",
               wide_features: list[str] | None = None) -> DLRM:
    """A DLRM for the dataset ``spec``: one SUM-pooled table per sparse feature; features with
    raw ids (``--id-mapping zch``) in a ManagedCollisionEmbeddingBagCollection whose tables
    have ``zch_table_rows`` rows each. With ``config.wide``, a :class:`WidePart` over
    ``wide_features`` (default: the features with encoded ids; raw-id features have none)."""
    device = torch.device(device)
    wide = None
    if config.wide:
        if wide_features is None:
            wide_features = [f.name for f in spec.sparse_features if not f.raw_ids]
        rows = {f.name: f.num_embeddings for f in spec.sparse_features}
        wide = [(name, rows[name]) for name in wide_features]
    tables = [
        EmbeddingBagConfig(name=table_name(f.name), embedding_dim=config.embedding_dim,
                           num_embeddings=f.num_embeddings, feature_names=[f.name],
                           pooling=PoolingType.SUM)
        for f in spec.sparse_features if not f.raw_ids
    ]
    raw = [f for f in spec.sparse_features if f.raw_ids]
    managed = None
    if raw:
        rows = zch_table_rows(spec, config)
        raw_tables = [
            EmbeddingBagConfig(name=table_name(f.name), embedding_dim=config.embedding_dim,
                               num_embeddings=rows, feature_names=[f.name],
                               pooling=PoolingType.SUM)
            for f in raw
        ]
        modules = {
            t.name: MCHManagedCollisionModule(
                zch_size=rows, device=device, eviction_policy=DistanceLFU_EvictionPolicy(),
                eviction_interval=ZCH_EVICTION_INTERVAL, input_hash_size=raw_id_space(f),
                input_hash_func=scramble_ids, name=t.name)
            for t, f in zip(raw_tables, raw, strict=True)
        }
        managed = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=raw_tables, device=device),
            ManagedCollisionCollection(modules, raw_tables),
            return_remapped_features=False,
        )
    return DLRM(
        EmbeddingBagCollection(tables=tables, device=device) if tables else None,
        dense_in_features=len(spec.dense_features),
        dense_arch_layer_sizes=config.dense_arch_layer_sizes,
        over_arch_layer_sizes=config.over_arch_layer_sizes,
        interaction=config.interaction,
        dcn_num_layers=config.dcn_num_layers,
        dcn_low_rank_dim=config.dcn_low_rank_dim,
        dense_device=device,
        managed_collision_collection=managed,
        feature_order=[f.name for f in spec.sparse_features],
        wide_features=wide,
    )


INIT_BLOCK_ROWS = 4096
"""Rows per independently seeded block of :func:`table_initializer`."""


@dataclasses.dataclass(frozen=True)
class DLRMTableInit(SeededUniformInit):
    """:class:`SeededUniformInit`, except the wide part's tables (``w_*``), which start at
    zero."""

    def fill(self, weight: torch.Tensor, region: TableRegion) -> None:
        if region.table.startswith(WIDE_PREFIX):
            with torch.no_grad():
                weight.zero_()
            return
        super().fill(weight, region)


def table_initializer(seed: int) -> SeededUniformInit:
    """The plan-independent table initializer of a run: ``U(-sqrt(1/rows), sqrt(1/rows))``
    values that depend only on (seed, table, row, column); the wide part's tables zero. The
    sharder applies it to every shard (``EmbeddingBagCollectionSharder(table_init=...)``)."""
    return DLRMTableInit(seed, block_rows=INIT_BLOCK_ROWS)


def fill_table_region(weight: torch.Tensor, table: str, num_rows: int, dim: int,
                      row_offset: int, col_offset: int, seed: int) -> None:
    """Fill ``weight`` (the rows ``row_offset:+rows``, columns ``col_offset:+cols`` of table
    ``table`` of shape ``[num_rows, dim]``) as :func:`table_initializer` does, never depending
    on how the table is cut."""
    table_initializer(seed).fill(weight, TableRegion(
        table=table, num_rows=num_rows, dim=dim, row_offset=row_offset, col_offset=col_offset))


def init_embedding_tables(model: nn.Module, seed: int) -> None:
    """Initialize every table of every unsharded EmbeddingBagCollection in ``model`` as the
    sharder's ``table_init=table_initializer(seed)`` initializes the shards of a sharded one."""
    for module in model.modules():
        if isinstance(module, EmbeddingBagCollection):
            for c in module.embedding_bag_configs():
                weight = module.embedding_bags[c.name].weight
                if not weight.is_meta:
                    fill_table_region(weight, c.name, c.num_embeddings, c.embedding_dim, 0, 0,
                                      seed)
