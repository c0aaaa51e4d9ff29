"""TorchRec's ``torchrec.quant.embedding_modules``: quantized embedding bag collections.

``EmbeddingBagCollection`` here IS :class:`recsys_core.inference.QuantEmbeddingBagCollection`
(one int-n-bit buffer for all tables, FBGEMM's layout; see that class); ``EmbeddingCollection``
is the quantized sequence collection (:class:`recsys_core.quant.quant_sequence.
QuantEmbeddingCollection`), ``FeatureProcessedEmbeddingBagCollection`` and
``QuantManagedCollisionEmbeddingCollection`` the quantized forms of those modules. Each has
``from_float`` reading the float module's ``qconfig``, so TorchRec's
``torch.ao.quantization.quantize_dynamic(model, qconfig_spec, mapping)`` recipe works. The ``MODULE_ATTR_*``
names and ``quant_prep_*`` helpers mark float modules before quantization exactly as TorchRec
does; of those marks, this library's quantization reads only the pruning dict
(``MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT``): the others switch TorchRec's
FBGEMM-module registration and state-dict layouts, which this implementation does not have.
"""

import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch import nn

from recsys_core.modules.embedding_modules import EmbeddingBagCollection as _FloatEBC
from recsys_core.quant.dtypes import (
    MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT,
    resolve_quant_dtype,
)
from recsys_core.quant.quant_embedding import (
    QuantEmbeddingBagCollection,
    QuantFeatureProcessedEmbeddingBagCollection,
)
from recsys_core.quant.quant_sequence import (
    QuantEmbeddingCollection,
    QuantManagedCollisionEmbeddingCollection,
)

EmbeddingBagCollection = QuantEmbeddingBagCollection
EmbeddingCollection = QuantEmbeddingCollection
FeatureProcessedEmbeddingBagCollection = QuantFeatureProcessedEmbeddingBagCollection

MODULE_ATTR_REGISTER_TBES_BOOL: str = "__register_tbes_in_named_modules"
MODULE_ATTR_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: str = "__register_quant_state_dict_split_scale_bias"
MODULE_ATTR_ROW_ALIGNMENT_INT: str = "__register_row_alignment_in_named_modules"
MODULE_ATTR_REMOVE_STBE_PADDING_BOOL: str = "__remove_stbe_padding"
MODULE_ATTR_USE_UNFLATTENED_LENGTHS_FOR_BATCHING: str = "__use_unflattened_lengths_for_batching"
MODULE_ATTR_USE_BATCHING_HINTED_OUTPUT: str = "__use_batching_hinted_output"
MODULE_ATTR_CACHE_FEATURES_ORDER: str = "__cache_features_order"


def for_each_module_of_type_do(
    module: nn.Module, module_types: list[type[nn.Module]], op: Callable[[nn.Module], None]
) -> None:
    """Apply ``op`` to every submodule whose exact type is one of ``module_types``."""
    for m in module.modules():
        if any(type(m) is t for t in module_types):
            op(m)


def quant_prep_enable_quant_state_dict_split_scale_bias(module: nn.Module) -> None:
    setattr(module, MODULE_ATTR_QUANT_STATE_DICT_SPLIT_SCALE_BIAS, True)


def quant_prep_enable_quant_state_dict_split_scale_bias_for_types(
    module: nn.Module, module_types: list[type[nn.Module]]
) -> None:
    for_each_module_of_type_do(
        module, module_types, quant_prep_enable_quant_state_dict_split_scale_bias
    )


def quant_prep_enable_register_tbes(module: nn.Module, module_types: list[type[nn.Module]]) -> None:
    for_each_module_of_type_do(
        module, module_types, lambda m: setattr(m, MODULE_ATTR_REGISTER_TBES_BOOL, True)
    )


def quant_prep_customize_row_alignment(
    module: nn.Module, module_types: list[type[nn.Module]], row_alignment: int
) -> None:
    for_each_module_of_type_do(
        module, module_types, lambda m: setattr(m, MODULE_ATTR_ROW_ALIGNMENT_INT, row_alignment)
    )


def quant_prep_enable_cache_features_order(
    module: nn.Module, module_types: list[type[nn.Module]]
) -> None:
    for_each_module_of_type_do(
        module, module_types, lambda m: setattr(m, MODULE_ATTR_CACHE_FEATURES_ORDER, True)
    )


def quantize_meta_collections(
    model: nn.Module,
    dtype: torch.dtype,
    per_table_dtype: Mapping[str, torch.dtype] | None = None,
) -> nn.Module:
    """Replace every float EmbeddingBagCollection on the meta device by a quantized one with
    zero rows on the host (TorchRec's meta-model flow: build, quantize, shard, then load
    weights). Pruned tables get their post-pruning row count. Returns the (new) model."""
    found = [
        (p, m)
        for p, m in model.named_modules()
        if isinstance(m, _FloatEBC) and m.device.type == "meta"
    ]
    for path, module in found:
        pruning = getattr(module, MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT, None)
        configs = [
            dataclasses.replace(
                c,
                data_type=resolve_quant_dtype((per_table_dtype or {}).get(c.name, dtype)),
                num_embeddings_post_pruning=(pruning or {}).get(
                    c.name, c.num_embeddings_post_pruning
                ),
            )
            for c in module.embedding_bag_configs()
        ]
        quantized = QuantEmbeddingBagCollection(configs, module.is_weighted(), torch.device("cpu"))
        if not path:
            return quantized
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, quantized)
    return model


__all__ = [
    "MODULE_ATTR_CACHE_FEATURES_ORDER",
    "MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT",
    "MODULE_ATTR_QUANT_STATE_DICT_SPLIT_SCALE_BIAS",
    "MODULE_ATTR_REGISTER_TBES_BOOL",
    "MODULE_ATTR_REMOVE_STBE_PADDING_BOOL",
    "MODULE_ATTR_ROW_ALIGNMENT_INT",
    "MODULE_ATTR_USE_BATCHING_HINTED_OUTPUT",
    "MODULE_ATTR_USE_UNFLATTENED_LENGTHS_FOR_BATCHING",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "FeatureProcessedEmbeddingBagCollection",
    "QuantManagedCollisionEmbeddingCollection",
    "for_each_module_of_type_do",
    "quant_prep_customize_row_alignment",
    "quant_prep_enable_cache_features_order",
    "quant_prep_enable_quant_state_dict_split_scale_bias",
    "quant_prep_enable_quant_state_dict_split_scale_bias_for_types",
    "quant_prep_enable_register_tbes",
    "quantize_meta_collections",
]
