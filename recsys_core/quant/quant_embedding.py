"""Quantized pooled embeddings for inference.

:class:`QuantTBEBag` is the tensor-level kernel module: all tables of a collection in one flat
``uint8`` buffer in FBGEMM's int-n-bit layout (see :mod:`recsys_core.kernels.quant_tbe`), one
pooled lookup. It is TorchScript-able and its scripted form needs only torch (+ ``fbgemm_gpu`` to
register the FBGEMM op when it was built with FBGEMM).

:class:`QuantEmbeddingBagCollection` (TorchRec's ``torchrec.quant.EmbeddingBagCollection``) wraps
it with the EmbeddingBagCollection contract: KeyedJaggedTensor in, KeyedTensor out::

    tables  t_int8 (INT8, 1000 x 16, feature "a", SUM), t_int4 (INT4, 50 x 8, "b", MEAN)
    input   KJT "a": [[3, 7], []]   "b": [[1], [2, 2]]
    output  KT  keys ["a", "b"], values [2, 24]: columns 0-15 = row3 + row7 (dequantized), 0;
            columns 16-23 = row1, (row2 + row2) / 2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from recsys_core.kernels.config import KernelBackend
from recsys_core.kernels.quant_tbe import (
    PLACEMENT_DEVICE,
    PLACEMENT_HOST,
    QuantTableSpec,
    WeightType,
    default_row_alignment,
    fbgemm_quant_pooled,
    max_dims,
    pack_tables,
    quant_fbgemm_missing,
    quantize_rows,
    row_bytes,
    table_offsets,
    table_views,
    torch_quant_lookup,
)
from recsys_core.kernels.tbe import IdOutOfRangeError, describe_bad_ids
from recsys_core.modules.collection_tables import PooledCollectionTables
from recsys_core.modules.embedding_configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    PoolingType,
    check_unique_tables,
)
from recsys_core.modules.embedding_modules import EmbeddingBagCollection, check_features
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from recsys_core.quant.dtypes import (
    MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT as PRUNING_ATTR,
)
from recsys_core.quant.dtypes import resolve_quant_dtype
from recsys_core.sparse import KeyedJaggedTensor, KeyedTensor
from recsys_core.sparse.key_order import KeyOrder

# Storage types a quantized table may use, and their FBGEMM weight type.
QUANT_DATA_TYPES: dict[DataType, WeightType] = {
    DataType.FP32: WeightType.FP32,
    DataType.FP16: WeightType.FP16,
    DataType.INT8: WeightType.INT8,
    DataType.INT4: WeightType.INT4,
    DataType.INT2: WeightType.INT2,
}

# The output dtypes a quantized lookup can return (computed in float32, then rounded once, as
# FBGEMM does for its fp16 / bf16 outputs).
OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class QuantTBEBag(nn.Module):
    """Pooled lookups over quantized tables: ``forward(indices, offsets, per_sample_weights=None)
    -> [B, sum of feature dims]`` (float32), features in ``feature_names`` order.

    ``offsets`` is feature-major with ``num_features * B + 1`` entries: exactly a
    KeyedJaggedTensor's ``offsets()`` (FBGEMM's TBE convention)::

        features [a, b], B = 2, bags a: [[3, 7], []], b: [[1], [2, 2]]
        indices [3, 7, 1, 2, 2]   offsets [0, 2, 2, 3, 5]

    MEAN features are divided by their bag length (empty bags give zeros) after a SUM lookup, the
    same way for both kernels. Buffers are not in ``state_dict`` (the collection exposes per-table
    views); ``torch.jit.save`` keeps them. Out-of-range ids raise.

    Args:
        specs: the tables.
        feature_table_map: table index of each feature.
        feature_names: one name per feature (for error messages).
        pooling_mean: per feature, MEAN (True) or SUM pooling.
        device: where the buffer lives.
        row_alignment: row padding in bytes; default FBGEMM's for the device (CPU 1, CUDA 16).
        tables: per table, quantized rows ``[rows, >= unpadded bytes]`` (zeros if omitted).
        use_fbgemm: None picks FBGEMM where it has a kernel for the device; False forces the
            torch kernel (identical numerics).
    """

    __constants__ = ["use_fbgemm", "has_mean"]
    __jit_ignored_attributes__ = ["specs", "feature_table_map"]

    def __init__(
        self,
        specs: Sequence[QuantTableSpec],
        feature_table_map: Sequence[int],
        feature_names: Sequence[str],
        pooling_mean: Sequence[bool],
        *,
        device: torch.device | str | None = None,
        row_alignment: int | None = None,
        tables: Sequence[Tensor] | None = None,
        use_fbgemm: bool | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device) if device is not None else torch.device("cpu")
        if not specs or len(feature_table_map) != len(feature_names) or len(
            feature_names
        ) != len(pooling_mean):
            raise ValueError(
                "QuantTBEBag: needs at least one table and one feature_names / pooling_mean "
                f"entry per feature; got {len(specs)} tables, feature_table_map "
                f"{list(feature_table_map)}, {len(feature_names)} names, {len(pooling_mean)} poolings"
            )
        why = quant_fbgemm_missing(device)
        if use_fbgemm and why is not None:
            raise ValueError(
                f"QuantTBEBag: FBGEMM requested but unavailable ({why}); use "
                "backend=KernelBackend.AUTO (use_fbgemm=None) for the torch kernel (same numerics)"
            )
        self.use_fbgemm = why is None if use_fbgemm is None else bool(use_fbgemm)
        self.specs = list(specs)
        self.feature_table_map = [int(t) for t in feature_table_map]
        self.row_alignment = row_alignment or default_row_alignment(device)
        feature_specs = [self.specs[t] for t in self.feature_table_map]
        starts = table_offsets(self.specs, self.row_alignment)

        self.feature_names = list(feature_names)
        self.dims = [s.dim for s in feature_specs]
        self.tys = [int(s.weight_type) for s in feature_specs]
        self.rows = [s.rows for s in feature_specs]
        self.offsets_list = [starts[t] for t in self.feature_table_map]
        self.row_strides = [row_bytes(s.dim, s.weight_type, self.row_alignment) for s in feature_specs]
        self.max_dims = max_dims(self.specs, self.feature_table_map)
        self.has_mean = any(pooling_mean)

        def buffer(name: str, value: Tensor) -> None:
            self.register_buffer(name, value.to(device), persistent=False)

        flat = pack_tables(self.specs, tables, self.row_alignment) if tables is not None else None
        buffer("weights", flat if flat is not None else torch.zeros(starts[-1], dtype=torch.uint8))
        placement = PLACEMENT_HOST if device.type == "cpu" else PLACEMENT_DEVICE
        num_features = len(feature_specs)
        buffer("weights_placements", torch.full((num_features,), placement, dtype=torch.int32))
        buffer("weights_offsets", torch.tensor(self.offsets_list, dtype=torch.int64))
        buffer("weights_tys", torch.tensor(self.tys, dtype=torch.uint8))
        buffer("D_offsets", torch.tensor(_cumsum(self.dims), dtype=torch.int32))
        buffer("rows_per_feature", torch.tensor(self.rows, dtype=torch.int64))
        buffer("bounds_check_warning", torch.zeros(1, dtype=torch.int64))
        column_feature = [f for f, d in enumerate(self.dims) for _ in range(d)]
        buffer("column_feature", torch.tensor(column_feature, dtype=torch.int64))
        buffer("column_is_mean", torch.tensor([bool(pooling_mean[f]) for f in column_feature]))

    def _on_device(self, indices: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
        """``indices`` and ``offsets`` on the buffer's device, one index dtype; offsets must be
        1-D with ``num_features * B + 1`` entries."""
        num_features = len(self.dims)
        if offsets.dim() != 1 or offsets.numel() < 1 or (offsets.numel() - 1) % num_features:
            raise ValueError(
                "quantized lookup: offsets must be 1-D with num_features * B + 1 entries ("
                + str(num_features) + " features); got " + str(offsets.numel()) + " entries"
            )
        device = self.weights.device
        indices = indices.to(device)
        return indices, offsets.to(device=device, dtype=indices.dtype)

    def forward(
        self, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None = None
    ) -> Tensor:
        num_features = len(self.dims)
        indices, offsets = self._on_device(indices, offsets)
        device = self.weights.device
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(device=device, dtype=torch.float32)
        if self.use_fbgemm:
            pooled = fbgemm_quant_pooled(
                self.weights, self.weights_placements, self.weights_offsets, self.weights_tys,
                self.D_offsets, self.rows_per_feature, self.bounds_check_warning, self.max_dims,
                self.row_alignment, indices, offsets, per_sample_weights,
            )
        else:
            pooled = torch_quant_lookup(
                self.weights, self.offsets_list, self.row_strides, self.dims, self.tys,
                self.rows, self.feature_names, indices, offsets, per_sample_weights, True,
            )
        if self.has_mean:
            batch = (offsets.numel() - 1) // num_features
            lengths = (offsets[1:] - offsets[:-1]).view(num_features, batch).t()
            per_column = lengths.clamp(min=1).to(pooled.dtype).index_select(1, self.column_feature)
            pooled = pooled / torch.where(self.column_is_mean, per_column, torch.ones_like(per_column))
        return pooled

    @torch.jit.unused
    def table_weights(self) -> list[Tensor]:
        """Per table, its ``[rows, unpadded row bytes]`` uint8 rows (views into the buffer)."""
        return table_views(self.weights, self.specs, self.row_alignment)

    @torch.jit.unused
    def table_bytes(self) -> list[int]:
        """Bytes of the buffer each table occupies (its rows, padding and alignment)."""
        starts = table_offsets(self.specs, self.row_alignment)
        return [b - a for a, b in zip(starts, starts[1:], strict=False)]


class QuantTableWeight(nn.Module):
    """Holds one table's quantized rows (a view into its kernel's buffer) as ``weight``."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)


