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

from recsys_core.kernels.config import KernelBackend
from recsys_core.modules.embedding_configs import DataType
from recsys_core.modules.embedding_modules import EmbeddingBagCollection
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from recsys_core.quant.dtypes import (
    MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT,
    QuantDType,
    resolve_quant_dtype,
)
from recsys_core.quant.quant_embedding import QuantEmbeddingBagCollection


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
    from recsys_core.modules.embedding_collection import EmbeddingCollection
    from recsys_core.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
    from recsys_core.quant.quant_sequence import (
        QuantEmbeddingCollection,
        QuantManagedCollisionEmbeddingCollection,
    )

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
