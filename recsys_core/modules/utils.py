"""Helpers shared by TorchRec-style modules (TorchRec's ``torchrec.modules.utils``)."""

import copy
import inspect
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn

from recsys_core.modules.hash_mc_modules import make_hash_zch_buckets_non_persistent
from recsys_core.modules.sorted_index_select import maybe_sorted_index_select
from recsys_core.sparse import JaggedTensor, KeyedJaggedTensor

ModuleOrTensorFn = nn.Module | Callable[[torch.Tensor], torch.Tensor]


def _takes_no_arguments(fn: Callable[..., object]) -> bool | None:
    """True if ``fn()`` is a valid call, False if it needs arguments, None if unknown."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins such as torch.relu have no signature
        return None
    for param in signature.parameters.values():
        if param.default is inspect.Parameter.empty and param.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        ):
            return False
    return True


def extract_module_or_tensor_callable(
    module_or_callable: Callable[[], nn.Module] | nn.Module | Callable[[torch.Tensor], torch.Tensor],
) -> ModuleOrTensorFn:
    """Resolve an activation argument the way TorchRec's MLP does.

    - a module instance, or a tensor function (``torch.relu``): returned as is (shared);
    - a zero-argument factory (``nn.ReLU``, ``lambda: nn.LayerNorm(8)``): called once, so each
      caller gets its own module; it must return an ``nn.Module``.
    """
    if isinstance(module_or_callable, nn.Module):
        return module_or_callable
    no_args = _takes_no_arguments(module_or_callable)
    # A callable with a required argument is the tensor function of the union; the others
    # are called with none (the factory), and what they return is checked below.
    tensor_fn = cast(Callable[[torch.Tensor], torch.Tensor], module_or_callable)
    factory = cast(Callable[[], object], module_or_callable)
    if no_args is False:
        return tensor_fn
    if no_args is None:  # no signature to read (a builtin): try the call
        try:
            made = factory()
        except TypeError as e:
            if "required positional argument" in str(e):
                return tensor_fn
            raise
    else:
        made = factory()
    if not isinstance(made, nn.Module):
        raise ValueError(
            "Expected callable that takes no input to return a torch.nn.Module, "
            f"but got: {type(made)}"
        )
    return made


def get_module_output_dimension(module: ModuleOrTensorFn, in_features: int) -> int:
    """Width of ``module``'s output for one input row of ``in_features`` zeros."""
    return module(torch.zeros(1, in_features)).size(-1)


def check_module_output_dimension(
    module: Iterable[nn.Module] | nn.Module, in_features: int, out_features: int
) -> bool:
    """True if ``module`` (or every module of a (nested) list) maps in_features -> out_features."""
    if isinstance(module, nn.Module) and not isinstance(module, nn.ModuleList):
        return get_module_output_dimension(module, in_features) == out_features
    return all(check_module_output_dimension(m, in_features, out_features) for m in module)


def init_mlp_weights_xavier_uniform(m: nn.Module) -> None:
    """Xavier-uniform weights and zero bias for an ``nn.Linear`` (use with ``module.apply``)."""
    if isinstance(m, nn.Linear):
        nn.init.xavier_uniform_(m.weight)
        if m.bias is not None:
            m.bias.data.fill_(0.0)


def construct_modulelist_from_single_module(module: nn.Module, sizes: tuple[int, ...]) -> nn.Module:
    """Nested ``ModuleList`` of shape ``sizes`` holding fresh copies of ``module``.

    Each copy's Linear layers are re-initialized, so copies do not start identical.
    """
    if len(sizes) == 1:
        return nn.ModuleList(
            copy.deepcopy(module).apply(init_mlp_weights_xavier_uniform) for _ in range(sizes[0])
        )
    return nn.ModuleList(
        construct_modulelist_from_single_module(module, sizes[1:]) for _ in range(sizes[0])
    )


def convert_list_of_modules_to_modulelist(
    modules: Iterable[Any], sizes: tuple[int, ...]
) -> nn.Module:
    """Nested list of modules -> nested ``ModuleList``; the outer count must equal ``sizes[0]``.

    ``modules`` nests ``len(sizes)`` levels deep (modules at the last level), hence ``Any``."""
    modules = list(modules)
    if len(modules) != sizes[0]:
        raise ValueError(
            f"the counts of modules ({len(modules)}) do not match with the required counts {sizes}"
        )
    if len(sizes) == 1:
        return nn.ModuleList(modules)
    return nn.ModuleList(
        convert_list_of_modules_to_modulelist(m, sizes[1:])
        for m in modules
    )


