"""TorchRec's ``torchrec.inference.modules``: the serving helpers with TorchRec's signatures.

They delegate to this library's quantization (:mod:`recsys_core.inference.quantize`) and
table placement (:mod:`recsys_core.quant.sharding`). Differences from TorchRec, by design:

- quantized collections are :class:`QuantEmbeddingBagCollection` (all tables in one int-n-bit
  buffer, FBGEMM's or the torch kernel), not FBGEMM ``IntNBitTableBatchedEmbeddingBagsCodegen``
  modules; ``get_table_to_weights_from_tbe`` returns each table's fused rows (uint8, scale and
  bias included) and ``assign_weights_to_tbe`` copies them back;
- ``shard_quant_model`` copies the quantized rows onto their devices (TorchRec leaves them
  uninitialized on ``sharding_device`` for a later ``assign_weights_to_tbe``);
- a quantized collection holds all its tables in one kernel module (TorchRec groups tables
  into one FBGEMM module per data type and pooling).
"""

import abc
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from recsys_core.distributed.fused_params import (
    FUSED_PARAM_BOUNDS_CHECK_MODE,
    FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP,
    FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS,
    FUSED_PARAM_REGISTER_TBE_BOOL,
)
from recsys_core.distributed.quant_embedding import QuantEmbeddingCollectionSharder
from recsys_core.distributed.quant_embeddingbag import (
    QuantEmbeddingBagCollectionSharder,
    QuantFeatureProcessedEmbeddingBagCollectionSharder,
)
from recsys_core.distributed.types import ModuleSharder
from recsys_core.inference import quantize as _quantize
from recsys_core.modules.embedding_collection import EmbeddingCollection
from recsys_core.modules.embedding_configs import QuantConfig
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from recsys_core.plan.params import BoundsCheckMode
from recsys_core.plan.types import ShardingPlan
from recsys_core.quant.embedding_modules import (
    MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT,
    quantize_meta_collections,
)
from recsys_core.quant.quant_embedding import QuantEmbeddingBagCollection
from recsys_core.quant.quant_sequence import QuantEmbeddingCollection
from recsys_core.quant.sharding import (
    ShardedQuantEmbeddingBagCollection,
    ShardedQuantEmbeddingCollection,
    quant_table_wise_plan,
)
from recsys_core.quant.sharding import shard_quant_model as _shard_quant_model

DEFAULT_FUSED_PARAMS: dict[str, Any] = {
    FUSED_PARAM_REGISTER_TBE_BOOL: True,
    FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: True,
    FUSED_PARAM_BOUNDS_CHECK_MODE: BoundsCheckMode.NONE,
    FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP: False,
}

# Each sharder copies the dict, so editing one sharder's fused_params changes no other.
DEFAULT_SHARDERS: list[ModuleSharder[Any]] = [
    QuantEmbeddingBagCollectionSharder(fused_params=DEFAULT_FUSED_PARAMS),
    QuantEmbeddingCollectionSharder(fused_params=DEFAULT_FUSED_PARAMS),
    QuantFeatureProcessedEmbeddingBagCollectionSharder(
        fused_params=DEFAULT_FUSED_PARAMS
    ),
]

DEFAULT_QUANT_MAPPING: dict[str, type[nn.Module]] = {
    torch.typename(EmbeddingBagCollection): QuantEmbeddingBagCollection,
    torch.typename(EmbeddingCollection): QuantEmbeddingCollection,
}

DEFAULT_QUANTIZATION_DTYPE: torch.dtype = torch.int8


@dataclass
class QualNameMetadata:
    need_preproc: bool


@dataclass
class BatchingMetadata:
    """How a serving batcher handles one input (kept in sync with TorchRec's C++ side)."""

    type: str
    device: str
    pinned: list[str]


class PredictFactory(abc.ABC):
    """What a model author provides to package a model for serving."""

    @abc.abstractmethod
    def create_predict_module(self) -> nn.Module:
        """The module to serve (weights-independent part, e.g. quantized and sharded)."""

    @abc.abstractmethod
    def batching_metadata(self) -> dict[str, BatchingMetadata]:
        """Per input name, how to batch it."""

    def batching_metadata_json(self) -> str:
        return json.dumps({k: asdict(v) for k, v in self.batching_metadata().items()})

    @abc.abstractmethod
    def result_metadata(self) -> str:
        """The result type's name (e.g. ``"dict_of_tensor"``)."""

    @abc.abstractmethod
    def run_weights_independent_tranformations(self, predict_module: nn.Module) -> nn.Module:
        """Transformations before weights are loaded."""

    @abc.abstractmethod
    def run_weights_dependent_transformations(self, predict_module: nn.Module) -> nn.Module:
        """Transformations after weights are loaded."""

    def qualname_metadata(self) -> dict[str, QualNameMetadata]:
        return {}

    def qualname_metadata_json(self) -> str:
        return json.dumps({k: asdict(v) for k, v in self.qualname_metadata().items()})

    def model_inputs_data(self) -> dict[str, Any]:
        return {}


