"""``DistributedModelParallel``: shard a model's embedding collections, data-parallelize the rest.

    dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    loss = loss_fn(dmp(batch), labels); loss.backward()   # embedding updates happen here
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense_optimizer]); optimizer.step()

Without a plan, ``recsys_core.planner`` plans one (on rank 0, broadcast to all ranks) for the
ranks of ``env`` with the memory this machine has free (``recsys_core.planner.detect_topology``,
the smallest reading of all ranks), not TorchRec's 128 GiB-per-host constant: a model that
cannot fit fails at planning with a ``PlannerError``, before anything is allocated.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recsys_core.distributed.embedding import (
    ShardedEmbeddingCollection,
)
from recsys_core.distributed.embeddingbag import (
    ShardedEmbeddingBagCollection,
)
from recsys_core.distributed.sharding_plan import (
    get_default_sharders as get_default_sharders,
)
from recsys_core.distributed.sharding_plan import get_executable_default_sharders
from recsys_core.distributed.sharding_plan import (
    get_module_to_default_sharders as get_module_to_default_sharders,
)
from recsys_core.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
from recsys_core.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recsys_core.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from recsys_core.optim.keyed import CombinedOptimizer
from recsys_core.planner.planner import plan_for_env

_SHARDABLE = (EmbeddingBagCollection, EmbeddingCollection, FusedEmbeddingBagCollection)
_SHARDED = (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)
Sharder = ModuleSharder[nn.Module]


class DistributedModelParallel(nn.Module):
    """Shards every EmbeddingBagCollection / EmbeddingCollection of ``module`` and wraps the
    dense rest in DDP.

    Args:
        module: the model (may be built on ``device="meta"``: only local shards are allocated,
            dense meta parameters are materialized and reset on ``device``).
        env: ranks to shard over; default: the default process group (or a single rank).
        device: where shards and dense parameters live.
        plan: a ShardingPlan keyed by module path; default: the planner's plan for ``env`` and
            the memory this machine has free (``recsys_core.planner.plan_for_env``).
        sharders: default :func:`~recsys_core.distributed.sharding_plan.get_default_sharders`
            without the managed-collision ones, which this library does not execute.
        init_data_parallel: wrap the dense parameters in DistributedDataParallel now; with
            False, call :meth:`init_data_parallel` later (e.g. after a first forward on a meta
            module, as TorchRec's tests do).
        init_parameters: accepted for TorchRec's signature; parameters on the meta device are
            always materialized on ``device``.
    """

    def __init__(
        self,
        module: nn.Module,
        env: ShardingEnv | None = None,
        device: torch.device | None = None,
        plan: ShardingPlan | None = None,
        sharders: Sequence[Sharder] | None = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
    ) -> None:
        super().__init__()
        if env is None:
            env = (
                ShardingEnv.from_process_group(dist.GroupMember.WORLD)
                if dist.is_initialized()
                else ShardingEnv.from_local(1, 0)
            )
        self._env = env
        self._device = torch.device(device or "cpu")
        self._sharders = list(sharders or get_executable_default_sharders())
        if plan is None:
            plan = plan_for_env(module, env, self._sharders, self._device)
        self._plan = plan
        self._sharded_paths: list[str] = []
        module = self._shard(module)
        self._materialize_dense(module)
        self._fused_optimizer = CombinedOptimizer([
            (path, sub.fused_optimizer)
            for path, sub in module.named_modules()
            if isinstance(sub, _SHARDED)
        ])
        self._dmp_wrapped_module: nn.Module = module
        self._ddp_initialized = False
        if init_data_parallel:
            self.init_data_parallel()

    def init_data_parallel(self) -> None:
        """Wrap the dense part in DistributedDataParallel (once; nothing on a single rank)."""
        if self._ddp_initialized:
            return
        self._ddp_initialized = True
        if self._env.pg is not None and self._env.world_size > 1:
            self._dmp_wrapped_module = self._wrap_ddp(self._dmp_wrapped_module)

    # ---- construction ------------------------------------------------------------------------
    def _sharder_for(self, sub: nn.Module) -> Sharder | None:
        for sharder in self._sharders:
            if isinstance(sub, sharder.module_type):
                return sharder
        return None

    def _shard(self, module: nn.Module) -> nn.Module:
        planned = list(self._plan.plan)
        unplanned = [
            path for path, sub in module.named_modules()
            if isinstance(sub, _SHARDABLE)
            # a collection inside a planned module (e.g. a feature-processed EBC's) is covered
            and not any(path == p or not p or path.startswith(p + ".") for p in planned)
        ]
        if unplanned:
            raise ValueError(
                f"the sharding plan has no entry for module(s) {unplanned}; plan every "
                "embedding collection (module paths as in model.named_modules())"
            )
        for path, module_plan in self._plan.plan.items():
            sub = module.get_submodule(path) if path else module
            sharder = self._sharder_for(sub)
            if sharder is None:
                raise ValueError(
                    f"plan entry {path!r} names a {type(sub).__name__}, which no sharder handles"
                )
            sharded = sharder.shard(sub, module_plan, self._env, self._device)
            self._sharded_paths.append(path)
            if not path:
                return sharded
            parent_path, _, name = path.rpartition(".")
            parent = module.get_submodule(parent_path) if parent_path else module
            setattr(parent, name, sharded)
        return module

    def _materialize_dense(self, module: nn.Module) -> None:
        for sub in module.modules():
            if isinstance(sub, _SHARDED):
                continue
            own = list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False))
            if any(t.is_meta for t in own):
                sub.to_empty(device=self._device, recurse=False)
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
            elif any(t.device != self._device for t in own):
                sub._apply(lambda t: t.to(self._device), recurse=False)

    def _wrap_ddp(self, module: nn.Module) -> nn.Module:
        # Everything of the sharded collections stays out of DDP, data-parallel DENSE replicas
        # included: their strategy averages their gradients itself (dense_data_parallel).
        ignore = [
            # every alias (a table weight is registered under its table name and its kernel)
            name for name, _ in list(module.named_parameters(remove_duplicate=False))
            + list(module.named_buffers(remove_duplicate=False))
            if any(name == p or name.startswith(p + ".") or not p for p in self._sharded_paths)
        ]
        dense = [
            p for name, p in module.named_parameters() if name not in set(ignore) and p.requires_grad
        ]
        if not dense:
            return module
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignore)
        # TorchRec's settings: a static graph lets dense parameters that no forward uses (and
        # their buckets) be reduced correctly; buffers are not broadcast each step. torch
        # announces broadcast_buffers' successor, which would still sync buffers at init (and
        # itself says to keep broadcast_buffers=False until it does not): hide that notice only.
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning
            )
            return DistributedDataParallel(
                module, process_group=self._env.pg, gradient_as_bucket_view=True,
                broadcast_buffers=False, static_graph=True,
            )

    # ---- API ----------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The sharded model without the DDP wrapper."""
        wrapped = self._dmp_wrapped_module
        return wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped

    @property
    def data_parallel(self) -> DistributedDataParallel | None:
        """The DDP wrapper of the dense part (None on one rank or without dense parameters),
        e.g. to register a comm hook."""
        wrapped = self._dmp_wrapped_module
        return wrapped if isinstance(wrapped, DistributedDataParallel) else None

    @property
    def plan(self) -> ShardingPlan:
        return self._plan

    @property
    def fused_optimizer(self) -> CombinedOptimizer:
        return self._fused_optimizer

    @property
    def env(self) -> ShardingEnv:
        return self._env

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._dmp_wrapped_module(*args, **kwargs)

    # Names as in the unsharded model: no ``_dmp_wrapped_module.`` / DDP ``module.`` prefix.
    def state_dict(  # type: ignore[override]
        self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """Dense tensors as usual; each sharded table as a ShardedTensor (``torch.distributed
        .checkpoint`` saves and reshards it), data-parallel tables as plain tensors."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(  # type: ignore[override]
        self,
        state_dict: Mapping[str, Any],
        prefix: str | bool = "",
        strict: bool = True,
        assign: bool = False,
    ) -> Any:
        """Load a state dict whose keys start with ``prefix`` (TorchRec's second argument, as
        written by ``state_dict(prefix=...)``); a bool there is read as torch's ``strict``."""
        if isinstance(prefix, bool):
            prefix, strict = "", prefix
        if prefix:
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        return self.module.load_state_dict(dict(state_dict), strict=strict, assign=assign)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.module.named_buffers(prefix, recurse, remove_duplicate)


class DMPCollection(DistributedModelParallel):
    """TorchRec's 2D parallelism (each table sharded within a group of ranks, the groups
    replicating one another). Not implemented by this library: constructing one raises an
    error saying so; DistributedModelParallel shards every table over all ranks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: D107
        raise ValueError(
            "DMPCollection (2D parallelism: sharding groups that replicate each other) is not "
            "implemented by recsys_core; use DistributedModelParallel, which shards over all ranks"
        )