def stored_rows(config: BaseEmbeddingConfig) -> int:
    """Rows a quantized table stores: ``num_embeddings_post_pruning`` when pruned."""
    pruned = config.num_embeddings_post_pruning
    return config.num_embeddings if pruned is None else pruned


def quant_weight_type(config: BaseEmbeddingConfig) -> WeightType:
    """The FBGEMM storage type for the table's ``data_type`` (ValueError if it has none)."""
    weight_type = QUANT_DATA_TYPES.get(config.data_type)
    if weight_type is None:
        supported = ", ".join(d.value for d in QUANT_DATA_TYPES)
        raise ValueError(
            f"table {config.name!r}: data_type {config.data_type} cannot be served quantized; "
            f"use one of {supported}"
        )
    return weight_type


def pooled_lookup(
    bag: QuantTBEBag, features: KeyedJaggedTensor, is_weighted: bool, module: str
) -> Tensor:
    """``bag`` over a KJT whose keys are ``bag.feature_names`` in order; bad ids name their
    feature (:class:`IdOutOfRangeError`), a malformed KJT names its key."""
    values, offsets = features.values(), features.offsets()
    weights = features.weights() if is_weighted else None
    covered = features.offset_per_key()[-1]
    if values.size(0) != covered:  # values past the last bag (allowed) belong to no bag
        values = values.narrow(0, 0, covered)
        weights = None if weights is None else weights.narrow(0, 0, covered)
    try:
        return bag(values, offsets, weights)
    except (RuntimeError, IndexError) as exc:
        message = describe_bad_ids(values, offsets, bag.feature_names, bag.rows)
        if message is not None:
            raise IdOutOfRangeError(f"{module}: {message}") from exc
        features.validate()
        raise


