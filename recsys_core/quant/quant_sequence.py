"""Quantized sequence (unpooled) embeddings for inference: TorchRec's
``torchrec.quant.EmbeddingCollection``.

:class:`QuantTBESequence` is the kernel module: the tables in one flat ``uint8`` buffer in
FBGEMM's int-n-bit layout (the layout of :class:`QuantTBEBag`), one lookup that returns every
id's row dequantized, unpooled (FBGEMM's ``PoolingMode.NONE``). :class:`QuantEmbeddingCollection`
wraps it with the EmbeddingCollection contract::

    tables  t1 (INT8, 100 x 8, features ["a"]), t2 (INT4, 10 x 8, features ["b"])
    input   KJT "a": [[3, 7], []]   "b": [[1], [2, 2]]
    output  {"a": JaggedTensor(values = dequantized t1 rows 3, 7; lengths [2, 0]),
             "b": JaggedTensor(values = dequantized t2 rows 1, 2, 2; lengths [1, 2])}

Every table has one ``embedding_dim`` (as in the float EmbeddingCollection).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from recsys_core.kernels.config import KernelBackend
from recsys_core.kernels.quant_tbe import (
    QuantTableSpec,
    fbgemm_quant_pooled,
    quantize_rows,
    torch_quant_lookup,
)
from recsys_core.kernels.tbe import IdOutOfRangeError, describe_bad_ids
from recsys_core.modules.collection_tables import SequenceCollectionTables
from recsys_core.modules.embedding_collection import EmbeddingCollection, check_equal_dims
from recsys_core.modules.embedding_configs import (
    DataType,
    EmbeddingConfig,
    check_table_names,
    get_embedding_names_by_table,
)
from recsys_core.modules.lookup import check_features
from recsys_core.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from recsys_core.modules.mc_modules import ManagedCollisionCollection
from recsys_core.quant.quant_embedding import (
    QuantTBEBag,
    check_output_dtype,
    given_quant_rows,
    qconfig_dtypes,
    quant_table_specs,
    quant_weight_type,
    stored_rows,
    table_of_features,
    table_weight_modules,
    use_fbgemm_choice,
)
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor
from recsys_core.sparse.key_order import KeyOrder

_POOLING_NONE = 2  # FBGEMM's PoolingMode.NONE


class QuantTBESequence(QuantTBEBag):
    """Unpooled lookups over quantized tables of one dim ``D``: ``forward(indices, offsets) ->
    [len(indices), D]`` float32 rows, in ``indices`` order.

    ``offsets`` is feature-major with ``num_features * B + 1`` entries (a KJT's ``offsets()``);
    ``indices`` must end at ``offsets[-1]``. Out-of-range ids raise. Arguments as
    :class:`QuantTBEBag`, without pooling.
    """

    def __init__(
        self,
        specs: Sequence[QuantTableSpec],
        feature_table_map: Sequence[int],
        feature_names: Sequence[str],
        *,
        device: torch.device | str | None = None,
        row_alignment: int | None = None,
        tables: Sequence[Tensor] | None = None,
        use_fbgemm: bool | None = None,
    ) -> None:
        dims = {s.dim for s in specs}
        if len(dims) > 1:
            raise ValueError(
                f"QuantTBESequence: every table needs the same dim for unpooled lookups; got "
                f"{sorted(dims)}"
            )
        super().__init__(
            specs, feature_table_map, feature_names, [False] * len(feature_names),
            device=device, row_alignment=row_alignment, tables=tables, use_fbgemm=use_fbgemm,
        )

    def forward(
        self, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None = None
    ) -> Tensor:
        indices, offsets = self._on_device(indices, offsets)
        if self.use_fbgemm:
            return fbgemm_quant_pooled(
                self.weights, self.weights_placements, self.weights_offsets, self.weights_tys,
                self.D_offsets, self.rows_per_feature, self.bounds_check_warning, self.max_dims,
                self.row_alignment, indices, offsets, None, _POOLING_NONE,
            )
        return torch_quant_lookup(
            self.weights, self.offsets_list, self.row_strides, self.dims, self.tys,
            self.rows, self.feature_names, indices, offsets, None, False,
        )


class QuantEmbeddingCollection(nn.Module, SequenceCollectionTables):
    """EmbeddingCollection over quantized tables (TorchRec's ``quant.EmbeddingCollection``):
    ``KeyedJaggedTensor -> {embedding name: JaggedTensor of [N, dim] rows}``.

    Each table is stored as its config's ``data_type`` (FP32, FP16, INT8, INT4, INT2). Build one
    from a trained EmbeddingCollection with :meth:`from_float` (or ``quantize_inference_model``
    / ``torch.ao.quantization.quantize_dynamic`` with this class in the mapping, TorchRec's
    recipe); the constructor makes zero tables to fill with ``load_state_dict``. Output names
    are the float collection's (``<feature>@<table>`` for a feature in several tables); with
    ``need_indices`` each JaggedTensor's weights are the looked-up ids.

    ``state_dict`` keys are the float collection's, ``embeddings.<table>.weight``, holding the
    quantized rows (``uint8 [rows, row bytes]``, fp16 scale and bias first in integer rows).

    Args:
        tables: EmbeddingConfigs with a quantized ``data_type``, one ``embedding_dim``.
        device: where the tables live (cannot be moved after construction).
        need_indices: put the ids in each output's weights.
        output_dtype: float32, float16 or bfloat16 rows (computed in float32, rounded once).
        table_name_to_quantized_weights: optional initial uint8 rows per table (as in
            ``state_dict``).
        register_tbes: TorchRec's flag; the kernel module is always a registered submodule here.
        quant_state_dict_split_scale_bias: TorchRec's split scale/bias state-dict layout; not
            supported (refused).
        row_alignment: row padding in bytes (default FBGEMM's for the device).
        cache_features_order: accepted (the input permutation is always cached per key order).
        backend: AUTO uses FBGEMM where it has a kernel for the device; TORCH forces the torch
            kernel (same numerics).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        output_dtype: torch.dtype = torch.float,
        table_name_to_quantized_weights: Mapping[str, Tensor] | None = None,
        register_tbes: bool = False,
        quant_state_dict_split_scale_bias: bool = False,
        row_alignment: int | None = None,
        cache_features_order: bool = False,
        *,
        backend: KernelBackend = KernelBackend.AUTO,
    ) -> None:
        super().__init__()
        module = "QuantEmbeddingCollection"
        if not tables:
            raise ValueError(f"{module} needs at least one table")
        check_table_names(tables, module)
        self._embedding_dim = check_equal_dims(tables, module)
        check_output_dtype(output_dtype, module)
        if quant_state_dict_split_scale_bias:
            raise ValueError(
                f"{module}: quant_state_dict_split_scale_bias=True (TorchRec's separate "
                "weight_qscale / weight_qbias state-dict entries) is not supported; each "
                "table's state_dict row keeps its fp16 scale and bias in its first 4 bytes"
            )
        self._embedding_configs = list(tables)
        self._need_indices = need_indices
        self._output_dtype = output_dtype
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._backend = backend
        self.register_tbes = register_tbes
        self._cache_features_order = cache_features_order
        given = given_quant_rows(table_name_to_quantized_weights, self._embedding_configs, module)
        for name, rows in given.items():
            if isinstance(rows, tuple):
                raise ValueError(
                    f"{module}: table {name!r}: give the quantized rows as one uint8 tensor "
                    "(fp16 scale and bias in the first 4 bytes of integer rows, as in "
                    "state_dict), not TorchRec's (weight, scale_bias) pair"
                )
        self._embedding_names_by_table = get_embedding_names_by_table(self._embedding_configs)
        self._feature_names = [f for c in self._embedding_configs for f in c.feature_names]
        self._embedding_names = [n for names in self._embedding_names_by_table for n in names]
        self._tbe = QuantTBESequence(
            quant_table_specs(self._embedding_configs),
            table_of_features(self._embedding_configs),
            self._embedding_names,
            device=self._device,
            row_alignment=row_alignment,
            use_fbgemm=use_fbgemm_choice(backend),
        )
        self.embeddings = table_weight_modules(self._embedding_configs, self._tbe, given)
        self._key_order = KeyOrder(self._feature_names, module)

    @classmethod
    def from_float(
        cls,
        module: EmbeddingCollection,
        use_precomputed_fake_quant: bool = False,
        *,
        dtype: DataType | Mapping[str, DataType] | None = None,
        output_dtype: torch.dtype | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
    ) -> QuantEmbeddingCollection:
        """Quantize a float EmbeddingCollection (same device).

        ``dtype``: one type for every table or ``{table: type}`` covering every table. Without
        it, the module's ``qconfig`` decides as in TorchRec (``qconfig.weight().dtype``, e.g.
        ``torch.qint8`` -> INT8, ``torch.quint4x2`` -> INT4; a ``QuantConfig``'s
        ``per_table_weight_dtype`` per table; ``qconfig.activation().dtype`` the output dtype);
        with neither, INT8.
        """
        del use_precomputed_fake_quant  # torch's quantize_dynamic passes it; nothing to precompute
        configs = module.embedding_configs()
        per_table, qconfig_output = qconfig_dtypes(module, [c.name for c in configs], dtype)
        if module.device.type == "meta":
            raise ValueError("from_float: the collection is on the meta device (no weights yet)")
        quant_configs, rows = [], {}
        for config in configs:
            quant = dataclasses.replace(config, data_type=per_table[config.name])
            weight = module.embeddings[config.name].weight.detach()[: stored_rows(quant)]
            rows[config.name] = quantize_rows(
                weight.float().cpu(), quant_weight_type(quant), config.name
            )
            quant_configs.append(quant)
        return cls(
            quant_configs,
            module.device,
            need_indices=module.need_indices(),
            output_dtype=output_dtype or qconfig_output or torch.float,
            table_name_to_quantized_weights=rows,
            backend=backend,
        )

    # ---- public API ---------------------------------------------------------------------------
    def output_dtype(self) -> torch.dtype:
        return self._output_dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tbes(self) -> list[QuantTBESequence]:
        """The kernel modules: one here, whatever the tables' types (TorchRec makes one FBGEMM
        module per data type)."""
        return [self._tbe]

    def kernel_backend(self) -> KernelBackend:
        return KernelBackend.FBGEMM if self._tbe.use_fbgemm else KernelBackend.TORCH

    def quantized_weights(self) -> dict[str, Tensor]:
        """``{table: uint8 rows}`` (views; the same tensors as in ``state_dict``)."""
        return {name: table.weight for name, table in self.embeddings.items()}

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        check_features(features, self._feature_names, "QuantEmbeddingCollection", False)
        out = sequence_lookup(
            self._tbe, self._key_order.apply(features), self._need_indices,
            "QuantEmbeddingCollection", features.device(),
        )
        if self._output_dtype != torch.float32:
            out = {k: cast_values(jt, self._output_dtype) for k, jt in out.items()}
        return out

    # ---- internals ----------------------------------------------------------------------------
    def _apply(self, fn: Any, recurse: bool = True) -> QuantEmbeddingCollection:
        if fn(torch.zeros(1, device=self._device)).device != self._device:
            raise ValueError(
                "QuantEmbeddingCollection cannot be moved after construction (its rows live in "
                "one kernel buffer laid out for its device); build it with device=..."
            )
        return super()._apply(fn, recurse)


def sequence_lookup(
    lookup: QuantTBESequence,
    features: KeyedJaggedTensor,
    need_indices: bool,
    module: str,
    out_device: torch.device,
) -> dict[str, JaggedTensor]:
    """``lookup`` over a KJT whose keys are its features in order: ``{embedding name:
    JaggedTensor}`` on ``out_device``; bad ids name their feature."""
    values, offsets = features.values(), features.offsets()
    covered = features.offset_per_key()[-1]
    if values.size(0) != covered:  # values past the last bag belong to no bag
        values = values.narrow(0, 0, covered)
    try:
        rows = lookup(values, offsets).to(out_device)
    except (RuntimeError, IndexError) as exc:
        message = describe_bad_ids(values, offsets, lookup.feature_names, lookup.rows)
        if message is not None:
            raise IdOutOfRangeError(f"{module}: {message}") from exc
        raise
    lengths = features.lengths().view(len(lookup.feature_names), -1)
    out: dict[str, JaggedTensor] = {}
    start = 0
    for k, (name, count) in enumerate(
        zip(lookup.feature_names, features.length_per_key(), strict=True)
    ):
        out[name] = JaggedTensor(
            values=rows[start : start + count],
            lengths=lengths[k],
            weights=values[start : start + count] if need_indices else None,
        )
        start += count
    return out


def cast_values(jt: JaggedTensor, dtype: torch.dtype) -> JaggedTensor:
    """``jt`` with its values in ``dtype`` (lengths and weights kept)."""
    return JaggedTensor(values=jt.values().to(dtype), lengths=jt.lengths(), weights=jt.weights_or_none())


class QuantManagedCollisionEmbeddingCollection(QuantEmbeddingCollection):
    """A :class:`QuantEmbeddingCollection` behind a managed collision collection (TorchRec's
    ``quant.QuantManagedCollisionEmbeddingCollection``): raw ids are remapped by the collection's
    frozen mapping (its modules in inference mode: no profiling, no eviction), then looked up.

    ``forward(features)`` returns ``(embeddings, remapped KJT)`` (TorchRec's pair; the remapped
    features are always returned). The managed collision collection's table configs must describe
    the same tables (name, rows, dim, features); their ``data_type`` is set to the quantized one.
    Other arguments as :class:`QuantEmbeddingCollection`.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        output_dtype: torch.dtype = torch.float,
        table_name_to_quantized_weights: Mapping[str, Tensor] | None = None,
        register_tbes: bool = False,
        quant_state_dict_split_scale_bias: bool = False,
        row_alignment: int | None = None,
        managed_collision_collection: ManagedCollisionCollection | None = None,
        return_remapped_features: bool = False,
        cache_features_order: bool = False,
        *,
        backend: KernelBackend = KernelBackend.AUTO,
    ) -> None:
        super().__init__(
            tables, device, need_indices, output_dtype, table_name_to_quantized_weights,
            register_tbes, quant_state_dict_split_scale_bias, row_alignment,
            cache_features_order, backend=backend,
        )
        if managed_collision_collection is None:
            raise ValueError(
                "QuantManagedCollisionEmbeddingCollection needs managed_collision_collection "
                "(without one, use QuantEmbeddingCollection)"
            )
        ours = {c.name: c for c in self.embedding_configs()}
        theirs = list(managed_collision_collection.embedding_configs())

        def shape(c: Any) -> tuple[Any, ...]:
            return (c.name, c.num_embeddings, c.embedding_dim, list(c.feature_names))

        if [shape(c) for c in theirs] != [shape(c) for c in ours.values()]:
            raise ValueError(
                "QuantManagedCollisionEmbeddingCollection: the managed collision collection's "
                f"tables {[shape(c) for c in theirs]} differ from the embedding collection's "
                f"{[shape(c) for c in ours.values()]}"
            )
        managed_collision_collection._embedding_configs = [
            dataclasses.replace(c, data_type=ours[c.name].data_type) for c in theirs
        ]
        for mc_module in managed_collision_collection._managed_collision_modules.values():
            mc_module.reset_inference_mode()
        self._managed_collision_collection = managed_collision_collection
        self._return_remapped_features = return_remapped_features

    def forward(  # type: ignore[override]
        self, features: KeyedJaggedTensor
    ) -> tuple[dict[str, JaggedTensor], KeyedJaggedTensor]:
        remapped = self._managed_collision_collection(features)
        return super().forward(remapped), remapped

    @classmethod
    def from_float(  # type: ignore[override]
        cls,
        module: ManagedCollisionEmbeddingCollection,
        return_remapped_features: bool | None = None,
        *,
        dtype: DataType | Mapping[str, DataType] | None = None,
        output_dtype: torch.dtype | None = None,
        backend: KernelBackend = KernelBackend.AUTO,
    ) -> QuantManagedCollisionEmbeddingCollection:
        """Quantize a ManagedCollisionEmbeddingCollection: its EmbeddingCollection's tables as
        :meth:`QuantEmbeddingCollection.from_float` (the module's ``qconfig`` decides unless
        ``dtype`` is given; an inner collection already quantized, as ``quantize_dynamic``
        leaves it, is taken as it is), its managed collision collection shared."""
        inner = module._embedding_module
        if not isinstance(inner, QuantEmbeddingCollection):
            per_table, qconfig_output = qconfig_dtypes(
                module, [c.name for c in inner.embedding_configs()], dtype
            )
            inner = QuantEmbeddingCollection.from_float(
                inner, dtype=per_table, output_dtype=output_dtype or qconfig_output,
                backend=backend,
            )
        return cls(
            inner.embedding_configs(),
            inner.device,
            need_indices=inner.need_indices(),
            output_dtype=output_dtype or inner.output_dtype(),
            table_name_to_quantized_weights={
                name: rows.clone() for name, rows in inner.quantized_weights().items()
            },
            managed_collision_collection=module._managed_collision_collection,
            return_remapped_features=(
                module._return_remapped_features
                if return_remapped_features is None
                else return_remapped_features
            ),
            backend=backend,
        )


__all__ = [
    "QuantEmbeddingCollection",
    "QuantManagedCollisionEmbeddingCollection",
    "QuantTBESequence",
]
