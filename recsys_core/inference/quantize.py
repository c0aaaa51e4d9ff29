"""``quantize_inference_model``: every pooled embedding collection of a model, quantized.

Example::

    model = DLRM(...)                       # sparse_arch.embedding_bag_collection: an EBC
    quantize_inference_model(model, DataType.INT8)
    # model.sparse_arch.embedding_bag_collection is now a QuantEmbeddingBagCollection
    # (INT8 rows with fp16 scale/bias); dense layers untouched unless quantize_dense=True
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import nn

from recsys_core.inference.quant_embedding import QuantEmbeddingBagCollection
from recsys_core.kernels.config import KernelBackend
from recsys_core.modules.embedding_configs import DataType
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection

# The torch dtypes TorchRec users pass (``quantize_embeddings(model, dtype=torch.qint8)``).
TORCH_DTYPE_ALIASES: dict[torch.dtype, DataType] = {
    torch.float32: DataType.FP32,
    torch.float16: DataType.FP16,
    torch.qint8: DataType.INT8,
    torch.quint8: DataType.INT8,
    torch.int8: DataType.INT8,
    torch.uint8: DataType.INT8,
    torch.quint4x2: DataType.INT4,
    torch.quint2x4: DataType.INT2,
}

QuantDType = DataType | torch.dtype

# The attribute TorchRec's ``set_pruning_data`` puts on a collection: {table: rows kept}.
MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT: str = (
    "__emb_name_to_num_rows_post_pruning"
)


def resolve_quant_dtype(dtype: QuantDType) -> DataType:
    """A DataType from a DataType or one of the torch dtypes in :data:`TORCH_DTYPE_ALIASES`."""
    if isinstance(dtype, DataType):
        return dtype
    if isinstance(dtype, torch.dtype) and dtype in TORCH_DTYPE_ALIASES:
        return TORCH_DTYPE_ALIASES[dtype]
    aliases = ", ".join(str(d) for d in TORCH_DTYPE_ALIASES)
    raise ValueError(
        f"unsupported quantization dtype {dtype!r}; use a DataType (FP32, FP16, INT8, INT4, "
        f"INT2) or one of {aliases}"
    )


def quantize_inference_model(
    model: nn.Module,
    dtype: QuantDType = DataType.INT8,
    *,
    table_dtypes: Mapping[str, QuantDType] | None = None,
    quantize_dense: bool = False,
    backend: KernelBackend = KernelBackend.AUTO,
) -> nn.Module:
    """Replace every EmbeddingBagCollection / FusedEmbeddingBagCollection with a
    :class:`QuantEmbeddingBagCollection` holding the same tables quantized, every
    EmbeddingCollection with a ``QuantEmbeddingCollection`` and every
    ManagedCollisionEmbeddingCollection with a ``QuantManagedCollisionEmbeddingCollection``
    (its remapping kept, frozen).

    Modified in place and returned; if ``model`` itself is a collection the new module is
    returned. Each quantized collection stays on its collection's device.

    Args:
        model: the trained model (unsharded; load a sharded checkpoint into it first).
        dtype: storage type of every table: a DataType or a torch dtype alias (``torch.qint8``
            -> INT8, ``torch.quint4x2`` -> INT4, ``torch.float16`` -> FP16).
        table_dtypes: per table name, a different type (e.g. keep a small table FP16). Every
            name must be a table of some collection.
        quantize_dense: also quantize ``nn.Linear`` layers dynamically to int8
            (``torch.ao.quantization.quantize_dynamic``; int8 weights, activations quantized
            per batch; CPU only).
        backend: kernel choice for the quantized collections (AUTO: FBGEMM where available).
    """
    from recsys_core.inference.quant_sequence import (
        QuantEmbeddingCollection,
        QuantManagedCollisionEmbeddingCollection,
    )
    from recsys_core.modules.embedding_collection import EmbeddingCollection
    from recsys_core.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection

    default = resolve_quant_dtype(dtype)
    overrides = {name: resolve_quant_dtype(d) for name, d in (table_dtypes or {}).items()}
    kinds = (
        EmbeddingBagCollection, FusedEmbeddingBagCollection, EmbeddingCollection,
        ManagedCollisionEmbeddingCollection,
    )
    # The EmbeddingCollection inside a managed-collision one is quantized with its parent.
    inner = {
        id(m._embedding_module)
        for m in model.modules()
        if isinstance(m, ManagedCollisionEmbeddingCollection)
    }
    collections = [
        (path, module)
        for path, module in model.named_modules()
        if isinstance(module, kinds) and id(module) not in inner
    ]
    _refuse_sharded(model)

    def configs_of(module: nn.Module) -> list:
        if hasattr(module, "embedding_bag_configs"):
            return list(module.embedding_bag_configs())
        return list(module.embedding_configs())

    seen = {c.name for _, m in collections for c in configs_of(m)}
    unknown = sorted(set(overrides) - seen)
    if unknown:
        raise ValueError(
            f"quantize_inference_model: table_dtypes names {unknown}, which no collection of the "
            f"model has (its tables: {sorted(seen)})"
        )
    # All quantized first: a bad table leaves the model as it was.
    replacements = []
    for path, module in collections:
        per_table = {c.name: overrides.get(c.name, default) for c in configs_of(module)}
        if isinstance(module, ManagedCollisionEmbeddingCollection):
            quantized = QuantManagedCollisionEmbeddingCollection.from_float(
                module, dtype=per_table, backend=backend
            )
            replacements.append((path, quantized))
            continue
        if isinstance(module, EmbeddingCollection):
            quantized = QuantEmbeddingCollection.from_float(
                module, dtype=per_table, backend=backend
            )
            replacements.append((path, quantized))
            continue
        pruning = getattr(module, MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT, None)
        pruning = {k: v for k, v in (pruning or {}).items() if k in per_table}
        replacements.append(
            (
                path,
                QuantEmbeddingBagCollection.from_float(
                    module, per_table, backend=backend, rows_post_pruning=pruning
                ),
            )
        )
    for path, quantized in replacements:
        if not path:
            model = quantized
            continue
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, quantized)
    if quantize_dense:
        model = _quantize_linear_dynamic(model)
    return model


def _refuse_sharded(model: nn.Module) -> None:
    from recsys_core.distributed.embeddingbag import ShardedEmbeddingBagCollection

    for path, module in model.named_modules():
        if isinstance(module, ShardedEmbeddingBagCollection):
            raise ValueError(
                f"quantize_inference_model: {path or 'the model'} is a sharded training module; "
                "load the checkpoint into an unsharded model and quantize that"
            )


def _quantize_linear_dynamic(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        # torch.ao.quantization announces its move to torchao; nothing for our users to act on.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*deprecated.*", category=UserWarning)
        return torch.ao.quantization.quantize_dynamic(
            model, {nn.Linear}, dtype=torch.qint8, inplace=True
        )
