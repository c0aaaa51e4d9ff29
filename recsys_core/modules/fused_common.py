"""What the fused collections share: optimizer arguments, per-table weight holders and the
object ``fused_optimizer()`` returns (the tables themselves live in a
:class:`~recsys_core.kernels.batched.BatchedTables`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from recsys_core.kernels.batched import BatchedTables
from recsys_core.kernels.config import EmbOptimType, FusedOptimizerConfig
from recsys_core.optim.fused import EmbeddingFusedOptimizer
from recsys_core.optim.keyed import CombinedOptimizer
from recsys_core.optim.rowwise_adagrad import RowWiseAdagrad

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def resolve_fused_config(
    optimizer_type: Any, optimizer_kwargs: Mapping[str, Any] | None
) -> FusedOptimizerConfig:
    """``optimizer_type`` is an EmbOptimType (ours or FBGEMM's; kwargs are fused_params keys such
    as ``learning_rate``) or a torch optimizer class (kwargs as for that class, e.g. ``lr``)."""
    if isinstance(optimizer_type, FusedOptimizerConfig):
        if optimizer_kwargs:
            raise ValueError("pass either a FusedOptimizerConfig or optimizer_kwargs, not both")
        return optimizer_type
    kwargs = dict(optimizer_kwargs or {})
    if isinstance(optimizer_type, type) and issubclass(optimizer_type, torch.optim.Optimizer):
        return FusedOptimizerConfig.from_torch_optimizer(optimizer_type, kwargs)
    return FusedOptimizerConfig.from_fused_params(
        {**kwargs, "optimizer": EmbOptimType.coerce(optimizer_type)}
    )


class FusedCollectionBase(nn.Module):
    """What the fused collections share: TorchRec's optimizer questions answered from what the
    collection was built with (``optimizer_type()``, ``optimizer_kwargs()`` (a copy),
    ``optimizer_config()``: the typed form its kernels run, ``fused_optimizer``), its
    ``device`` (fixed at construction: moving or casting raises), train mode passed to its
    table-batched kernels, and a deepcopy whose table parameters stay views of the copied
    kernels. A collection calls :meth:`_set_optimizer` in ``__init__`` and sets
    ``_device``, ``_batched`` (its tables) and ``_fused_optimizer``."""

    if TYPE_CHECKING:
        _device: torch.device
        _batched: BatchedTables
        _fused_optimizer: FusedCombinedOptimizer

    def _set_optimizer(
        self, optimizer_type: Any, optimizer_kwargs: Mapping[str, Any] | None
    ) -> None:
        self._optimizer_type = optimizer_type
        self._optimizer_kwargs = dict(optimizer_kwargs or {})
        self._optimizer_config = resolve_fused_config(optimizer_type, optimizer_kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> FusedCollectionBase:
        return deepcopy_with_kernel_views(self, self._kernels, memo)

    @property
    def _kernels(self) -> list[nn.Module]:
        """The table-batched kernels (one per pooling type; one SUM kernel for a sequence
        collection, where each id is a bag of its own)."""
        return self._batched.kernels

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def fused_optimizer(self) -> FusedCombinedOptimizer:
        """The optimizer applied in backward. Call it as TorchRec does, ``fused_optimizer()``
        (the returned optimizer is callable and returns itself)."""
        return self._fused_optimizer

    def optimizer_type(self) -> Any:
        return self._optimizer_type

    def optimizer_kwargs(self) -> dict[str, Any]:
        return dict(self._optimizer_kwargs)

    def optimizer_config(self) -> FusedOptimizerConfig:
        return self._optimizer_config

    def train(self, mode: bool = True) -> FusedCollectionBase:
        super().train(mode)
        self._batched.train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> FusedCollectionBase:
        probe = fn(torch.zeros(1, device=self._device))
        if probe.device != self._device or probe.dtype != torch.float32:
            raise ValueError(
                f"{self._get_name()} cannot be moved or cast after construction (its tables "
                "live inside table-batched kernels); build it with device=... instead"
            )
        return super()._apply(fn, recurse)


def convert_optimizer_type_and_kwargs(
    optimizer_type: type[torch.optim.Optimizer], optimizer_kwargs: Mapping[str, Any]
) -> tuple[EmbOptimType, dict[str, Any]] | None:
    """TorchRec's mapping of a torch optimizer class to the fused kernel's optimizer (``lr``
    becomes ``learning_rate``); None for a class that has no fused counterpart."""
    fused = {
        torch.optim.SGD: EmbOptimType.EXACT_SGD,
        torch.optim.Adagrad: EmbOptimType.EXACT_ADAGRAD,
        RowWiseAdagrad: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        torch.optim.Adam: EmbOptimType.ADAM,
    }.get(optimizer_type)
    if fused is None:
        return None
    kwargs = dict(optimizer_kwargs)
    if "lr" in kwargs:
        kwargs["learning_rate"] = kwargs.pop("lr")
    return fused, kwargs


def check_location(location: Any, device: torch.device, module: str) -> None:
    """TorchRec's ``location`` (an FBGEMM EmbeddingLocation): only where the device puts the
    tables anyway is accepted; caching locations come from the planner (CacheParams)."""
    if location is None:
        return
    name = getattr(location, "name", str(location)).upper()
    expected = "DEVICE" if device.type == "cuda" else "HOST"
    if name not in (expected, "DEVICE" if device.type == "meta" else expected):
        raise ValueError(
            f"{module}: location {name} is not supported on device {device.type}; leave "
            f"location=None (tables live in {expected} memory), or shard the module with a "
            "plan whose CacheParams asks for UVM caching"
        )


class FusedCombinedOptimizer(CombinedOptimizer):
    """The optimizer a fused collection returns from ``fused_optimizer()`` (TorchRec's method).

    Calling it returns itself, so code written for the earlier property form
    (``module.fused_optimizer.step()``) keeps working alongside ``module.fused_optimizer()``.
    """

    def __call__(self) -> FusedCombinedOptimizer:
        return self


class TableWeight(nn.Module):
    """Holds one table's weight: a view into its kernel's storage.

    ``saved=False`` leaves it out of the state dict: the owning collection saves and loads the
    table itself (a sharded collection's whole tables, ``ShardedTensor`` s over the ranks)."""

    def __init__(self, weight: nn.Parameter, *, saved: bool = True) -> None:
        super().__init__()
        self.weight = weight
        self.saved = saved

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        if self.saved:
            super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        if self.saved:
            super()._load_from_state_dict(*args, **kwargs)


def kernel_optimizer(
    kernel: nn.Module,
    params: Mapping[str, nn.Parameter],
    table_names: Sequence[str],
    kernel_tables: Sequence[int] | None = None,
) -> EmbeddingFusedOptimizer:
    """The optimizer fused into ``kernel``'s backward, over ``params`` (views of its tables'
    weights; arguments as ``EmbeddingFusedOptimizer``'s). The kernel owns the storage and
    updates it in backward: each parameter is tagged with this optimizer, so DDP and dense
    optimizers leave it alone (TorchRec's ``in_backward_optimizer_filter``)."""
    optim = EmbeddingFusedOptimizer(kernel, params, table_names, kernel_tables)
    for weight in params.values():
        weight._in_backward_optimizers = [optim]  # type: ignore[attr-defined]
    return optim


def fused_table_weights(
    tables: BatchedTables,
    names: Sequence[str],
    prefix: str,
    exposed: Sequence[bool] | None = None,
) -> tuple[dict[str, TableWeight], FusedCombinedOptimizer]:
    """Each exposed table's weight as a parameter (a view of its kernel's storage) in a holder
    keyed by table name, and the optimizer applied in backward: one EmbeddingFusedOptimizer per
    kernel, keyed by ``<prefix>.<table>.weight``. ``names[i]`` names the caller's table ``i``;
    a table not ``exposed`` is looked up and trained but has no parameter and no state key."""
    weights = tables.split_embedding_weights()
    holders: dict[str, TableWeight] = {}
    optims = []
    for kernel, members in zip(tables.kernels, tables.members, strict=True):
        params: dict[str, nn.Parameter] = {}
        positions = [p for p, i in enumerate(members) if exposed is None or exposed[i]]
        for position in positions:
            name = names[members[position]]
            weight = nn.Parameter(weights[members[position]])
            holders[name] = TableWeight(weight)
            params[f"{prefix}.{name}.weight"] = weight
        optims.append(
            kernel_optimizer(kernel, params, [names[members[p]] for p in positions], positions)
        )
    return holders, FusedCombinedOptimizer(optims)


def deepcopy_with_kernel_views(
    module: ModuleT, kernels: list[nn.Module], memo: dict[int, Any]
) -> ModuleT:
    """``copy.deepcopy`` of a fused collection whose table parameters stay views of the copied
    kernels' storage.

    A plain deepcopy clones each ``nn.Parameter`` on its own, so the copy's parameters (and
    its ``state_dict``) would stop following the copy's kernels after a fused update."""
    views: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    for kernel in kernels:
        copied = copy.deepcopy(kernel, memo)
        for old, new in zip(kernel.split_embedding_weights(), copied.split_embedding_weights(),
                            strict=True):
            views[(old.data_ptr(), tuple(old.shape))] = new
    for param in module.parameters():
        new_view = views.get((param.data_ptr(), tuple(param.shape)))
        if new_view is None or id(param) in memo:
            continue
        new_param = nn.Parameter(new_view, requires_grad=param.requires_grad)
        memo[id(param)] = new_param
        new_param.__dict__.update(copy.deepcopy(param.__dict__, memo))
    cls = type(module)
    new_module = cls.__new__(cls)
    memo[id(module)] = new_module
    for key, value in module.__dict__.items():
        object.__setattr__(new_module, key, copy.deepcopy(value, memo))
    return new_module