@torch.fx.wrap
def _fx_to_list(tensor: torch.Tensor) -> list[int]:
    return tensor.long().tolist()


def _permute_indices(indices: list[int], permute: list[int]) -> list[int]:
    return [indices[p] for p in permute] + indices[len(permute):]


def _jagged_tensors_from_rows(
    embeddings: torch.Tensor,
    lengths: torch.Tensor,
    length_per_key: list[int],
    values: torch.Tensor | None,
    embedding_names: list[str],
    need_indices: bool,
    features_to_permute_indices: dict[str, list[int]] | None,
) -> dict[str, JaggedTensor]:
    lengths_per_feature = torch.unbind(lengths, dim=0)
    rows_per_feature = torch.split(embeddings, length_per_key, dim=0)
    ids_per_feature = (
        torch.split(values, length_per_key) if need_indices and values is not None else None
    )
    positions: dict[str, list[int]] = {}
    for i, name in enumerate(embedding_names):
        positions.setdefault(name, []).append(i)
    out: dict[str, JaggedTensor] = {}
    for name, idx in positions.items():
        # column-wise shards of one feature come back as several entries: glue their columns
        if features_to_permute_indices and name in features_to_permute_indices:
            idx = _permute_indices(idx, features_to_permute_indices[name])
        rows = (
            rows_per_feature[idx[0]]
            if len(idx) == 1
            else torch.cat([rows_per_feature[i] for i in idx], dim=1)
        )
        out[name] = JaggedTensor(
            values=rows,
            lengths=lengths_per_feature[idx[0]],
            weights=ids_per_feature[idx[0]] if ids_per_feature is not None else None,
        )
    return out


def construct_jagged_tensors(
    embeddings: torch.Tensor,
    features: KeyedJaggedTensor,
    embedding_names: list[str],
    need_indices: bool = False,
    features_to_permute_indices: dict[str, list[int]] | None = None,
    original_features: KeyedJaggedTensor | None = None,
    reverse_indices: torch.Tensor | None = None,
    use_sorted_select: bool = False,
) -> dict[str, JaggedTensor]:
    """Per-feature ``JaggedTensor`` of looked-up rows (``embeddings``: one row per id of
    ``features``, key-major). ``need_indices`` puts each feature's ids in ``weights``;
    ``reverse_indices`` expands deduplicated rows back to one per id first, with
    ``use_sorted_select`` (TorchRec 1.9) through :func:`sorted_index_select` (same rows, a
    sorted float32 segment sum in backward) instead of ``index_select``."""
    if original_features is not None:
        features = original_features
    if reverse_indices is not None:
        embeddings = maybe_sorted_index_select(embeddings, reverse_indices, use_sorted_select)
    return _jagged_tensors_from_rows(
        embeddings,
        features.lengths().view(-1, features.stride()),
        features.length_per_key(),
        features.values(),
        embedding_names,
        need_indices,
        features_to_permute_indices,
    )


def construct_jagged_tensors_inference(
    embeddings: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    embedding_names: list[str],
    need_indices: bool = False,
    features_to_permute_indices: dict[str, list[int]] | None = None,
    reverse_indices: torch.Tensor | None = None,
) -> dict[str, JaggedTensor]:
    """As :func:`construct_jagged_tensors` from raw ``lengths`` of shape ``[F, B]``."""
    if reverse_indices is not None:
        embeddings = torch.index_select(embeddings, 0, reverse_indices.to(torch.int32))
    return _jagged_tensors_from_rows(
        embeddings,
        lengths,
        _fx_to_list(torch.sum(lengths, dim=1)),
        values,
        embedding_names,
        need_indices,
        features_to_permute_indices,
    )


def deterministic_dedup(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique ``ids`` and, for each, the position of its LAST occurrence in ``ids``.

    Used where duplicated ids would race in a scatter update: keeping the last write makes
    the result deterministic.
    """
    sorted_ids, order = ids.sort(stable=True)
    unique_ids, inverse = sorted_ids.unique_consecutive(return_inverse=True)
    last = torch.zeros_like(unique_ids, dtype=torch.int64).scatter_reduce(
        0, inverse, order, reduce="amax"
    )
    return unique_ids.view(-1), last.flatten()


__all__ = [
    "check_module_output_dimension",
    "construct_jagged_tensors",
    "construct_jagged_tensors_inference",
    "construct_modulelist_from_single_module",
    "convert_list_of_modules_to_modulelist",
    "deterministic_dedup",
    "extract_module_or_tensor_callable",
    "get_module_output_dimension",
    "init_mlp_weights_xavier_uniform",
    "make_hash_zch_buckets_non_persistent",
]