class PredictModule(nn.Module):
    """Serving wrapper: ``forward(batch: Dict[str, Tensor])`` runs :meth:`predict_forward`
    under ``torch.inference_mode``; ``state_dict`` is the wrapped module's (no prefix)."""

    def __init__(self, module: nn.Module, device: str | None = None) -> None:
        super().__init__()
        self._module: nn.Module = module
        self._device: torch.device | None = torch.device(device) if device else None
        self._module.eval()

    @property
    def predict_module(self) -> nn.Module:
        return self._module

    @abc.abstractmethod
    def predict_forward(self, batch: dict[str, torch.Tensor]) -> Any:
        pass

    def forward(self, batch: dict[str, torch.Tensor]) -> Any:
        if self._device is None:
            # TorchRec assumes CUDA here; fall back to the host where there is none
            self._device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        with torch.inference_mode():
            return self.predict_forward(batch)

    def state_dict(  # type: ignore[override]
        self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        return self._module.state_dict(destination, prefix, keep_vars)


def set_pruning_data(
    model: nn.Module,
    tables_to_rows_post_pruning: dict[str, int],
    module_types: list[type[nn.Module]] | None = None,
) -> nn.Module:
    """Mark every collection of ``module_types`` (default EBC and FP-EBC): when quantized,
    table ``t`` keeps only its first ``tables_to_rows_post_pruning[t]`` rows (ids must then be
    remapped into that range, as in TorchRec)."""
    types = module_types or [EmbeddingBagCollection, FeatureProcessedEmbeddingBagCollection]
    for module in model.modules():
        if type(module) in types:
            setattr(
                module,
                MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT,
                tables_to_rows_post_pruning,
            )
    return model


def quantize_inference_model(
    model: nn.Module,
    quantization_mapping: dict[str, type[nn.Module]] | None = None,
    per_table_weight_dtype: dict[str, torch.dtype] | None = None,
    fp_weight_dtype: torch.dtype = DEFAULT_QUANTIZATION_DTYPE,
    quantization_dtype: torch.dtype = DEFAULT_QUANTIZATION_DTYPE,
    output_dtype: torch.dtype = torch.float,
) -> nn.Module:
    """TorchRec's signature: every EmbeddingBagCollection of ``model`` becomes a quantized one
    (``quantization_dtype``, ``per_table_weight_dtype`` per table; ``torch.quint4x2`` is INT4).

    Collections on the meta device (a model built to be loaded later) become zero tables on the
    host, to be filled by ``load_state_dict``. A ``FeatureProcessedEmbeddingBagCollection``
    keeps its (float) feature processors and gets a quantized inner collection; its processor
    weights stay float (``fp_weight_dtype`` is not applied). ``output_dtype`` must be float32.
    """
    if quantization_mapping not in (None, DEFAULT_QUANT_MAPPING):
        raise ValueError(
            "quantize_inference_model: custom quantization_mapping is not supported; "
            f"the supported mapping is {DEFAULT_QUANT_MAPPING}"
        )
    if output_dtype != torch.float:
        raise ValueError(
            f"quantize_inference_model: output_dtype {output_dtype} is not supported (the "
            "quantized lookups return float32)"
        )
    model = quantize_meta_collections(model, quantization_dtype, per_table_weight_dtype)
    remaining = {
        c.name
        for m in model.modules()
        if isinstance(m, EmbeddingBagCollection | EmbeddingCollection)
        for c in (
            m.embedding_bag_configs() if isinstance(m, EmbeddingBagCollection)
            else m.embedding_configs()
        )
    }
    per_table = {k: v for k, v in (per_table_weight_dtype or {}).items() if k in remaining}
    return _quantize.quantize_inference_model(model, quantization_dtype, table_dtypes=per_table)


def quantize_embeddings(
    module: nn.Module,
    dtype: torch.dtype,
    inplace: bool,
    additional_qconfig_spec_keys: list[type[nn.Module]] | None = None,
    additional_mapping: dict[type[nn.Module], type[nn.Module]] | None = None,
    output_dtype: torch.dtype = torch.float,
    per_table_weight_dtype: dict[str, torch.dtype] | None = None,
) -> nn.Module:
    """TorchRec's helper: ``torch.ao.quantization.quantize_dynamic`` of every
    EmbeddingBagCollection of ``module`` into a quantized one (weights ``dtype``, e.g.
    ``torch.qint8``, or ``per_table_weight_dtype`` per table; outputs ``output_dtype``).
    ``additional_qconfig_spec_keys`` / ``additional_mapping`` quantize more module types the
    same way (``{float type: quantized type}``)."""
    qconfig = QuantConfig(
        activation=torch.ao.quantization.PlaceholderObserver.with_args(dtype=output_dtype),
        weight=torch.ao.quantization.PlaceholderObserver.with_args(dtype=dtype),
        per_table_weight_dtype=per_table_weight_dtype,
    )
    qconfig_spec: dict[type[nn.Module], QuantConfig] = {EmbeddingBagCollection: qconfig}
    mapping: dict[type[nn.Module], type[nn.Module]] = {
        EmbeddingBagCollection: QuantEmbeddingBagCollection}
    for key in additional_qconfig_spec_keys or []:
        qconfig_spec[key] = qconfig
    mapping.update(additional_mapping or {})
    return torch.ao.quantization.quantize_dynamic(
        module, qconfig_spec=qconfig_spec, mapping=mapping, inplace=inplace)


def shard_quant_model(
    model: nn.Module,
    world_size: int = 1,
    compute_device: str = "cuda",
    sharding_device: str = "meta",
    sharders: list[ModuleSharder[nn.Module]] | None = None,
    device_memory_size: int | None = None,
    constraints: dict[str, Any] | None = None,
    ddr_cap: int | None = None,
    sharding_plan: ShardingPlan | None = None,
) -> tuple[nn.Module, ShardingPlan]:
    """TorchRec's signature: place the quantized tables table-wise on ``world_size`` devices
    of ``compute_device`` type (``cuda:0..``, or the host ``world_size`` times) and return
    ``(model, plan)``. The rows are copied (``sharding_device`` is accepted and not needed).
    ``constraints``, ``device_memory_size`` and ``ddr_cap`` are refused: plans here balance
    bytes table-wise; pass ``sharding_plan`` for a specific placement.
    """
    for name, value in (
        ("constraints", constraints),
        ("device_memory_size", device_memory_size),
        ("ddr_cap", ddr_cap),
    ):
        if value:
            raise ValueError(
                f"shard_quant_model: {name} is not supported for quantized inference placement; "
                "pass sharding_plan to choose the placement"
            )
    for sharder in sharders or []:
        if not isinstance(
            sharder, QuantEmbeddingBagCollectionSharder | QuantEmbeddingCollectionSharder
        ):
            raise ValueError(
                f"shard_quant_model: sharder {type(sharder).__name__} is not supported; only "
                "the quantized collections' sharders (QuantEmbeddingBagCollectionSharder, "
                "QuantEmbeddingCollectionSharder and their feature-processed / managed-collision "
                "forms)"
            )
    kind = torch.device(compute_device).type
    devices = [
        torch.device(kind, r) if kind == "cuda" else torch.device(kind) for r in range(world_size)
    ]
    if sharding_plan is None:
        sharding_plan = ShardingPlan(
            {
                path: quant_table_wise_plan(module, world_size, kind)
                for path, module in model.named_modules()
                if isinstance(module, QuantEmbeddingBagCollection | QuantEmbeddingCollection)
            }
        )
    sharded = _shard_quant_model(model, devices, plan=sharding_plan)
    return sharded, sharding_plan


def _quant_tables(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(table name, module holding its .weight)`` of every quantized collection's table."""
    out = []
    for m in model.modules():
        if isinstance(m, QuantEmbeddingBagCollection | ShardedQuantEmbeddingBagCollection):
            out.extend(m.embedding_bags.items())
        elif isinstance(m, QuantEmbeddingCollection | ShardedQuantEmbeddingCollection):
            out.extend(m.embeddings.items())
    return out


def get_table_to_weights_from_tbe(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{table: a copy of its quantized rows}`` from every quantized collection of ``model``
    (uint8 ``[rows, row bytes]``, scale and bias included; TorchRec returns per-TBE
    ``(weights, scale_shift)`` pairs)."""
    return {name: table.weight.detach().clone() for name, table in _quant_tables(model)}


def assign_weights_to_tbe(model: nn.Module, table_to_weight: Mapping[str, torch.Tensor]) -> None:
    """Copy rows from :func:`get_table_to_weights_from_tbe` into the tables of ``model``."""
    for name, table in _quant_tables(model):
        if name not in table_to_weight:
            raise KeyError(f"assign_weights_to_tbe: {name} not in table_to_weight")
        rows = table_to_weight[name]
        if rows.shape != table.weight.shape:
            raise ValueError(
                f"assign_weights_to_tbe: table {name!r} has rows {list(table.weight.shape)}, "
                f"got {list(rows.shape)}"
            )
        with torch.no_grad():
            table.weight.copy_(rows)


__all__ = [
    "DEFAULT_FUSED_PARAMS",
    "DEFAULT_QUANTIZATION_DTYPE",
    "DEFAULT_QUANT_MAPPING",
    "DEFAULT_SHARDERS",
    "BatchingMetadata",
    "PredictFactory",
    "PredictModule",
    "QualNameMetadata",
    "assign_weights_to_tbe",
    "get_table_to_weights_from_tbe",
    "quantize_embeddings",
    "quantize_inference_model",
    "set_pruning_data",
    "shard_quant_model",
]