class QuantEmbeddingBagCollection(nn.Module, PooledCollectionTables):
    """EmbeddingBagCollection over quantized tables (TorchRec's ``quant.EmbeddingBagCollection``).

    Each table is stored as its config's ``data_type`` (FP32, FP16, INT8, INT4, INT2). Build one
    from a trained collection with :meth:`from_float` (or :func:`quantize_inference_model`);
    the constructor makes zero tables to fill with ``load_state_dict``.

    ``state_dict`` keys are the float collection's, ``embedding_bags.<table>.weight``, holding the
    quantized rows (``uint8 [rows, row bytes]``, fp16 scale and bias first in integer rows).
    The module cannot be moved after construction: use ``shard_quant_model(model, devices=[d])``.

    Args:
        tables: table configs with a quantized ``data_type``.
        is_weighted: features carry per-id weights.
        device: where the tables live.
        table_name_to_quantized_weights: optional initial rows per table (uint8, as in
            ``state_dict``).
        row_alignment: row padding in bytes (default FBGEMM's for the device).
        backend: AUTO uses FBGEMM where it has a kernel for the device; TORCH forces the torch
            kernel; FBGEMM refuses to build without FBGEMM.
        output_dtype: float32, float16 or bfloat16 output (computed in float32, rounded once).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        table_name_to_quantized_weights: Mapping[str, Tensor] | None = None,
        *,
        row_alignment: int | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
        output_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        module = "QuantEmbeddingBagCollection"
        check_unique_tables(tables, module)
        if not tables:
            raise ValueError(f"{module} needs at least one table")
        check_output_dtype(output_dtype, module)
        self._output_dtype = output_dtype
        self._embedding_bag_configs = list(tables)
        self._is_weighted = is_weighted
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._backend = backend
        specs = quant_table_specs(self._embedding_bag_configs)
        given = given_quant_rows(table_name_to_quantized_weights, self._embedding_bag_configs, module)
        self._feature_names = [f for c in self._embedding_bag_configs for f in c.feature_names]
        self._dims = [c.embedding_dim for c in self._embedding_bag_configs for _ in c.feature_names]
        self._tbe = QuantTBEBag(
            specs,
            table_of_features(self._embedding_bag_configs),
            self._feature_names,
            [c.pooling is PoolingType.MEAN for c in self._embedding_bag_configs for _ in c.feature_names],
            device=self._device,
            row_alignment=row_alignment,
            use_fbgemm=use_fbgemm_choice(backend),
        )
        self.embedding_bags = table_weight_modules(self._embedding_bag_configs, self._tbe, given)
        self._key_order = KeyOrder(self._feature_names, module)

    @classmethod
    def from_float(
        cls,
        module: EmbeddingBagCollection | FusedEmbeddingBagCollection,
        dtype: DataType | Mapping[str, DataType] | None = None,
        *,
        backend: KernelBackend = KernelBackend.AUTO,
        rows_post_pruning: Mapping[str, int] | None = None,
        output_dtype: torch.dtype | None = None,
        use_precomputed_fake_quant: bool = False,
    ) -> QuantEmbeddingBagCollection:
        """Quantize an EmbeddingBagCollection or FusedEmbeddingBagCollection (same device).

        ``dtype`` is one type for every table or ``{table name: type}`` covering every table.
        Without it the module's ``qconfig`` decides, as in TorchRec's
        ``torch.ao.quantization.quantize_dynamic`` recipe (weight observer dtype, a
        QuantConfig's ``per_table_weight_dtype``, activation dtype = output dtype); with
        neither, INT8. ``rows_post_pruning``: per table, keep only its first N rows (TorchRec's
        pruning: ids must already be remapped into ``[0, N)``); the config records N in
        ``num_embeddings_post_pruning``. Default: the module's ``set_pruning_data`` mark.
        """
        del use_precomputed_fake_quant  # torch's quantize_dynamic passes it; nothing to precompute
        configs = module.embedding_bag_configs()
        per_table, qconfig_output = qconfig_dtypes(module, [c.name for c in configs], dtype)
        if rows_post_pruning is None:
            marked = getattr(module, PRUNING_ATTR, None) or {}
            rows_post_pruning = {k: v for k, v in marked.items() if k in per_table}
        pruned = dict(rows_post_pruning)
        known = {c.name: c.num_embeddings for c in module.embedding_bag_configs()}
        for name, n in pruned.items():
            if name not in known:
                raise ValueError(f"from_float: rows_post_pruning names unknown table {name!r}")
            if not 0 < n <= known[name]:
                raise ValueError(
                    f"from_float: table {name!r} keeps {n} rows after pruning; it must be in "
                    f"[1, {known[name]}]"
                )
        device = module.device
        if device.type == "meta":
            raise ValueError("from_float: the collection is on the meta device (no weights yet)")
        quant_configs, tables = [], {}
        for config in configs:
            quant = dataclasses.replace(
                config,
                data_type=per_table[config.name],
                num_embeddings_post_pruning=pruned.get(
                    config.name, config.num_embeddings_post_pruning
                ),
            )
            weight = module.embedding_bags[config.name].weight[: stored_rows(quant)]
            tables[config.name] = quantize_rows(weight.cpu(), quant_weight_type(quant), config.name)
            quant_configs.append(quant)
        return cls(
            quant_configs, module.is_weighted(), device, tables, backend=backend,
            output_dtype=output_dtype or qconfig_output or torch.float32,
        )

    # ---- public API ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tbe(self) -> QuantTBEBag:
        """The tensor-level kernel (what an exporter scripts); features in declaration order."""
        return self._tbe

    @property
    def tbes(self) -> list[QuantTBEBag]:
        """The kernel modules (TorchRec's ``tbes``): one here, whatever the tables' pooling and
        types (TorchRec groups tables into one FBGEMM module per pooling type)."""
        return [self._tbe]

    def output_dtype(self) -> torch.dtype:
        return self._output_dtype

    def kernel_backend(self) -> KernelBackend:
        return KernelBackend.FBGEMM if self._tbe.use_fbgemm else KernelBackend.TORCH

    def quantized_weights(self) -> dict[str, Tensor]:
        """``{table: uint8 rows}`` (views; the same tensors as in ``state_dict``)."""
        return {name: bag.weight for name, bag in self.embedding_bags.items()}

    def table_bytes(self) -> dict[str, int]:
        """Bytes each table takes in its kernel buffer."""
        return dict(zip((c.name for c in self._embedding_bag_configs), self._tbe.table_bytes(), strict=True))

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        check_features(
            features, self._feature_names, "QuantEmbeddingBagCollection", self._is_weighted
        )
        pooled = pooled_lookup(
            self._tbe, self._key_order.apply(features), self._is_weighted,
            "QuantEmbeddingBagCollection",
        )
        if self._output_dtype != torch.float32:
            pooled = pooled.to(self._output_dtype)
        return KeyedTensor(keys=self._feature_names, length_per_key=self._dims, values=pooled)

    # ---- internals ----------------------------------------------------------------------------
    def _apply(self, fn: Any, recurse: bool = True) -> QuantEmbeddingBagCollection:
        if fn(torch.zeros(1, device=self._device)).device != self._device:
            raise ValueError(
                "QuantEmbeddingBagCollection cannot be moved after construction (its rows live "
                "in one kernel buffer laid out for its device); place it with "
                "shard_quant_model(model, devices=[device]) or build it with device=..."
            )
        return super()._apply(fn, recurse)


class QuantFeatureProcessedEmbeddingBagCollection(QuantEmbeddingBagCollection):
    """A quantized EmbeddingBagCollection behind feature processors (TorchRec's
    ``quant.FeatureProcessedEmbeddingBagCollection``): ``forward`` runs the (float) processors
    on the KJT, which sets the per-id weights, then the weighted quantized lookup.

    Build it with :meth:`from_float` from a ``FeatureProcessedEmbeddingBagCollection``; the
    processors are shared with it, not copied. Other arguments as
    :class:`QuantEmbeddingBagCollection`; ``feature_processor`` (a
    ``FeatureProcessorsCollection``) is required.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = True,
        device: torch.device | str | None = None,
        table_name_to_quantized_weights: Mapping[str, Tensor] | None = None,
        *,
        feature_processor: nn.Module | None = None,
        row_alignment: int | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
        output_dtype: torch.dtype = torch.float32,
    ) -> None:
        if feature_processor is None:
            raise ValueError(
                "QuantFeatureProcessedEmbeddingBagCollection needs feature_processor (without "
                "one, use QuantEmbeddingBagCollection)"
            )
        super().__init__(
            tables, is_weighted, device, table_name_to_quantized_weights,
            row_alignment=row_alignment, backend=backend, output_dtype=output_dtype,
        )
        self.feature_processor = feature_processor

    @classmethod
    def from_float(
        cls,
        module: nn.Module,
        dtype: DataType | Mapping[str, DataType] | None = None,
        *,
        backend: KernelBackend = KernelBackend.AUTO,
        rows_post_pruning: Mapping[str, int] | None = None,
        output_dtype: torch.dtype | None = None,
        use_precomputed_fake_quant: bool = False,
    ) -> QuantFeatureProcessedEmbeddingBagCollection:
        """Quantize a ``FeatureProcessedEmbeddingBagCollection``: its collection's tables as
        :meth:`QuantEmbeddingBagCollection.from_float` (the FP module's ``qconfig`` and pruning
        mark decide unless given), its processors kept as they are."""
        processors, ebc = module.split()
        names = [c.name for c in ebc.embedding_bag_configs()]
        per_table, qconfig_output = qconfig_dtypes(module, names, dtype)
        if rows_post_pruning is None:
            marked = getattr(module, PRUNING_ATTR, None) or getattr(ebc, PRUNING_ATTR, None) or {}
            rows_post_pruning = {k: v for k, v in marked.items() if k in per_table}
        inner = QuantEmbeddingBagCollection.from_float(
            ebc, per_table, backend=backend, rows_post_pruning=rows_post_pruning,
            output_dtype=output_dtype or qconfig_output,
        )
        return cls(
            inner.embedding_bag_configs(), inner.is_weighted(), inner.device,
            inner.quantized_weights(), feature_processor=processors, backend=backend,
            output_dtype=inner.output_dtype(),
        )

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return super().forward(self.feature_processor(features))


def qconfig_dtypes(
    module: nn.Module,
    table_names: Sequence[str],
    dtype: DataType | Mapping[str, DataType] | None,
) -> tuple[dict[str, DataType], torch.dtype | None]:
    """Per table, its quantized DataType, and the output dtype a qconfig asks for (or None).

    ``dtype`` wins when given; otherwise the module's ``qconfig`` (TorchRec's recipe: the weight
    observer's dtype, a QuantConfig's ``per_table_weight_dtype`` per table); otherwise INT8.
    """
    output = None
    if dtype is None:
        qconfig = getattr(module, "qconfig", None)
        default: DataType = DataType.INT8
        per_table_torch: Mapping[str, torch.dtype] = {}
        if qconfig is not None:
            default = resolve_quant_dtype(qconfig.weight().dtype)
            output = qconfig.activation().dtype
            per_table_torch = getattr(qconfig, "per_table_weight_dtype", None) or {}
        chosen = {
            name: resolve_quant_dtype(per_table_torch[name]) if name in per_table_torch
            else default
            for name in table_names
        }
    elif isinstance(dtype, Mapping):
        missing = [n for n in table_names if n not in dtype]
        if missing:
            raise ValueError(f"from_float: dtype mapping has no entry for tables {missing}")
        chosen = {n: dtype[n] for n in table_names}
    else:
        chosen = dict.fromkeys(table_names, dtype)
    if output is not None and output not in OUTPUT_DTYPES:
        raise ValueError(
            f"from_float: qconfig activation dtype {output} is not an output dtype this "
            f"module supports ({[str(d) for d in OUTPUT_DTYPES]})"
        )
    return chosen, output


def check_output_dtype(output_dtype: torch.dtype, module: str) -> None:
    """Refuse an output dtype a quantized lookup cannot return (``module`` names the caller)."""
    if output_dtype not in OUTPUT_DTYPES:
        raise ValueError(
            f"{module}: output_dtype {output_dtype} is not supported; use one of "
            f"{[str(d) for d in OUTPUT_DTYPES]}"
        )


def quant_table_specs(configs: Sequence[BaseEmbeddingConfig]) -> list[QuantTableSpec]:
    """Each table's layout in the quantized kernel: its stored rows, dim and weight type."""
    return [
        QuantTableSpec(c.name, stored_rows(c), c.embedding_dim, quant_weight_type(c))
        for c in configs
    ]


def table_of_features(configs: Sequence[BaseEmbeddingConfig]) -> list[int]:
    """The kernel's ``feature_table_map``: each feature's table index, features in table order."""
    return [t for t, c in enumerate(configs) for _ in c.feature_names]


def use_fbgemm_choice(backend: KernelBackend) -> bool | None:
    """The quantized kernels' ``use_fbgemm`` for a backend: AUTO decides by the device (None),
    FBGEMM insists (True), TORCH refuses (False)."""
    return {KernelBackend.AUTO: None, KernelBackend.FBGEMM: True}.get(backend, False)


def given_quant_rows(
    table_name_to_quantized_weights: Mapping[str, Tensor] | None,
    configs: Sequence[BaseEmbeddingConfig],
    module: str,
) -> dict[str, Tensor]:
    """The constructor's initial rows by table name; a name that is no table's is refused."""
    given = dict(table_name_to_quantized_weights or {})
    unknown = sorted(set(given) - {c.name for c in configs})
    if unknown:
        raise ValueError(f"{module}: no tables named {unknown}")
    return given


def table_weight_modules(
    configs: Sequence[BaseEmbeddingConfig], tbe: QuantTBEBag, given: Mapping[str, Tensor]
) -> nn.ModuleDict:
    """Per table (by name), a :class:`QuantTableWeight` over its rows in ``tbe``'s buffer,
    filled from ``given`` where it names the table."""
    weights = nn.ModuleDict()
    for config, view in zip(configs, tbe.table_weights(), strict=True):
        if config.name in given:
            copy_quant_rows(config.name, view, given[config.name])
        weights[config.name] = QuantTableWeight(view)
    return weights


def copy_quant_rows(name: str, view: Tensor, rows: Tensor) -> None:
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[0] != view.shape[0] or (
        rows.shape[1] < view.shape[1]
    ):
        raise ValueError(
            f"table {name!r}: quantized weights must be uint8 [{view.shape[0]}, "
            f">= {view.shape[1]}], got {rows.dtype} {list(rows.shape)}"
        )
    view.copy_(rows[:, : view.shape[1]])


def _cumsum(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + int(s))
    return out
